"""The main job's corpus: Python's help text as byte-level windows, the same on every machine with this Python."""

from __future__ import annotations

import pytest
import torch

from rayckpt.examples.corpus import ByteCorpus, python_help_text


def test_windows_are_the_text_s_bytes_inputs_then_targets_shifted_by_one():
    text = python_help_text()
    assert len(text) > 100_000 and b"if_stmt" in text
    corpus = ByteCorpus(text, seq_len=8, samples=5)
    assert len(corpus) == 5
    inputs, targets, i = corpus[3]
    window = torch.tensor(list(text[27:36]))
    assert i == 3 and torch.equal(inputs, window[:-1]) and torch.equal(targets, window[1:])
    assert inputs.dtype == torch.int64 and int(inputs.max()) < 256
    assert len(ByteCorpus(text, seq_len=8)) == len(text) // 9


def test_the_identity_names_the_text_and_the_window_not_the_number_of_samples():
    text = python_help_text()
    a, b = ByteCorpus(text, 8, samples=5), ByteCorpus(text, 8, samples=7)
    assert a.identity == b.identity and a.identity.endswith("/window:9")
    assert ByteCorpus(text, 9).identity != a.identity
    assert ByteCorpus(text + b"x", 8).identity != a.identity


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="holds 1 windows of 9 bytes, not 2"):
        ByteCorpus(b"x" * 10, 8, samples=2)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        ByteCorpus(b"x", 0)
    with pytest.raises(IndexError, match="sample 5 of a corpus of 5"):
        ByteCorpus(python_help_text(), 8, samples=5)[5]
