"""Flatten state dicts into keys, boxes and local tensors, and write loaded data back.

Keys join the path through nested dicts and lists with ``.``, as DCP does
(``app.model.layers.0.weight``); the path itself is kept too (``FlatState.paths``)
so that exports rebuild the nesting that was saved. A ``Stateful`` object (anything with
``state_dict()`` and ``load_state_dict()``) is replaced by its ``state_dict()``
on save and given the filled dict back on load. Containers holding no tensor are
stored whole as one JSON value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..bounded import BoundedMap
from ..errors import CorruptCheckpointError, InvalidStateError
from ..format.boxes import Box
from ..format.paths import Path, join_path, path_part

try:
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]
try:
    from torch.distributed._shard.sharded_tensor import ShardedTensorBase
except ImportError:  # pragma: no cover - torch built without distributed
    ShardedTensorBase = None  # type: ignore[assignment,misc]


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a manifest names (the inverse of ``dtype_name``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown torch dtype {name!r} in manifest")
    return dtype


@dataclass(frozen=True, slots=True)
class Piece:
    """One shard a rank holds of a tensor: where it lies in the global tensor, and the local tensor holding it."""

    box: Box
    local: torch.Tensor


@dataclass(slots=True, kw_only=True)
class TensorLeaf:
    key: str
    #: The rank's local data: one piece for a plain tensor or a DTensor's local shard;
    #: one per local shard of a ``LocalShardsWrapper`` (uneven, several or none);
    #: none on a rank outside a DTensor's mesh.
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]
    dtype: str
    #: The tensor as the state holds it (a DTensor counts its in-place ops in its own version counter).
    source: torch.Tensor | None = None

    def boxes(self) -> tuple[Box, ...]:
        """The boxes this rank reports to the save and load plans: its pieces'.

        A rank holding no piece reports one empty box, so the key, its shape and
        dtype still reach the plans (checked, nothing written or read); a 0-dim
        tensor has no empty box and reports none.
        """
        if self.pieces or not self.shape:
            return tuple(p.box for p in self.pieces)
        return (Box((0,) * len(self.shape), (0,) * len(self.shape)),)

    def region(self, box: Box) -> torch.Tensor:
        """The view of the local data at global ``box``, which lies inside one piece (writer and reader)."""
        for p in self.pieces:
            if p.box.contains(box):
                return p.local[box.relative_to(p.box).to_slices()]
        held = [list(p.box.offsets) for p in self.pieces]
        raise ValueError(f"key {self.key!r}: box {box} lies in none of this rank's pieces (at offsets {held})")


@dataclass(slots=True)
class ValueLeaf:
    key: str
    value: Any
    #: Puts a loaded value back where this one came from.
    assign: Callable[[Any], None]


@dataclass(slots=True)
class FlatState:
    tensors: dict[str, TensorLeaf] = field(default_factory=dict)
    values: dict[str, ValueLeaf] = field(default_factory=dict)
    #: Stateful objects with the dict their ``state_dict()`` gave, to hand back on load.
    statefuls: list[tuple[Any, Any]] = field(default_factory=list)
    #: Every key's path through the nested dicts and lists (tensors and values).
    paths: dict[str, Path] = field(default_factory=dict)

    def finish_load(self) -> None:
        for obj, sd in self.statefuls:
            obj.load_state_dict(sd)


def flatten(state_dict: dict[str, Any] | FlatState) -> FlatState:
    """Walk ``state_dict``; call ``state_dict()`` on every Stateful object found.

    A ``FlatState`` is returned as is: a caller that flattened once (the ``Checkpointer``,
    for a step saved to two tiers) passes it on instead of the dict.
    """
    if isinstance(state_dict, FlatState):
        return state_dict
    if not isinstance(state_dict, dict):
        raise InvalidStateError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    flat = FlatState()
    _walk(state_dict, (), flat)
    return flat


def flat_of(state_dict: dict[str, Any] | FlatState) -> FlatState:
    """``state_dict`` flattened (``flatten``), or as is when its caller flattened it already: a save
    flattens its state once, wherever it starts."""
    return state_dict if isinstance(state_dict, FlatState) else flatten(state_dict)


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor) or is_stateful(obj):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _key_order(item: tuple[Any, Any]) -> tuple[str, str]:
    """Sort key of a dict item: its key as text (keys of mixed types sort too), then the type."""
    return str(item[0]), type(item[0]).__name__


def _walk(container: dict | list, prefix: Path, flat: FlatState) -> None:
    # Dicts in sorted key order, not insertion order: every rank then calls its
    # Stateful objects' state_dict() (here) and load_state_dict() (``finish_load``,
    # in this order) and assigns loaded values in the same order, whatever order its
    # dicts were built in. Those calls may run collectives, which must line up across
    # ranks (DCP sorts the same way).
    items = sorted(container.items(), key=_key_order) if isinstance(container, dict) else enumerate(container)
    for k, v in list(items):
        path = (*prefix, path_part(container, k))
        key = join_path(path)
        if is_stateful(v) and not isinstance(v, torch.Tensor):
            sd = v.state_dict()
            if not isinstance(sd, dict):
                raise InvalidStateError(
                    f"Stateful at key {key!r} returned {type(sd).__name__} from state_dict(), not a dict"
                )
            flat.statefuls.append((v, sd))
            _walk(sd, path, flat)
        elif isinstance(v, torch.Tensor):
            _add_tensor(key, v, flat)
            flat.paths[key] = path
        elif isinstance(v, (dict, list)) and _has_tensor(v):
            _walk(v, path, flat)
        elif isinstance(v, tuple) and _has_tensor(v):
            raise InvalidStateError(f"key {key!r}: tuples holding tensors cannot be loaded in place; use a list")
        else:
            _check_unique(key, flat)
            flat.values[key] = ValueLeaf(key, v, _setter(container, k))
            flat.paths[key] = path


def _setter(container: dict | list, k: Any) -> Callable[[Any], None]:
    def assign(value: Any) -> None:
        container[k] = value

    return assign


def _check_unique(key: str, flat: FlatState) -> None:
    if key in flat.tensors or key in flat.values:
        raise InvalidStateError(f"two entries flatten to the same key {key!r}; rename one")


def _refuse_unsupported(key: str, t: torch.Tensor) -> None:
    """Refuse, naming the key and type, tensors whose layout rayckpt cannot describe as boxes."""
    kind = type(t).__name__
    if ShardedTensorBase is not None and isinstance(t, ShardedTensorBase):
        raise InvalidStateError(
            f"key {key!r}: {kind} (the legacy torch.distributed._shard sharded tensor) is not supported; "
            "save a DTensor instead (FSDP2's fully_shard gives DTensors)"
        )
    if (DTensor is None or not isinstance(t, DTensor)) and hasattr(type(t), "__create_write_items__"):
        raise InvalidStateError(
            f"key {key!r}: {kind} is a tensor subclass with DCP's own checkpoint protocol "
            "(__create_write_items__), which rayckpt does not support; save a DTensor or a plain tensor"
        )


def _add_tensor(key: str, t: torch.Tensor, flat: FlatState) -> None:
    _check_unique(key, flat)
    _refuse_unsupported(key, t)
    shape = tuple(t.shape)
    if DTensor is not None and isinstance(t, DTensor):
        pieces = _dtensor_pieces(key, t)
    else:
        pieces = (Piece(Box.full(shape), t),)
    flat.tensors[key] = TensorLeaf(key=key, pieces=pieces, shape=shape, dtype=dtype_name(t.dtype), source=t)


def _dtensor_pieces(key: str, t: DTensor) -> tuple[Piece, ...]:
    """This rank's pieces of a DTensor: none off its mesh, each listed local shard, or its one local shard."""
    if any(isinstance(p, Partial) for p in t.placements):
        raise InvalidStateError(
            f"key {key!r}: DTensor with Partial placement {t.placements} has no stored value yet; "
            "reduce it (redistribute to Replicate or Shard) before saving"
        )
    if t.device_mesh.get_coordinate() is None:
        # A mesh of some ranks only (a sub-mesh): the others hold nothing of it, as in DCP.
        return ()
    shape = tuple(t.shape)
    # The local shard itself: ``to_local()`` runs an autograd function to make a view of it on every call.
    local = getattr(t, "_local_tensor", None)
    if local is None:
        local = t.to_local()
    if hasattr(local, "__create_chunk_list__"):
        return _listed_pieces(key, shape, local)
    local_shape, offsets = _local_box(shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(local_shape):
        raise InvalidStateError(
            f"key {key!r}: local shard shape {list(local.shape)} does not match the "
            f"placement's {list(local_shape)} (padded or strided sharding is not supported)"
        )
    return (Piece(Box(tuple(offsets), tuple(local_shape)), local),)


#: This rank's (local shape, global offsets) per DTensor (global shape, mesh, placements): the same
#: for every parameter of one shape, and the computation is the most of what flattening a DTensor costs.
_LOCAL_BOXES: BoundedMap[tuple[Any, ...], tuple[Any, Any]] = BoundedMap(4096)


def _local_box(shape: tuple[int, ...], mesh: Any, placements: Any) -> tuple[Any, Any]:
    key = (shape, mesh, tuple(placements))
    found = _LOCAL_BOXES.get(key)
    if found is None:
        found = compute_local_shape_and_global_offset(shape, mesh, placements)
        _LOCAL_BOXES.put(key, found)
    return found


def _listed_pieces(key: str, shape: tuple[int, ...], local: Any) -> tuple[Piece, ...]:
    """The local shards of a local tensor that lists its own chunks, as DCP reads them
    (``__create_chunk_list__``, ``__get_tensor_shard__``: a ``LocalShardsWrapper``).

    Each shard keeps its own offsets and sizes, so a rank may hold uneven shards,
    several, or none.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex

    pieces = []
    for i, chunk in enumerate(local.__create_chunk_list__()):
        box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
        if box.volume == 0:
            continue  # nothing to save or fill; an empty wrapper lists one such placeholder chunk
        shard = local.__get_tensor_shard__(MetadataIndex(key, chunk.offsets, i))
        if box.ndim != len(shape) or not Box.full(shape).contains(box) or tuple(shard.shape) != box.sizes:
            raise InvalidStateError(
                f"key {key!r}: local shard {i} (offsets {list(box.offsets)}, sizes {list(box.sizes)}, "
                f"tensor shape {list(shard.shape)}) does not fit the DTensor's shape {list(shape)}"
            )
        pieces.append(Piece(box, shard))
    return tuple(pieces)


def as_bytes(t: torch.Tensor) -> Any:
    """A zero-copy uint8 numpy view of a contiguous CPU tensor's bytes."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()
