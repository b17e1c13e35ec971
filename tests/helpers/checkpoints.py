"""Checkpoint fixtures and tampering shared by the test tiers: states, manifests, flipped bytes."""

from __future__ import annotations

import json
import os
import weakref

import pyarrow as pa
import torch
import xxhash

from rayckpt import tools
from rayckpt.format.manifest_files import TABLE_SCHEMA


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(37, 5, generator=g),
            "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(3.5),
            "mask": torch.rand(6, generator=g) > 0.5,
            "ids": torch.arange(7, dtype=torch.int64) * (seed + 1),
        },
        "step": 10 + seed,
        "config": {"betas": (0.9, 0.99), "names": ["a", "b"], 3: "int key", "lr": float("nan")},
    }


def manifest_of(path) -> dict:
    """The manifest's JSON document; a version-4 one with its chunk table's rows put back inline as
    ``chunks`` (the version-3 form), so tests read and edit one document whatever the version."""
    with open(os.path.join(path, "manifest.json")) as f:
        doc = json.load(f)
    if isinstance(doc, dict) and "chunk_table" in doc:
        with open(os.path.join(path, doc["chunk_table"]["path"]), "rb") as f:
            inline_chunks(doc, f.read())
    return doc


def inline_chunks(doc: dict, table: bytes) -> None:
    """Put the rows of a version-4 chunk table into ``doc``'s tensor entries as ``chunks`` lists."""
    rows = pa.ipc.open_file(pa.BufferReader(table)).read_all().to_pylist()
    keys = [k for k, e in doc["entries"].items() if e.get("kind") == "tensor"]
    for k in keys:
        doc["entries"][k]["chunks"] = []
    for row in rows:
        doc["entries"][keys[row["key"]]]["chunks"].append(
            {
                "offsets": row["offsets"],
                "sizes": row["sizes"],
                "file": doc["files"][row["file"]]["path"],
                "byte_offset": row["byte_offset"],
                "byte_length": row["byte_length"],
                "checksums": row["checksums"],
            }
        )


def write_manifest_doc(path, doc: dict) -> None:
    """Write ``doc`` (as ``manifest_of`` gives it, edited) back: a version-4 one as its chunk table
    (rewritten from the inline ``chunks``, its reference updated) and the JSON without them."""
    doc = json.loads(json.dumps(doc))
    if doc.get("version", 0) < 4:  # turned into an older version: its chunks stay inline
        doc.pop("chunk_table", None)
    if "chunk_table" in doc:
        table = table_of(doc)
        doc["chunk_table"].update(size=len(table), rows=sum(len(e["chunks"]) for e in tensor_entries(doc)))
        doc["chunk_table"]["xxh3_64"] = xxhash.xxh3_64_intdigest(table)
        with open(os.path.join(path, doc["chunk_table"]["path"]), "wb") as f:
            f.write(table)
        for e in tensor_entries(doc):
            del e["chunks"]
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(doc, f)


def tensor_entries(doc: dict) -> list[dict]:
    return [e for e in doc["entries"].values() if e.get("kind") == "tensor"]


def table_of(doc: dict) -> bytes:
    """The chunk table of a document's inline chunks (a file a test names that ``files`` lacks gets an id past them)."""
    ids = {f["path"]: i for i, f in enumerate(doc["files"])}
    rows = [
        {**c, "key": k, "file": ids.get(c["file"], len(ids))}
        for k, e in enumerate(tensor_entries(doc))
        for c in e["chunks"]
    ]
    table = pa.Table.from_pylist(rows, schema=TABLE_SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def flip_byte(path: str, name: str, offset: int) -> None:
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def rewrite_manifest(path, edit) -> None:
    m = manifest_of(path)
    edit(m)
    write_manifest_doc(path, m)


def track_read_tensor(monkeypatch) -> dict[str, int]:
    """Count the tensors ``CheckpointReader.read_tensor`` returns, and the most alive at once."""
    alive: list[weakref.ref] = []
    stats = {"read": 0, "peak": 0}
    original = tools.CheckpointReader.read_tensor

    def tracked(self, key):
        t = original(self, key)
        alive.append(weakref.ref(t))
        stats["read"] += 1
        stats["peak"] = max(stats["peak"], sum(r() is not None for r in alive))
        return t

    monkeypatch.setattr(tools.CheckpointReader, "read_tensor", tracked)
    return stats
