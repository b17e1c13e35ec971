"""The main job's data: a real text corpus that every Python installation ships, read byte by byte.

The corpus is the text of Python's own help topics (``pydoc_data.topics``: the
language reference's sections, as ``help("if")`` shows them), joined in sorted
topic order and encoded as UTF-8, so it is on every machine and needs no download.
Tokens are bytes (ids 0-255). Sample ``i`` is the ``i``-th window of ``seq_len + 1``
bytes; its input is the first ``seq_len`` bytes and its target the last ``seq_len``.
``corpus_loader`` is a rank's loader of it through a ``ResumableSampler``; ``Batches``
hands the training loop its batches, epoch after epoch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from ..data import ResumableSampler
from .gpt import GPTConfig

#: Token ids of a byte-level corpus: every byte value.
BYTE_VOCAB = 256


def python_help_text() -> bytes:
    """The corpus: Python's help topics in sorted order, UTF-8."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


class ByteCorpus(Dataset):
    """Windows of ``seq_len + 1`` bytes of ``text``; item ``i`` is ``(inputs, targets, i)``.

    ``samples``: use the first ``samples`` windows only (0: every whole window). ``identity``
    names the corpus and its window length (a digest of the text, so another text is another
    dataset); the number of samples is the dataset's length, kept beside it.

    Raises:
        ValueError: ``seq_len`` < 1, ``samples`` < 0, or the text holds fewer than ``samples`` windows.
    """

    def __init__(self, text: bytes, seq_len: int, samples: int = 0, name: str = "python-help") -> None:
        if seq_len < 1 or samples < 0:
            raise ValueError(f"seq_len must be >= 1 and samples >= 0, got {seq_len} and {samples}")
        window = seq_len + 1
        whole = len(text) // window
        if samples > whole:
            raise ValueError(f"the corpus {name!r} holds {whole} windows of {window} bytes, not {samples}")
        self.seq_len = seq_len
        self.length = samples or whole
        self._bytes = torch.frombuffer(bytearray(text[: self.length * window]), dtype=torch.uint8)
        digest = hashlib.sha256(text).hexdigest()[:12]
        self.identity = f"{name}/sha256:{digest}/window:{window}"

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if not 0 <= i < self.length:
            raise IndexError(f"sample {i} of a corpus of {self.length}")
        window = self.seq_len + 1
        tokens = self._bytes[i * window : (i + 1) * window].long()
        return tokens[:-1], tokens[1:], i


def corpus_loader(config: dict[str, Any], cfg: GPTConfig, rank: int, world_size: int, per_rank: int) -> DataLoader:
    """``--data corpus``: this rank's loader of the byte corpus, through a ``ResumableSampler``.

    Shuffled each epoch with ``--seed``; ``drop_last`` so every rank runs as many steps per
    epoch (a tail the ranks cannot split evenly waits for the next epoch's shuffle).
    """
    if cfg.vocab_size < BYTE_VOCAB:
        raise ValueError(f"the byte corpus needs a vocabulary of at least {BYTE_VOCAB} ids, got {cfg.vocab_size}")
    dataset = ByteCorpus(python_help_text(), cfg.seq_len, samples=config.get("epoch_samples") or 0)
    sampler = ResumableSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        seed=config["seed"],
        drop_last=True,
        identity=dataset.identity,
    )
    return DataLoader(dataset, batch_size=per_rank, sampler=sampler)


class Batches:
    """The loop's batches from a loader over a ``ResumableSampler``, epoch after epoch, each batch's last field
    its sample ids (``loader`` None: ``without(step)``'s batches); with ``log_dir``, each step's sample ids.

    A step's line in ``<log_dir>/samples-<attempt>-<rank>.jsonl``: ``{"step", "epoch", "rank",
    "world_size", "attempt", "ids"}``, ``attempt`` the same on every rank of one worker group.
    """

    def __init__(self, loader: Any, log_dir: str | None, rank: int, world_size: int, without: Any = None) -> None:
        self.loader, self.rank, self.world_size, self.without = loader, rank, world_size, without
        self._pass = iter(loader) if loader is not None else None
        self.log = None
        if loader is not None and log_dir:
            attempt = [f"{time.time():.6f}-{os.getpid()}" if rank == 0 else None]
            if world_size > 1:
                dist.broadcast_object_list(attempt, src=0)
            self.attempt = attempt[0]
            os.makedirs(log_dir, exist_ok=True)
            self.log = os.path.join(log_dir, f"samples-{self.attempt}-{rank}.jsonl")

    def next(self, step: int) -> tuple[torch.Tensor, ...]:
        """The batch of ``step`` (from 1), less its last field (the sample ids); when the epoch is
        through, the next epoch's first. Without a loader: ``without(step)``."""
        if self._pass is None:
            return self.without(step)
        sampler = self.loader.sampler
        try:
            batch = next(self._pass)
        except StopIteration:
            sampler.set_epoch(sampler.epoch + 1)
            self._pass = iter(self.loader)
            batch = next(self._pass)
        *tensors, ids = batch
        if self.log is not None:
            line = {
                "step": step,
                "epoch": sampler.epoch,
                "rank": self.rank,
                "world_size": self.world_size,
                "attempt": self.attempt,
                "ids": ids.tolist(),
            }
            with open(self.log, "a") as f:
                f.write(json.dumps(line) + "\n")
        return tuple(tensors)
