"""The main job's data: a real text corpus that every Python installation ships, read byte by byte.

The corpus is the text of Python's own help topics (``pydoc_data.topics``: the
language reference's sections, as ``help("if")`` shows them), joined in sorted
topic order and encoded as UTF-8, so it is on every machine and needs no download.
Tokens are bytes (ids 0-255). Sample ``i`` is the ``i``-th window of ``seq_len + 1``
bytes; its input is the first ``seq_len`` bytes and its target the last ``seq_len``.
"""

from __future__ import annotations

import hashlib

import torch
from torch.utils.data import Dataset

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
