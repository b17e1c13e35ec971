"""Incremental saves: which committed save a new one shares with, and what each writer wrote.

A save with ``incremental=True`` writes its new shard files into the shared store
beside its checkpoint directory (``storage.shared``), and a chunk that is
byte-identical to the same key and box in its **base** (the newest save of the
same store this process started that is committed, and still there) is not
written again: its record points at the base's bytes.

- Rank 0 picks the base before it claims the location (``choose_base``): it
  reads the candidate's ``manifest.json``, writes the list of store files the
  base names as the new save's keeps file, claims, then drops the base when a
  collection of the store is under way or the base's manifest is gone or
  replaced (``confirm_base``). The base's save id travels to every rank with the
  plan.
- Each writer (the rank; on Ray its node's ShardWriter) keeps, per store and rank,
  the records of its last saves with each chunk's XXH3-128 (``remember``). A chunk
  is shared when the base's record for its key and box has the same length and
  block size, its first block's XXH3-64 matches the stored block checksum (a changed
  tensor fails here, without hashing the rest) and its XXH3-128 matches the base's
  fingerprint. A written chunk is fingerprinted (while its block checksums are
  taken) unless its first block already differed: a dense state's saves hash no
  more than before. A writer without the base's records (a restarted process,
  another node) writes its chunks in full: sharing is never needed for correctness.

Tensor version counters are not trusted to skip the comparison: a write through
``.data`` changes the bytes without bumping the version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

from ..bounded import BoundedMap
from ..format.manifest import FileEntry
from ..format.shard_file import ChunkData, WrittenChunk, fingerprint
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import WrittenShard
from ..storage.shared import stored_refs, sweep_running, write_keeps

#: Saves per (store, rank) whose records a writer keeps: the base is one of the last few.
RECORDS_KEPT = 3
#: Stores (and ranks) a process keeps records for.
STORES_KEPT = 64
#: A file's unchanged chunks are shared only when they hold at least this part of the chunk bytes
#: it was written with; else they are written again, so that a file mostly changed is freed once
#: the checkpoints before it go.
MIN_SHARED_FRACTION = 0.25


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseChunk:
    """A chunk as a writer stored it: where its bytes are, their checksums and fingerprint."""

    chunk: WrittenChunk
    dtype: str
    file: FileEntry
    #: Bytes of every chunk its file was written with.
    file_payload: int
    block_size: int


#: A chunk's place: (key, box offsets, box sizes).
Key = tuple[str, tuple[int, ...], tuple[int, ...]]
#: A writer's records of one save: each chunk by its place.
Records = dict[Key, BaseChunk]


@dataclass(frozen=True, slots=True)
class Increment:
    """Rank 0's decision for one save, shared with every rank: incremental or not, and its base."""

    #: Whether the save writes into the shared store (``incremental=True``).
    incremental: bool = False
    #: The save id of the base ("" for none: every chunk is written).
    base: str = ""
    #: Saves since the last one that shared nothing, this one included.
    chain: int = 1


FULL = Increment()


@dataclass(frozen=True, slots=True)
class _Started:
    ckdir: CheckpointDir
    save_id: str
    chain: int


#: Rank 0: the incremental saves this process started, per store (its location), newest last.
_STARTED: BoundedMap[str, tuple[_Started, ...]] = BoundedMap(STORES_KEPT)
#: A writer's records: (store location, rank) -> save id -> records.
_WRITTEN: BoundedMap[tuple[str, int], BoundedMap[str, Records]] = BoundedMap(STORES_KEPT)
#: The base a save is checking, by save id, between ``choose_base`` and ``confirm_base``.
_CHOSEN: dict[str, _Started] = {}


def store_key(ckdir: CheckpointDir) -> str:
    """The key of the shared store of ``ckdir``'s checkpoints: the directory holding them."""
    return ckdir.parent().uri


def choose_base(ckdir: CheckpointDir, save_id: str, full_every: int) -> None:
    """Rank 0, before claiming ``ckdir`` for ``save_id``: pick the base and write its keeps file.

    The newest save this process started for the same store whose manifest is committed
    with its save id; none when the chain since the last full save has ``full_every`` saves.
    """
    for started in reversed(_STARTED.get(store_key(ckdir)) or ()):
        if full_every and started.chain >= full_every:
            return
        try:
            refs = stored_refs(started.ckdir)
        except (ValueError, OSError):
            continue
        if refs is None or refs[0] != started.save_id:
            continue  # failed, not committed yet, replaced or deleted
        write_keeps(ckdir, save_id, refs[1])
        _CHOSEN[save_id] = started
        return


