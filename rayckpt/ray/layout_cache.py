"""The save layouts the MetadataActor keeps, so a save whose layout repeats sends only its digest.

A save's ``SaveSpec`` is mostly its *layout*: every tensor's dtype and global
shape and every key's path (``SpecLayout``, O(tensors) bytes), fixed by the
ranks' layouts (``engine.save_layout``: equal layout digests, equal tensors and
paths). The rest changes from save to save: ids, values, user metadata.

Rank 0 registers each save with the spec stripped of its layout (``split_spec``)
and a ``LayoutRef``: the layout's digest and an object-store reference to the
layout itself, put once per layout by rank 0 (``AsyncSaver``). The actor joins
the two again (``join_spec``) from its ``LayoutCache``; only when it lacks the
digest (the first save of a layout, the actor restarted, or the layout was
evicted) does it fetch the layout through the reference. So the actor receives
each layout once, and a restarted actor fetches it again instead of failing
the save.

Ray-free: the reference is opaque here; the actor's shell resolves it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from ..format.paths import Path
from ..storage.commit import SaveSpec

#: Layouts the actor keeps (least recently used dropped first): a few runs sharing the actor.
LAYOUTS_KEPT = 4


@dataclass(frozen=True, slots=True)
class SpecLayout:
    """The part of a ``SaveSpec`` its layout fixes."""

    #: Every tensor key's (dtype, global shape).
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    #: Each key's path through the nested state dict.
    paths: dict[str, Path]


@dataclass(frozen=True, slots=True)
class LayoutRef:
    """A save's layout as rank 0 sends it with every registration: its digest and where to fetch it."""

    #: ``engine.save.SaveContext.layout``: digest of every rank's layout.
    digest: bytes
    #: An object-store reference to the ``SpecLayout`` (owned by rank 0's process), nested in
    #: the call's arguments so Ray passes the reference, not the value: read only on a miss.
    ref: Any


def split_spec(spec: SaveSpec) -> tuple[SaveSpec, SpecLayout]:
    """``spec`` without its layout, and the layout."""
    return replace(spec, tensors={}, paths={}), SpecLayout(spec.tensors, spec.paths)


def join_spec(spec: SaveSpec, layout: SpecLayout) -> SaveSpec:
    """The full spec from one without its layout (``split_spec``) and the layout."""
    return replace(spec, tensors=layout.tensors, paths=layout.paths)


class LayoutCache:
    """The MetadataActor's layouts by digest, least recently used dropped past ``kept``.

    Counts what it saw, for ``MetadataActor.debug_stats``: ``layout_saves`` (registrations
    that sent only a digest), ``layouts_received`` (layouts fetched or sent in full) and
    ``layouts_held``.
    """

    def __init__(self, kept: int = LAYOUTS_KEPT) -> None:
        if kept < 1:
            raise ValueError(f"LayoutCache keeps at least one layout, got kept={kept}")
        self._kept = kept
        self._layouts: OrderedDict[bytes, SpecLayout] = OrderedDict()
        self._saves = 0
        self._received = 0

    def get(self, digest: bytes) -> SpecLayout | None:
        """The layout of ``digest`` if held (a save that sent only its digest: counted)."""
        self._saves += 1
        layout = self._layouts.get(digest)
        if layout is not None:
            self._layouts.move_to_end(digest)
        return layout

    def add(self, digest: bytes, layout: SpecLayout) -> None:
        """Hold ``layout`` (just received) under ``digest``; drop the least recently used past ``kept``."""
        self._received += 1
        self._layouts[digest] = layout
        self._layouts.move_to_end(digest)
        while len(self._layouts) > self._kept:
            self._layouts.popitem(last=False)

    def counts(self) -> dict[str, int]:
        return {"layout_saves": self._saves, "layouts_received": self._received, "layouts_held": len(self._layouts)}
