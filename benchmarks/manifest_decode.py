"""How long decoding a 4,096-rank manifest takes: ``python -m benchmarks.manifest_decode``.

The manifest is synthetic (no tensors): ``--tensors`` float32 tensors, each dim-0 sharded over
``--ranks`` ranks as FSDP2 does, one shard file per rank. It is encoded once in the current format
(version 4: ``manifest.json`` and its chunk table) and as version 3 (every chunk in the JSON), and
each is decoded ``--repeats`` (``--repeats-v3``) times; the median and fastest times are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace

from rayckpt.format.boxes import Box
from rayckpt.format.manifest import ChunkEntry, FileEntry, Manifest, TensorEntry, decode_manifest, encode_manifest
from rayckpt.format.manifest_files import manifest_file_bytes, manifest_from_bytes

ITEMSIZE = 4
BLOCK_SIZE = 1 << 24


def build_manifest(ranks: int, tensors: int, rows: int, cols: int) -> Manifest:
    """``tensors`` (rows, cols) float32 tensors, each rank holding a contiguous slab of rows of each."""
    per_rank = -(-rows // ranks)
    files = [FileEntry(f"20261129T000000-0badcafe-r{r:05d}-float.arrow", 0, r) for r in range(ranks)]
    offsets = [0] * ranks
    entries = {}
    for t in range(tensors):
        key = f"model.layers.{t}.weight"
        chunks = []
        for r in range(ranks):
            lo = min(rows, r * per_rank)
            n = min(rows, lo + per_rank) - lo
            if not n:
                continue
            length = n * cols * ITEMSIZE
            sums = tuple((r * 7919 + t * 104729 + b) % 2**64 for b in range(-(-length // BLOCK_SIZE)))
            chunks.append(
                ChunkEntry(
                    box=Box((lo, 0), (n, cols)),
                    file=files[r].path,
                    byte_offset=offsets[r],
                    byte_length=length,
                    checksums=sums,
                )
            )
            offsets[r] += length
        entries[key] = TensorEntry("float32", (rows, cols), tuple(chunks), ("model", "layers", t, "weight"))
    files = [replace(f, size=offsets[f.rank]) for f in files]
    return Manifest(
        save_id="20261129T000000-0badcafe",
        world_size=ranks,
        block_size=BLOCK_SIZE,
        entries=entries,
        files=tuple(files),
        created=1795000000.0,
        version=4,
        user_metadata={"step": 1000},
    )


def seconds(fn, repeats: int) -> dict[str, float]:
    """Median and fastest wall time of ``repeats`` calls of ``fn``, and median CPU time (steadier on a busy machine)."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"median": statistics.median(wall), "min": min(wall), "cpu_median": statistics.median(cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("--ranks", 4096), ("--tensors", 16), ("--rows", 16384), ("--cols", 1024)):
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--repeats", type=int, default=31, help="decodes of the version-4 manifest")
    parser.add_argument("--repeats-v3", type=int, default=5, help="decodes of the version-3 manifest")
    args = parser.parse_args()
    m = build_manifest(args.ranks, args.tensors, args.rows, args.cols)
    v4 = manifest_file_bytes(m)
    v3 = encode_manifest(replace(m, version=3))
    assert manifest_from_bytes(v4).entries.keys() == decode_manifest(v3).entries.keys() == m.entries.keys()
    result = {
        "ranks": args.ranks,
        "tensors": args.tensors,
        "chunks": sum(len(e.chunks) for e in m.entries.values()),
        "json_bytes": {"version_4": len(v4["manifest.json"]), "version_3": len(v3)},
        "repeats": {"version_4": args.repeats, "version_3": args.repeats_v3},
        "seconds": {
            "version_4": seconds(lambda: manifest_from_bytes(v4), args.repeats),
            "version_3": seconds(lambda: decode_manifest(v3), args.repeats_v3),
        },
        "machine": {"nproc": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
