"""The checkpoint format: box math, the manifest, and Arrow IPC shard files.

Owns what is on storage and what it means: ``boxes`` (n-d index boxes: intersect,
split, coverage), ``manifest`` (the dataclasses, their JSON encoding and
validation), ``values`` (plain values as tagged JSON), ``paths`` (where each key
sits in the nested state dict) and ``shard_file`` (writing chunks into Arrow IPC
files with block checksums; ranged, verified reads). May import the standard
library, numpy, pyarrow and xxhash, and ``rayckpt.errors``; nothing else of
rayckpt, no torch, no Ray. ``docs/FORMAT.md`` describes the bytes.
"""
