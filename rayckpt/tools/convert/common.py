"""What the formats share with ``convert()``: the ``ConvertInfo`` record each conversion
returns, and the helpers exports use to pick keys, place them and report progress.

It imports no other module of this package, so ``core``, ``streaming`` and every format
module can import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...format.paths import Path, strip_prefix
from ..reader import CheckpointReader, Progress, tensor_nbytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ConvertInfo:
    src: str
    dst: str
    #: The other format: what was written (``direction="to"``) or read (``"from"``).
    format: str
    direction: str
    tensors: int
    values: int
    #: Tensor payload bytes converted.
    bytes: int
    #: Files written, relative to ``dst`` (``dst`` itself for a torch file).
    files: tuple[str, ...]


def selected(reader: CheckpointReader, prefix: str) -> list[tuple[str, str]]:
    """(key in the checkpoint, key in the output) for every entry under ``prefix``.

    Args:
        reader: The checkpoint being exported.
        prefix: Keep only keys starting with it; it is stripped from the output keys.

    Returns:
        One ``(checkpoint key, output key)`` pair per selected entry, in manifest order.

    Raises:
        ValueError: No key in the checkpoint starts with ``prefix``.
    """
    keys = [(k, k[len(prefix) :]) for k in reader.manifest.entries if k.startswith(prefix)]
    if not keys:
        raise ValueError(f"no key in {reader.ckdir.location} starts with prefix {prefix!r}")
    return keys


def output_path(reader: CheckpointReader, key: str, prefix: str) -> Path:
    """Where ``key`` goes in a nested export: its saved path less the parts that spell ``prefix``.

    Args:
        reader: The checkpoint being exported.
        key: A key of the checkpoint that starts with ``prefix``.
        prefix: The prefix the export strips.

    Returns:
        The path of ``key`` through the exported nested state dict.

    Raises:
        KeyError: ``key`` is not in the checkpoint.
    """
    return strip_prefix(reader.manifest.path(key), key, prefix)


def progress_over(reader: CheckpointReader, keys: Iterable[str], on_progress: Progress | None) -> Callable[[str], None]:
    """A callback to call after each tensor key is written, reporting bytes done.

    Args:
        reader: The checkpoint being exported.
        keys: The tensor keys the export writes; their bytes make the total.
        on_progress: Called as ``on_progress(done, total)`` after each key, if given.

    Returns:
        ``advance(key)``: adds ``key``'s bytes to those done and reports them.

    Raises:
        KeyError: One of ``keys`` is not a tensor of the checkpoint.
    """
    nbytes = {k: tensor_nbytes(reader.manifest.tensor(k)) for k in keys}
    total = sum(nbytes.values())
    done = 0

    def advance(key: str) -> None:
        nonlocal done
        done += nbytes[key]
        if on_progress:
            on_progress(done, total)

    return advance
