"""The checkpoint format: box math, the manifest, and Arrow IPC shard files.

Owns what is on storage and what it means: ``boxes`` (n-d index boxes: intersect,
split, coverage), ``manifest`` (the dataclasses and their JSON encoding),
``chunk_columns`` (a manifest's chunks as numpy columns), ``manifest_checks``
(its validation, on those columns), ``values`` (plain values as tagged JSON), ``paths`` (where each key
sits in the nested state dict) and ``shard_file`` (writing chunks into Arrow IPC
files with block checksums; ranged, verified reads). May import the standard
library, numpy, pyarrow and xxhash, and ``rayckpt.errors``; nothing else of
rayckpt, no torch, no Ray. ``docs/FORMAT.md`` describes the bytes.
"""
