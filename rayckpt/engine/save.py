"""``save``: collect -> plan -> write -> commit, the steps every save path shares.

Roles: every rank calls ``save`` (collective when a process group is
initialized); rank 0 commits. ``collect_state`` is the first step of every save,
``rayckpt.save`` and the Ray async save alike: each rank flattens its state,
rank 0 gathers the ranks' layouts, plans every rank's writes and sends each
rank its own plan, and holds the ``SaveSpec`` the committer needs (the plans
are cached while the layouts repeat: ``save_layout``). Then each rank writes its share
(``write_share`` here; on Ray the node's ShardWriter does, from shared memory)
and the committer (rank 0 here; the MetadataActor on Ray) calls
``storage.commit.commit_save``. Each step ends in one all-gather that carries
failures, so an error on any rank is raised on every rank and nobody hangs.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import pyarrow.fs as pafs

from ..errors import PeerLostError, RayckptError, SaveFailedError
from ..phases import log_phases, phase, timed
from ..planning.save_plan import SavePlan
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import (
    SaveSpec,
    WrittenShard,
    commit_save,
    new_save_id,
    read_manifest,
    remove_failed_save,
)
from ..storage.lease import LeaseKeeper, claim_location, release_lease
from .coordinator import Coordinator, default_coordinator, gather_or_raise
from .coordinator import claim as claim_decision
from .save_layout import agree_on_plan
from .state import FlatState
from .writer import create_chunk_data, parts_here, write_chunks


@dataclass(frozen=True, slots=True)
class SaveInfo:
    """What ``save`` returns on every rank."""

    path: str
    save_id: str
    bytes_written: int
    num_files: int
    world_size: int
    #: Where this rank's time went, in seconds (``rayckpt.phases``): ``plan`` (flatten, the planning
    #: collectives), ``lease_claim`` (rank 0), ``write`` (shard files), ``fsync``, ``gather_writes`` (waiting
    #: for every rank's files), rank 0's commit (``manifest_build``, ``commit_check``, ``manifest_encode``,
    #: ``chunk_table_write``, ``manifest_write``, ``sweep``), ``gather_commit`` (the others waiting for it),
    #: ``lease_release``, ``other`` and ``total``. Exclusive: they add up to ``total``.
    phases: dict[str, float] = field(default_factory=dict, compare=False)


def save(
    state_dict: dict[str, Any],
    checkpoint_id: str | Any,
    *,
    process_group: Any = None,
    coordinator: Coordinator | None = None,
    filesystem: pafs.FileSystem | None = None,
    block_size: int | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = True,
) -> SaveInfo:
    """Save ``state_dict`` to ``checkpoint_id``; returns a ``SaveInfo`` on every rank.

    Collective when a process group is initialized (every rank calls it); works in a
    single process without one. Sharded DTensors are written by their owners. The
    checkpoint exists once ``manifest.json`` is committed by rank 0 after every rank's
    files are durable.

    - ``state_dict``: nested dicts/lists of tensors, DTensors (FSDP2 / HSDP shards,
      Shard or Replicate placements), plain values (below) and Stateful objects.
      Containers without tensors are stored whole as one value. Anything else
      (a function, an arbitrary object) raises ``InvalidStateError`` naming its key.
      Legacy ``ShardedTensor``s and tensor subclasses that implement DCP's own
      checkpoint protocol (``__create_write_items__``, e.g. ``LocalShardsWrapper``
      outside a DTensor) are refused the same way, naming the key and the type,
      before any file is written.
    - Plain values, stored as JSON in the manifest (no pickle), come back with the
      same value and type: ``None``, ``bool``, ``int`` (any size), ``float`` (incl. inf,
      -inf, nan, -0.0), ``str``, ``bytes``, ``bytearray``, ``io.BytesIO`` (its whole
      buffer, restored at position 0; e.g. a ``torch.save``d list of losses, an RNG
      state as bytes), and ``list``, ``tuple``, ``dict`` of these (dict keys: any of the
      hashable ones, e.g. ``{0: ...}``, ``{(1, 2): ...}``). Subclasses come back as
      their base type (a ``namedtuple`` or ``torch.Size`` as a ``tuple``, an
      ``OrderedDict`` as a ``dict``, an ``IntEnum`` as an ``int``). Anything else (a ``set``,
      a ``memoryview``, a numpy array, a custom object) is refused before anything is
      written: ``InvalidStateError: value at key 'extra.seen' has type set, which the
      pickle-free format cannot store; use a tensor, a JSON-able value (...), bytes,
      bytearray, io.BytesIO or a Stateful object``. Binary values live in the
      manifest: keep them small (KBs); store large data as tensors.
    - The structure is kept: the manifest records each key's path through the
      nested dicts and lists (dict keys with dots, such as a module's
      ``layers.0.weight``, int keys and list indices included), so ``consolidate``,
      ``convert --to torch`` and ``--to dcp`` rebuild exactly the nesting that was
      saved. Loads match keys by their flattened name, as DCP does.
    - A DTensor may live on a sub-mesh (a ``DeviceMesh`` of some ranks only): ranks
      outside it save nothing and read nothing for it, ``strict=True`` included. A
      DTensor whose local tensor is a ``LocalShardsWrapper`` (uneven local shards:
      any sizes per rank, several or none on a rank) is saved and loaded shard by
      shard at the shards' own offsets and sizes, and reshards to and from even
      layouts (FSDP2's ``Shard(0)``, plain tensors) like any other.
    - Replicated data (plain tensors on every rank, HSDP replicas, Adam ``step``
      scalars) is written once. Plain tensors and values with the same key on
      several ranks are assumed equal: the lowest rank's copy is stored. Give
      per-rank state (e.g. RNG state) a per-rank key.
    - ``checkpoint_id``: a local path, a URI ``pyarrow.fs`` understands (``file://``,
      ``s3://``, ``gs://``, ``hdfs://``), or a path on ``filesystem`` (a ``pyarrow.fs.FileSystem``).
    - ``block_size``: bytes per block checksum; None: 64 KiB, larger for states past
      32 GiB (``shard_file.auto_block_size``), chosen by rank 0 for every rank.
    - Saving to a location that holds a checkpoint replaces it atomically: the old
      one stays loadable until the new manifest is committed, then its files are deleted.
      With ``overwrite=False`` (DCP's writer option) such a save is refused instead:
      every rank raises ``CheckpointExistsError`` (a ``SaveFailedError``) naming the
      location, before anything is written, and the checkpoint there stays untouched.
      A location holding only a crashed save's shard files has no checkpoint and is
      saved to.
    - Two saves to one location at once (two jobs, two Ray runs, two imports) never
      mix and never lose data silently. Before any rank writes, rank 0 claims the
      location with a lease file (``.rayckpt-lease-<save_id>``, refreshed while the
      save runs, deleted when it ends; docs/FORMAT.md, "Leases").
      A save that finds another save in flight there raises ``SaveFailedError`` on
      every rank naming the location and that save's id, before writing anything;
      the save in flight goes on and commits. Of two saves claiming at the same
      moment exactly one goes on (the smaller save id). Saves one after the other
      replace each other as before. After a commit only files of saves that are
      dead or superseded (no live lease) are deleted; a manifest is never written
      over a checkpoint committed after its save claimed the location. With
      ``overwrite=False`` two saves into a new location commit at most once. A save
      that crashed holds the location until its lease expires (60 s after its last
      refresh), or not at all when it ran on this host (its process is gone); its
      files go at the next commit there or with ``rayckpt gc``. Claiming costs rank 0
      about 0.4 ms on a local disk (two small lease writes, a listing).
    - Stateful objects are called in sorted key order at every level of nesting
      (``state_dict()`` on save and on load, then ``load_state_dict()``, and loaded plain
      values are assigned in that order too), whatever order each rank built its dicts
      in, so ``state_dict()`` / ``load_state_dict()`` methods that run collectives line
      up across ranks (as DCP does).
    - A failure on any rank (state, write, commit) raises ``SaveFailedError`` (or the
      common ``RayckptError`` subclass when every failing rank raised the same) on
      every rank naming each failed rank; this save's files are removed; nothing is
      committed, and a previous checkpoint at the same location stays loadable. Any
      other exception inside ``save`` (not a ``RayckptError``) becomes
      ``SaveFailedError: save to <location> failed on rank <r>: <type>: <message>``.
      Messages carry the cause, not the stack: ``<type>: <message>`` and each
      cause's (``; caused by ...``), the frames in the DEBUG log.
    - A rank that dies mid-save (SIGKILL, OOM, a lost node) breaks the collective
      the others wait in: gloo or nccl raise there (after the process group's
      ``timeout`` at worst). The ranks left raise ``PeerLostError`` (a ``SaveFailedError``)
      naming the phase, the collective and their rank (``save (writing shards)
      failed: the all_gather collective failed on rank 0 of 3: RuntimeError: ...``;
      which peer died is not known to them), never the transport's ``RuntimeError``.
      Each then settles the save through the process group's store (first claim
      wins, so it holds however the ranks raced): rank 0 claims "commit" just before
      writing the manifest, a rank that lost the save claims "abort". If "abort"
      holds, it removes this save's files (its own, and any others named with the
      save id, e.g. the dead rank's partial file: "rank 0 removed the files of save
      ...; nothing was committed") and rank 0 will not commit. If rank 0 took the
      commit first, the files are kept (the manifest may name them): the save
      returns normally when the manifest is already there, else ``PeerLostError``
      says to check the location. With no store to ask (the rank hosting it died)
      the files are kept too; the next save at that location removes them. The
      previous checkpoint at the location is untouched either way. The process group
      cannot be used after a broken collective: destroy it and make a new one (or
      let Ray Train restart the workers).
    - CUDA tensors are copied to the CPU (non-blocking copies, one synchronize).
    - ``metadata``: JSON stored in the manifest's ``user_metadata``.
    - Returns ``SaveInfo(path, save_id, bytes_written, num_files, world_size, phases)``:
      ``phases`` says where this rank's seconds went (also logged at DEBUG by the
      ``rayckpt.phases`` logger: ``rayckpt: save to <location> on rank R: write 0.41 s, ...``).
    """
    coord = coordinator or default_coordinator(process_group)
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    try:
        with timed() as clock:
            info = _save(coord, ckdir, state_dict, block_size, metadata, overwrite)
        phases = clock.result()
        log_phases("save to", ckdir.location, coord.rank, phases)
        return replace(info, phases=phases)
    except RayckptError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever broke, the caller gets a SaveFailedError
        raise SaveFailedError(
            f"save to {ckdir.location} failed on rank {coord.rank}: {type(exc).__name__}: {exc}"
        ) from exc


def _save(
    coord: Coordinator,
    ckdir: CheckpointDir,
    state_dict: dict[str, Any],
    block_size: int | None,
    metadata: dict[str, Any] | None,
    overwrite: bool,
) -> SaveInfo:
    ctx = collect_state(coord, state_dict, block_size=block_size, metadata=metadata, claim=ckdir, overwrite=overwrite)
    save_id = ctx.spec.save_id
    written_files: list[str] = []
    shards: list[WrittenShard] = []
    committed: list[int] = []  # rank 0, once the manifest is written: the checkpoint's bytes

    def commit() -> int:
        if coord.rank != 0:
            return 0
        if claim_decision(coord, _decision_key(save_id), "commit") not in ("commit", None):
            raise SaveFailedError(
                f"rank 0 did not commit save {save_id}: a rank gave up on it after a collective failed"
            )
        committed.append(commit_save(ckdir, ctx.spec, shards).total_bytes)
        return committed[0]

    try:
        # Rank 0 owns the lease it claimed: refreshed while the save runs, deleted when it ends.
        with LeaseKeeper(ckdir, save_id) if coord.rank == 0 else nullcontext():
            write = partial(write_share, ckdir, ctx, written_files)
            with phase("gather_writes"):
                shards = gather_or_raise(coord, "save (writing shards)", write, SaveFailedError, PeerLostError)
            with phase("gather_commit"):
                total = gather_or_raise(coord, "save (commit)", commit, SaveFailedError, PeerLostError)[0]
    except BaseException as exc:
        if committed:  # rank 0 wrote the manifest: the checkpoint is complete whatever broke after
            if not isinstance(exc, Exception):
                raise
            return SaveInfo(ckdir.location, save_id, committed[0], sum(len(s.files) for s in shards), coord.world_size)
        if isinstance(exc, RayckptError) and not isinstance(exc, PeerLostError):
            remove_failed_save(ckdir, save_id, written_files)  # every rank saw this failure: nobody commits
            raise
        return _settle_lost(coord, ckdir, save_id, written_files, exc)
    num_files = sum(len(s.files) for s in shards)
    return SaveInfo(ckdir.location, save_id, total, num_files, coord.world_size)


def _decision_key(save_id: str) -> str:
    return f"save/{save_id}/decision"


def _settle_lost(
    coord: Coordinator, ckdir: CheckpointDir, save_id: str, written_files: list[str], exc: BaseException
) -> SaveInfo:
    """This rank left a save without knowing how the others ended (a collective failed, or it was interrupted).

    Rank 0, the only committer, knows it did not commit. Another rank asks the
    process group's store: if no rank took the commit, its "abort" wins (rank 0
    will not commit) and it removes the save's files; if rank 0 took it, the
    files stay (the manifest may name them) and the save counts as committed once
    its manifest is there. Raises ``PeerLostError`` (or ``exc`` itself when it is
    not an ``Exception``), unless the save is committed.
    """
    decision = "abort" if coord.rank == 0 else claim_decision(coord, _decision_key(save_id), "abort")
    if decision == "abort":
        remove_failed_save(ckdir, save_id, written_files)
        outcome = f"rank {coord.rank} removed the files of save {save_id}; nothing was committed"
    elif decision == "commit":
        if _committed_id(ckdir) == save_id:
            manifest = read_manifest(ckdir)
            total = sum(f.size for f in manifest.files)
            return SaveInfo(ckdir.location, save_id, total, len(manifest.files), coord.world_size)
        outcome = (
            f"rank 0 had taken the commit of save {save_id} when this rank lost it, so rank {coord.rank} "
            f"kept its files: check whether {ckdir.location} holds save {save_id} (the next save there "
            "removes them if not)"
        )
    else:
        outcome = (
            f"rank {coord.rank} could not reach the process group's store to learn whether rank 0 commits "
            f"save {save_id}, so rank {coord.rank} kept its files (the next save at {ckdir.location} "
            "removes them if not)"
        )
    if not isinstance(exc, Exception):
        raise exc
    message = str(exc) if isinstance(exc, PeerLostError) else f"save failed on rank {coord.rank}: {exc!r}"
    raise PeerLostError(f"{message}; {outcome}") from exc


def _committed_id(ckdir: CheckpointDir) -> str | None:
    try:
        return read_manifest(ckdir).save_id
    except Exception:  # noqa: BLE001 - no manifest, or not one this rank can read: not committed here
        return None


@dataclass(frozen=True, slots=True)
class SaveContext:
    """A save after its first step, on one rank: what the ranks agreed on, and this rank's state."""

    #: The save as the committer sees it, on rank 0. Other ranks hold the same ids, world
    #: size, block size and metadata but no tensors, values or paths (only the committer needs them).
    spec: SaveSpec
    rank: int
    #: This rank's share of the save.
    plan: SavePlan
    #: The nodes the ranks run on, each once ("" when not on Ray).
    nodes: tuple[str, ...]
    #: This rank's flattened state (its local tensors).
    flat: FlatState
    #: Whether the plan came from this process's plan cache (``save_layout``).
    cached: bool = False
    #: Digest of every rank's layout (``save_layout``): saves with equal digests have equal
    #: ``spec.tensors`` and ``spec.paths`` (the MetadataActor keeps them per digest).
    layout: bytes = b""


