"""Where each key sits in the saved state dict: its path through nested dicts and lists. Pure.

A checkpoint's keys are flat (``model.layers.0.weight``), as DCP's are, and a
key alone cannot say whether ``layers.0.weight`` was one dict key with dots in
it (a module's ``state_dict()``) or three levels. Since format version 3 the
manifest records each key's path, and exports rebuild the exact nesting that
was saved with ``nest``.

A path is a tuple of parts: a ``str`` is a dict key, an ``int`` a list index,
and a ``DictKey`` a dict key that is not a ``str`` (an optimizer's ``{0: ...}``
state). Joined with ``.`` (``join_path``) a path gives its key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError
from .values import decode_value, encode_value


@dataclass(frozen=True, slots=True)
class DictKey:
    """A dict key that is not a ``str`` (an int, a float, a tuple...) in a path."""

    key: Any

    def __str__(self) -> str:
        return str(self.key)


PathPart = str | int | DictKey
Path = tuple[PathPart, ...]


def path_part(container: dict | list, k: Any) -> PathPart:
    """The part naming ``k`` inside ``container`` (a list index, or a dict key)."""
    if isinstance(container, list) or isinstance(k, str):
        return k
    return DictKey(k)


def join_path(path: Path) -> str:
    """The flat key of ``path`` (parts joined with ``.``)."""
    return ".".join(map(str, path))


def strip_prefix(path: Path, key: str, prefix: str) -> Path:
    """``path`` without the leading parts that spell ``prefix`` (``"app.model."``).

    A prefix that ends inside a part leaves the rest of the key as one flat part.
    """
    if not prefix:
        return path
    text = ""
    for i, part in enumerate(path):
        text += f"{part}."
        if text == prefix:
            return path[i + 1 :]
        if len(text) >= len(prefix):
            break
    return (key[len(prefix) :],)


def add_prefix(prefix: str, path: Path) -> Path:
    """``path`` under ``prefix``: its dotted parts become dict keys, a trailing rest joins the first part."""
    if not prefix:
        return path
    *parents, rest = prefix.split(".")
    if not rest:
        return (*parents, *path)
    return (*parents, f"{rest}{path[0]}", *path[1:]) if path else (*parents, rest)


def dcp_path(path: Path) -> tuple[str | int, ...]:
    """The path as DCP records it in ``planner_data`` (dict keys as ``str``, list indices as ``int``)."""
    return tuple(str(p) if isinstance(p, DictKey) else p for p in path)


class _Node(dict):
    """A container being rebuilt: a dict of its children, and whether it is a list."""

    is_list: bool | None = None


def nest(items: Iterable[tuple[Path, Any]]) -> dict[Any, Any]:
    """The nested dicts and lists that ``(path, value)`` pairs describe.

    Raises ``CorruptCheckpointError`` naming the key when two paths disagree
    (one holds a value where another holds a container, or a container is both
    a list and a dict).
    """
    root = _Node()
    root.is_list = False
    for path, value in items:
        if not path:
            raise CorruptCheckpointError("a key has an empty path")
        node = root
        for depth, part in enumerate(path):
            as_list = type(part) is int
            if node.is_list is None:
                node.is_list = as_list
            elif node.is_list != as_list:
                raise CorruptCheckpointError(
                    f"key {join_path(path)!r}: {join_path(path[:depth]) or 'the state dict'} "
                    f"is a {'dict' if as_list else 'list'} for another key"
                )
            k = part.key if isinstance(part, DictKey) else part
            child = node.get(k, _MISSING)
            if depth == len(path) - 1:
                if child is not _MISSING:
                    raise CorruptCheckpointError(f"key {join_path(path)!r} is stored twice or holds other keys")
                node[k] = value
            else:
                if child is _MISSING:
                    child = node[k] = _Node()
                elif not isinstance(child, _Node):
                    raise CorruptCheckpointError(
                        f"key {join_path(path)!r} lies under {join_path(path[: depth + 1])!r}, which is a value"
                    )
                node = child
    return _finish(root)


_MISSING = object()


def _finish(node: Any) -> Any:
    if not isinstance(node, _Node):
        return node
    if node.is_list:
        # A selection (an export's prefix) may skip indices: they become None.
        return [_finish(node.get(i)) for i in range(max(node) + 1)] if node else []
    return {k: _finish(v) for k, v in node.items()}


def encode_path(path: Path) -> list[Any]:
    """A path as JSON: dict keys as strings, list indices as integers, other dict keys tagged ``{"key": ...}``."""
    return [{"key": encode_value(p.key, join_path(path))} if isinstance(p, DictKey) else p for p in path]


def decode_path(data: Any, key: str, where: str) -> Path:
    """The path of ``key`` from its JSON form; it must spell ``key``."""
    if not isinstance(data, list) or not data:
        raise CorruptCheckpointError(f"{where}: key {key!r} has path {data!r}, not a non-empty list"[:300])
    parts: list[Any] = []
    for p in data:
        if isinstance(p, str) or (type(p) is int and p >= 0):
            parts.append(p)
        elif isinstance(p, dict) and set(p) == {"key"}:
            try:
                part = DictKey(decode_value(p["key"]))
            except (CorruptCheckpointError, ValueError, TypeError, RecursionError):
                raise CorruptCheckpointError(f"{where}: key {key!r} has an undecodable dict key in its path") from None
            try:
                hash(part)
            except TypeError:
                raise CorruptCheckpointError(f"{where}: key {key!r} has an unhashable dict key in its path") from None
            parts.append(part)
        else:
            raise CorruptCheckpointError(f"{where}: key {key!r} has a bad path part {p!r}"[:300])
    path = tuple(parts)
    if join_path(path) != key:
        raise CorruptCheckpointError(f"{where}: key {key!r} has path {data!r}, which spells another key"[:300])
    return path
