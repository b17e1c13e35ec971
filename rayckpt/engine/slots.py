"""Gather to rank 0 and scatter from it over a host (gloo) group: one collective each.

``torch.distributed``'s ``gather_object`` runs two collectives (the sizes, then the
bytes) and ``scatter_object_list`` three; a save's planning runs one of each, so
five collectives where two carry the bytes. Here every rank's pickled object goes
in a fixed-size slot (its length first, then its bytes), and one ``gather`` or
``scatter`` of the slots moves it. An object longer than its slot sends what is
left point to point afterwards: only the ranks involved know, and they alone take
part. So what a rank receives is still its own part, never everyone's.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

#: Bytes of one slot after its 8-byte length: a save's header and cached-plan answer fit.
SLOT_BYTES = 4096
_LEN = 8


def _fill(obj: Any) -> tuple[torch.Tensor, bytes]:
    """A slot holding ``obj``'s length and its first ``SLOT_BYTES`` bytes, and the rest that did not fit."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    slot = torch.zeros(_LEN + SLOT_BYTES, dtype=torch.uint8)
    head = data[:SLOT_BYTES]
    slot[:_LEN] = torch.frombuffer(bytearray(len(data).to_bytes(_LEN, "little")), dtype=torch.uint8)
    if head:
        slot[_LEN : _LEN + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    return slot, data[SLOT_BYTES:]


def _length(slot: torch.Tensor) -> int:
    return int.from_bytes(slot[:_LEN].numpy().tobytes(), "little")


def _read(dist: Any, group: Any, slot: torch.Tensor, peer: int) -> Any:
    """The object in ``slot``, receiving what did not fit from group rank ``peer``."""
    n = _length(slot)
    data = slot[_LEN : _LEN + min(n, SLOT_BYTES)].numpy().tobytes()
    if n > SLOT_BYTES:
        rest = torch.empty(n - SLOT_BYTES, dtype=torch.uint8)
        dist.recv(rest, group=group, group_src=peer)
        data += rest.numpy().tobytes()
    return pickle.loads(data)


def _send_rest(dist: Any, group: Any, rest: bytes, peer: int) -> None:
    if rest:
        dist.send(torch.frombuffer(bytearray(rest), dtype=torch.uint8), group=group, group_dst=peer)


def gather(dist: Any, group: Any, rank: int, world: int, obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on group rank 0, ``None`` elsewhere."""
    slot, rest = _fill(obj)
    if rank != 0:
        dist.gather(slot, None, group=group, group_dst=0)
        _send_rest(dist, group, rest, 0)
        return None
    slots = [torch.empty_like(slot) for _ in range(world)]
    dist.gather(slot, slots, group=group, group_dst=0)
    return [obj if r == 0 else _read(dist, group, s, r) for r, s in enumerate(slots)]


def scatter(dist: Any, group: Any, rank: int, world: int, objs: list[Any] | None) -> Any:
    """Group rank r's item of rank 0's ``objs`` (one per rank)."""
    mine = torch.empty(_LEN + SLOT_BYTES, dtype=torch.uint8)
    if rank != 0:
        dist.scatter(mine, None, group=group, group_src=0)
        return _read(dist, group, mine, 0)
    assert objs is not None and len(objs) == world
    filled = [_fill(o) for o in objs]
    dist.scatter(mine, [slot for slot, _ in filled], group=group, group_src=0)
    for r, (_, rest) in enumerate(filled):
        if r != 0:
            _send_rest(dist, group, rest, r)
    return objs[0]