def collect_state(
    coord: Coordinator,
    state_dict: dict[str, Any] | FlatState,
    *,
    block_size: int | None = None,
    metadata: dict[str, Any] | None = None,
    node: str = "",
    claim: CheckpointDir | None = None,
    overwrite: bool = True,
) -> SaveContext:
    """Save steps collect and plan (collective): flatten, agree on the save id, plan the writes.

    Rank 0 plans every rank's writes and each rank receives its own plan; the
    plans are cached while every rank's layout repeats (``save_layout``).
    ``node``: where this rank runs (the Ray node id), sent to rank 0.
    ``claim``: where the save goes; rank 0 claims it for the new save id before
    sharing the id, so before any rank writes (``lease.claim_location``, with
    ``overwrite``). When this step succeeds the lease is rank 0's to keep and
    release; when it fails, it is released here.
    """
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    claimed: list[str] = []

    def claim_ids() -> tuple[str, str | None]:
        save_id = new_save_id()
        previous = None
        if claim is not None:
            previous = claim_location(claim, save_id, overwrite=overwrite)
            claimed.append(save_id)
        return save_id, previous

    try:
        with phase("plan"):
            a = agree_on_plan(coord, state_dict, node, claim_ids, block_size)
    except BaseException:
        if claimed:
            release_lease(claim, claimed[0])
            remove_failed_save(claim, claimed[0])
        raise
    spec = SaveSpec(
        a.save_id, coord.world_size, a.block_size, a.tensors, a.values, dict(metadata or {}), a.paths, a.previous
    )
    return SaveContext(spec, coord.rank, a.plan, a.nodes, a.flat, a.cached, a.layouts)


def write_share(ckdir: CheckpointDir, ctx: SaveContext, written_files: list[str]) -> WrittenShard:
    """Save step write, in this process: this rank's chunks into its shard files."""
    with phase("write"):
        chunks = create_chunk_data(ctx.plan, ctx.flat)
        parts = parts_here(ctx.spec.world_size, len(ctx.nodes))
        return write_chunks(ckdir, chunks, ctx.spec.save_id, ctx.rank, ctx.spec.block_size, written_files, parts)