def confirm_base(ckdir: CheckpointDir, save_id: str) -> Increment:
    """Rank 0, once its lease is held: the save's ``Increment``; records it as started.

    The base is dropped when a collection of the store is under way (it may be deleting
    files the base names) or the base's manifest is no longer the one read before the claim.
    """
    started = _CHOSEN.pop(save_id, None)
    if started is not None and (sweep_running(ckdir) or _committed(started) != started.save_id):
        started = None
    increment = Increment(True, started.save_id, started.chain + 1) if started else Increment(True)
    key = store_key(ckdir)
    history = (_STARTED.get(key) or ())[-RECORDS_KEPT:]
    _STARTED.put(key, history + (_Started(ckdir, save_id, increment.chain),))
    return increment


def forget_choice(save_id: str) -> None:
    """A save that gave up before ``confirm_base``."""
    _CHOSEN.pop(save_id, None)


def _committed(started: _Started) -> str:
    try:
        refs = stored_refs(started.ckdir)
    except (ValueError, OSError):
        return ""
    return refs[0] if refs else ""


def base_records(key: str, rank: int, base: str) -> Records | None:
    """What this process wrote as ``rank`` for save ``base`` to the store ``key``; None if it holds no record."""
    saves = _WRITTEN.get((key, rank))
    return saves.get(base) if saves is not None and base else None


def remember(key: str, shard: WrittenShard, block_size: int, dtypes: Mapping[str, str], base: Records | None) -> None:
    """Keep the records of what ``shard``'s rank wrote (or shared) for its save: a later save's base.

    ``dtypes``: each key's dtype; ``base``: the records the save was written against (a shared chunk keeps
    the payload its base recorded for its file).
    """
    files = {f.path: f for f in shard.files}
    payload: dict[str, int] = {}
    for c in shard.chunks:
        payload[c.file] = payload.get(c.file, 0) + c.byte_length
    # A file the shard shares is a base record's: the payload it was written with travels on.
    payloads = {b.file.path: b.file_payload for b in (base or {}).values()}
    records = {
        (c.key, c.box.offsets, c.box.sizes): BaseChunk(
            chunk=c,
            dtype=dtypes[c.key],
            file=files[c.file],
            file_payload=payloads.get(c.file, payload[c.file]),
            block_size=block_size,
        )
        for c in shard.chunks
    }
    saves = _WRITTEN.get((key, shard.rank))
    if saves is None:
        saves = BoundedMap(RECORDS_KEPT)
        _WRITTEN.put((key, shard.rank), saves)
    saves.put(shard.save_id, records)


def split_unchanged(
    chunks: Sequence[ChunkData], base: Mapping[Key, BaseChunk], block_size: int
) -> tuple[list[ChunkData], list[BaseChunk], set[Key]]:
    """(chunks to write, base chunks shared in place of the others, the written chunks to fingerprint).

    A written chunk is fingerprinted (for the next save to match) unless its first block already
    differs from its base's: a chunk that changed now will likely change again, and a dense
    state's saves then hash nothing twice. One that stops changing is shared a save later.
    """
    write: list[ChunkData] = []
    same: list[tuple[ChunkData, BaseChunk]] = []
    hashed: set[Key] = set()
    for c in chunks:
        key = (c.key, c.box.offsets, c.box.sizes)
        b = base.get(key)
        raw = memoryview(c.data).cast("B")
        if b is None or b.dtype != c.dtype or b.block_size != block_size or len(raw) != b.chunk.byte_length:
            write.append(c)
            hashed.add(key)
        elif b.chunk.checksums and xxhash.xxh3_64_intdigest(raw[:block_size]) != b.chunk.checksums[0]:
            write.append(c)
        else:
            hashed.add(key)
            if b.chunk.fingerprint and fingerprint(raw) == b.chunk.fingerprint:
                same.append((c, b))
            else:
                write.append(c)
    used: dict[str, int] = {}
    payload: dict[str, int] = {}
    for _, b in same:
        used[b.file.path] = used.get(b.file.path, 0) + b.chunk.byte_length
        payload[b.file.path] = b.file_payload
    kept = {path for path, n in used.items() if n >= MIN_SHARED_FRACTION * payload[path]}
    write += [c for c, b in same if b.file.path not in kept]
    return write, [b for _, b in same if b.file.path in kept], hashed
