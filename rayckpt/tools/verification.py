"""``verify``: prove a checkpoint intact by reading every byte. Ray-free, one process.

Checks every block's checksum, that chunks tile each tensor exactly once, that
every file the manifest names exists with the recorded size, and that each
shard file's Arrow layout matches the manifest. Collects every problem rather
than stopping at the first.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass, field, replace

import pyarrow as pa

from ..errors import CorruptCheckpointError
from ..format.file_paths import is_shared
from ..format.manifest import MANIFEST_NAME, ChunkEntry, Manifest, TensorEntry
from ..format.manifest_checks import find_manifest_problems
from ..format.shard_file import ShardReader
from ..storage.checkpoint_dir import CheckpointDir, join_location
from ..storage.commit import decode_stored_manifest, shard_file_save_id
from ..storage.shared import stored_refs
from .opening import Progress, resolve_checkpoint

#: Verification reads chunks in windows of this many bytes (a multiple of any block size
#: up to 64 MiB), so a remote chunk is never held whole in memory.
VERIFY_WINDOW_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """One thing wrong with a checkpoint."""

    #: "manifest", "missing", "link" (a symbolic link, not followed), "size", "truncated", "checksum" or "arrow".
    kind: str
    message: str
    file: str | None = None
    key: str | None = None
    #: Absolute byte range in ``file`` that is affected.
    start: int | None = None
    end: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyReport:
    path: str
    ok: bool
    files_checked: int
    chunks_checked: int
    bytes_checked: int
    problems: tuple[Problem, ...] = field(default=())


def verify(ckpt: str | os.PathLike[str] | CheckpointDir, *, on_progress: Progress | None = None) -> VerifyReport:
    """Check a checkpoint end to end, reading every byte; collect every problem instead of stopping at the first.

    Checks, in order:

    1. The manifest parses and is consistent (dtypes, sizes, checksum counts,
       chunks tile each tensor exactly once).
    2. Every file it names exists, is not a symbolic link, has the recorded size
       and is a readable Arrow IPC file holding the chunks the manifest says.
    3. Every byte of every chunk matches its block's checksum (the manifest's
       ``checksum``: XXH3-64, or CRC-32 in version-1 checkpoints), read in bounded
       windows so memory stays small whatever the checkpoint's size.

    Args:
        ckpt: A checkpoint directory: a local path, a ``pyarrow.fs`` URI, the
            ``manifest.json`` inside one, or a ``CheckpointDir``.
        on_progress: Called with (bytes checked, bytes in all) as the checksums
            advance.

    Returns:
        A ``VerifyReport``: ``ok`` when nothing is wrong, otherwise each
            ``Problem`` with its kind, file, key and affected byte range. A manifest
            that does not parse is reported as a problem, not raised.

    Raises:
        CheckpointNotFoundError: ``ckpt`` does not exist, or holds no committed
            checkpoint (no ``manifest.json``); the message says what is there.
    """
    ckdir = resolve_checkpoint(ckpt)
    where = join_location(ckdir.location, MANIFEST_NAME)
    try:
        m = decode_stored_manifest(ckdir)
    except CorruptCheckpointError as exc:
        return VerifyReport(
            path=ckdir.location,
            ok=False,
            files_checked=0,
            chunks_checked=0,
            bytes_checked=0,
            problems=(Problem(kind="manifest", message=str(exc), file=MANIFEST_NAME),),
        )
    problems = [
        Problem(kind="manifest", message=f"{where}: {p}", file=MANIFEST_NAME) for p in find_manifest_problems(m)
    ]
    by_file: dict[str, list[tuple[str, ChunkEntry]]] = {f.path: [] for f in m.files}
    for key, e in m.entries.items():
        if isinstance(e, TensorEntry):
            for c in e.chunks:
                by_file[c.file].append((key, c))
    actual = _check_files(ckdir, m, by_file, problems)
    total = sum(c.byte_length for path in actual for _, c in by_file[path])
    reader = ShardReader(ckdir, m.blocks, actual)
    done = chunks = 0
    try:
        for path in actual:
            for key, c in by_file[path]:
                problems.extend(_check_chunk(reader, key, c, actual[path]))
                chunks += 1
                done += c.byte_length
                if on_progress:
                    on_progress(done, total)
    finally:
        reader.close()
    return VerifyReport(
        path=ckdir.location,
        ok=not problems,
        files_checked=len(actual),
        chunks_checked=chunks,
        bytes_checked=reader.bytes_read,
        problems=tuple(_with_owner(ckdir, m.save_id, problems)),
    )


def _check_files(
    ckdir: CheckpointDir, m: Manifest, by_file: dict[str, list[tuple[str, ChunkEntry]]], problems: list[Problem]
) -> dict[str, int]:
    """Step 2 of ``verify``: each file the manifest names is there, no link, of its size, and a readable Arrow
    file with its chunks (problems appended to ``problems``). Returns the size of each file that is there."""
    actual: dict[str, int] = {}
    for f in m.files:
        keys = sorted({k for k, _ in by_file[f.path]})
        try:
            size = ckdir.size(f.path)
        except CorruptCheckpointError as exc:  # a symbolic link: not followed, not read
            problems.append(Problem(kind="link", message=f"{exc}; it holds {_some(keys)}", file=f.path))
            continue
        if size is None:
            problems.append(
                Problem(
                    kind="missing",
                    message=f"shard file {f.path!r} is missing ({f.size} bytes recorded); it holds {_some(keys)}",
                    file=f.path,
                    start=0,
                    end=f.size,
                )
            )
            continue
        actual[f.path] = size
        if size != f.size:
            problems.append(
                Problem(
                    kind="size",
                    message=(
                        f"shard file {f.path!r} has {size} bytes but the manifest recorded {f.size}: "
                        "truncated or replaced"
                    ),
                    file=f.path,
                    start=min(size, f.size),
                    end=max(size, f.size),
                )
            )
        else:
            problems.extend(_check_arrow(ckdir, f.path, by_file[f.path], m))
    return actual


def _with_owner(ckdir: CheckpointDir, save_id: str, problems: list[Problem]) -> list[Problem]:
    """Each problem in a shared store file (an incremental save's), with the save that wrote it and
    where that save's checkpoint is (or that it is gone): every checkpoint naming the file shares the damage."""
    owners: dict[str, str] = {}
    for p in problems:
        if p.file and is_shared(p.file) and (writer := shard_file_save_id(posixpath.basename(p.file))):
            owners.setdefault(writer, "")
    if not owners:
        return problems
    for name in ckdir.parent().list_dirs():
        try:
            refs = stored_refs(ckdir.parent().child(name))
        except (ValueError, OSError):
            continue
        if refs is not None and refs[0] in owners:
            owners[refs[0]] = join_location(ckdir.parent().location, name)
    out = []
    for p in problems:
        writer = shard_file_save_id(posixpath.basename(p.file)) if p.file and is_shared(p.file) else None
        if writer is None:
            out.append(p)
            continue
        whose = "this save" if writer == save_id else f"save {writer}"
        home = f"its checkpoint {owners[writer]}" if owners.get(writer) else "its own checkpoint is gone"
        note = f" [shared store file written by {whose} ({home}); every checkpoint that names it shares this damage]"
        out.append(replace(p, message=p.message + note))
    return out


def _some(keys: list[str], n: int = 5) -> str:
    if not keys:
        return "no chunk"
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return "key(s) " + ", ".join(repr(k) for k in keys[:n]) + more


def _check_chunk(reader: ShardReader, key: str, c: ChunkEntry, file_size: int) -> list[Problem]:
    """Read every byte of one chunk in bounded windows and check every block's checksum."""
    end = c.byte_offset + c.byte_length
    if end > file_size:
        return [
            Problem(
                kind="truncated",
                message=f"shard file {c.file!r}, key {key!r}: bytes [{c.byte_offset}, {end}) of the chunk at offsets "
                f"{list(c.box.offsets)} lie past the end of the file ({file_size} bytes)",
                file=c.file,
                key=key,
                start=c.byte_offset,
                end=end,
            )
        ]
    bs = reader.block_size
    if len(c.checksums) != -(-c.byte_length // bs):
        return []  # already reported as a manifest problem
    window = max(bs, VERIFY_WINDOW_BYTES // bs * bs)
    problems = []
    for lo in range(0, c.byte_length, window):
        hi = min(lo + window, c.byte_length)
        buf = reader.read(c.file, c.byte_offset + lo, hi - lo)
        for b_lo in range(lo, hi, bs):
            b_hi = min(b_lo + bs, hi)
            try:
                reader.verify([(c.byte_offset + lo, memoryview(buf))], key, c, b_lo, b_hi)
            except CorruptCheckpointError as exc:
                problems.append(
                    Problem(
                        kind="checksum",
                        message=str(exc),
                        file=c.file,
                        key=key,
                        start=c.byte_offset + b_lo,
                        end=c.byte_offset + b_hi,
                    )
                )
        # Unmap what was read, so resident memory stays one window, not the whole checkpoint.
        del buf
        reader.close()
    return problems


def _check_arrow(ckdir: CheckpointDir, path: str, chunks: list[tuple[str, ChunkEntry]], m: Manifest) -> list[Problem]:
    """The file is Arrow IPC and its record batches are exactly the chunks the manifest places in it."""
    expected = {(k, c.box.offsets, c.box.sizes) for k, c in chunks}
    dtypes = {k: m.tensor(k).dtype for k, _ in chunks}
    found = set()
    try:
        with ckdir.open_input(path) as f:
            reader = pa.ipc.open_file(f)
            for i in range(reader.num_record_batches):
                _, meta = reader.get_batch_with_custom_metadata(i)
                meta = {k.decode(): v.decode() for k, v in (meta or {}).items()}
                key = meta.get("key", "")
                box = (tuple(_json_ints(meta.get("offsets"))), tuple(_json_ints(meta.get("sizes"))))
                found.add((key, *box))
                if key in dtypes and meta.get("dtype") != dtypes[key]:
                    return [
                        _arrow_problem(
                            path, f"key {key!r} is {meta.get('dtype')} here but {dtypes[key]} in the manifest"
                        )
                    ]
    except (pa.ArrowInvalid, OSError, ValueError) as exc:
        return [_arrow_problem(path, f"not a readable Arrow IPC file ({exc})")]
    missing = expected - found
    if missing:
        key, offsets, _ = sorted(missing)[0]
        return [
            _arrow_problem(
                path,
                f"{len(missing)} chunk(s) the manifest places here are not in the file, e.g. key {key!r} "
                f"at offsets {list(offsets)}",
            )
        ]
    return []


def _json_ints(text: str | None) -> list[int]:
    value = json.loads(text or "null")
    if not isinstance(value, list):
        raise ValueError(f"batch metadata {text!r} is not a list")
    return value


def _arrow_problem(path: str, what: str) -> Problem:
    return Problem(kind="arrow", message=f"shard file {path!r}: {what}", file=path)


# ---------------------------------------------------------------------------
# plan
