"""Manifest validation at scale, no tensors: ``find_manifest_problems``, ``create_manifest``, ``read_manifest``.

The manifest is ``micro.plan``'s synthetic one (``--tensors`` float32 tensors saved
dim-0 by ``--saved-ranks`` ranks, a file per rank). Timed, median and min-max over
``--repeats``:

- ``find_manifest_problems`` on the in-memory manifest (no problem to report);
- ``create_manifest`` from every rank's ``WrittenShard`` (builds and validates);
- decoding (``manifest_from_bytes``) and ``read_manifest`` (decode + validation) of its files in a
  temporary directory, and ``find_manifest_problems`` alone on the decoded manifest
  (what validating a read costs, without decode's noise);
- ``ChunkColumns.from_manifest`` (the column build the validation runs on), with its
  peak memory and that of ``find_manifest_problems`` (``tracemalloc``, which counts
  numpy's buffers too).

    .venv/bin/python -m benchmarks.micro validate --saved-ranks 1024 --tensors 2000

Writes ``{out}/bench_validate.json`` and prints one line per step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from collections import defaultdict
from typing import Any

from benchmarks.micro.plan import build_manifest, peak_memory, timed
from rayckpt.format.manifest import TensorEntry
from rayckpt.format.manifest_files import manifest_file_bytes, manifest_from_bytes
from rayckpt.format.shard_file import WrittenChunk
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import SaveSpec, WrittenShard, create_manifest, read_manifest

try:  # the column form; absent in older code
    from rayckpt.format.chunk_columns import ChunkColumns
    from rayckpt.format.manifest_checks import find_manifest_problems
except ImportError:  # pragma: no cover - the baseline run
    from rayckpt.format.manifest import find_manifest_problems  # type: ignore[attr-defined,no-redef]

    ChunkColumns = None  # type: ignore[assignment,misc]


def written_shards(manifest: Any) -> tuple[SaveSpec, list[WrittenShard]]:
    """What every rank would hand the committer for ``manifest``."""
    per_rank: dict[int, list[WrittenChunk]] = defaultdict(list)
    rank_of = {f.path: f.rank for f in manifest.files}
    tensors = {}
    for key, e in manifest.entries.items():
        assert isinstance(e, TensorEntry)
        tensors[key] = (e.dtype, e.shape)
        for c in e.chunks:
            per_rank[rank_of[c.file]].append(
                WrittenChunk(
                    key=key,
                    box=c.box,
                    file=c.file,
                    byte_offset=c.byte_offset,
                    byte_length=c.byte_length,
                    checksums=c.checksums,
                )
            )
    shards = [WrittenShard(f.rank, tuple(per_rank[f.rank]), (f,)) for f in manifest.files]
    spec = SaveSpec(
        save_id=manifest.save_id,
        world_size=manifest.world_size,
        block_size=manifest.block_size,
        tensors=tensors,
        values={},
    )
    return spec, shards


def run(args: argparse.Namespace) -> dict[str, Any]:
    reps = args.repeats
    manifest = build_manifest(args.saved_ranks, args.tensors, args.rows, args.cols, args.block_size)
    chunks = sum(len(e.chunks) for e in manifest.entries.values())
    results: dict[str, Any] = {"saved_ranks": args.saved_ranks, "tensors": args.tensors, "chunks": chunks}
    print(f"[validate] {chunks:,} chunks", flush=True)

    def step(name: str, fn: Any) -> Any:
        gc.collect()
        secs, out = timed(fn, reps)
        results[name] = secs
        span = f"min {secs['min']:.3f}, max {secs['max']:.3f}"
        print(f"[validate] {name}: median {secs['median']:.3f}s ({span})", flush=True)
        return out

    assert step("find_manifest_problems", lambda: find_manifest_problems(manifest)) == []
    results["find_manifest_problems_memory"] = peak_memory(lambda: find_manifest_problems(manifest))
    print(f"[validate] find_manifest_problems memory: {results['find_manifest_problems_memory']}", flush=True)
    if ChunkColumns is not None:
        step("columns", lambda: ChunkColumns.from_manifest(manifest))
        results["columns_memory"] = peak_memory(lambda: ChunkColumns.from_manifest(manifest))
        print(f"[validate] columns memory: {results['columns_memory']}", flush=True)
    spec, shards = written_shards(manifest)
    step("create_manifest", lambda: create_manifest(spec, shards))
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        stored = manifest_file_bytes(manifest)
        for name, data in stored.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        ckdir = CheckpointDir.resolve(tmp)
        step("decode_manifest", lambda: manifest_from_bytes({n: ckdir.read_bytes(n) for n in stored}))
        step("read_manifest", lambda: read_manifest(ckdir))
        decoded = manifest_from_bytes(stored)
        step("find_manifest_problems_decoded", lambda: find_manifest_problems(decoded))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saved-ranks", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tmp", default=None, help="directory for the manifest file")
    parser.add_argument("--out", default="bench_out/validate")
    args = parser.parse_args(argv)
    results = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_validate.json"), "w") as f:
        json.dump(results, f, indent=1)
