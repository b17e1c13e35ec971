"""What a manifest's JSON must hold: one declared schema, checked when a manifest is read. Pure: stdlib only.

The schema is data (``manifest_schema``, ``tensor_schema``, ``chunk_schema``)
built from a few node types (``Int``, ``Str``, ``Obj``, ``ListOf``...). Checking a
node against it raises ``SchemaError`` carrying the JSON path of the first bad
field (``entries['model.w'].chunks[3].byte_offset``) and what was expected;
``manifest.decode_manifest`` turns that into a ``CorruptCheckpointError`` naming
the file. Decoding checks each of millions of chunks with tight code first and
asks the schema only to name what is wrong, so the schema stays the one
statement of what is valid. ``docs/FORMAT.md`` lists the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: Integers in a manifest (sizes, offsets, ranks) are below 2**63: int64 everywhere.
INT_LIMIT = 2**63
#: Checksums are unsigned 64-bit values.
CHECKSUM_LIMIT = 2**64


class SchemaError(Exception):
    """A JSON node does not match the schema: ``path`` (``entries['k'].shape[1]``) and why.

    Internal to decoding: callers only ever see the ``CorruptCheckpointError`` made of it.
    """

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path or 'the document'}: {why}")
        self.path = path
        self.why = why


def show(value: Any, limit: int = 60) -> str:
    """A short description of a JSON value for messages (never walks a deep structure)."""
    if isinstance(value, list):
        return f"a list of {len(value)} item(s)" if value else "[]"
    if isinstance(value, dict):
        return f"an object with {len(value)} key(s)" if value else "{}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def item_path(path: str, index: int) -> str:
    return f"{path}[{index}]"


def key_path(path: str, key: str) -> str:
    return f"{path}[{key!r}]"


def field_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class Node:
    """A schema node: ``check`` raises ``SchemaError`` at the first violation below ``path``."""

    #: What a valid value is, in words ("a non-negative integer").
    expected = "a value"

    def check(self, value: Any, path: str) -> None:
        raise NotImplementedError

    def fail(self, value: Any, path: str) -> SchemaError:
        return SchemaError(path, f"expected {self.expected}, got {show(value)}")


@dataclass(frozen=True)
class Int(Node):
    """An integer (never a bool or a float) in ``[low, high)``."""

    low: int = 0
    high: int = INT_LIMIT

    @property
    def expected(self) -> str:  # type: ignore[override]
        return {0: "a non-negative integer", 1: "a positive integer"}.get(self.low, f"an integer >= {self.low}")

    def check(self, value: Any, path: str) -> None:
        if type(value) is not int or value < self.low:
            raise self.fail(value, path)
        if value >= self.high:
            limit = f"2**{self.high.bit_length() - 1}"
            raise SchemaError(path, f"expected {self.expected} below {limit}, got {show(value)}")


@dataclass(frozen=True)
class Number(Node):
    """A finite, non-negative number (a float, or an int below 2**63; not a bool)."""

    expected = "a finite non-negative number"

    def check(self, value: Any, path: str) -> None:
        if type(value) is int:
            ok = 0 <= value < INT_LIMIT
        else:
            ok = type(value) is float and math.isfinite(value) and value >= 0
        if not ok:
            raise self.fail(value, path)


@dataclass(frozen=True)
class Str(Node):
    """A string; non-empty unless ``empty``."""

    empty: bool = False

    @property
    def expected(self) -> str:  # type: ignore[override]
        return "a string" if self.empty else "a non-empty string"

    def check(self, value: Any, path: str) -> None:
        if type(value) is not str or (not value and not self.empty):
            raise self.fail(value, path)


@dataclass(frozen=True)
class OneOf(Node):
    """One of a few strings."""

    choices: tuple[str, ...]

    @property
    def expected(self) -> str:  # type: ignore[override]
        return "one of " + ", ".join(map(repr, self.choices))

    def check(self, value: Any, path: str) -> None:
        if type(value) is not str or value not in self.choices:
            raise self.fail(value, path)


@dataclass(frozen=True)
class AnyJSON(Node):
    """Anything JSON holds (a stored value is checked by decoding it, see ``Checked``)."""

    def check(self, value: Any, path: str) -> None:
        return None


@dataclass(frozen=True)
class Checked(Node):
    """A value checked by a function that raises ``ValueError`` saying what is wrong."""

    function: Callable[[Any], None]
    expected: str = "a valid value"

    def check(self, value: Any, path: str) -> None:
        try:
            self.function(value)
        except ValueError as exc:
            raise SchemaError(path, str(exc)) from None


@dataclass(frozen=True)
class ListOf(Node):
    item: Node
    #: Shown in messages: "a list of <items>".
    items: str = "values"

    @property
    def expected(self) -> str:  # type: ignore[override]
        return f"a list of {self.items}"

    def check(self, value: Any, path: str) -> None:
        if type(value) is not list:
            raise self.fail(value, path)
        for i, v in enumerate(value):
            self.item.check(v, item_path(path, i))


@dataclass(frozen=True)
class MapOf(Node):
    """An object whose keys are names (the manifest's keys) and whose values all match ``item``."""

    item: Node
    expected = "an object"

    def check(self, value: Any, path: str) -> None:
        if type(value) is not dict:
            raise self.fail(value, path)
        for k, v in value.items():
            self.item.check(v, key_path(path, k))


@dataclass(frozen=True)
class Obj(Node):
    """An object with these fields (unknown fields are ignored: later versions may add some)."""

    fields: Mapping[str, Node]
    optional: frozenset[str] = frozenset()
    expected = "an object"

    def check(self, value: Any, path: str, skip: tuple[str, ...] = ()) -> None:
        """Check ``value``; fields named in ``skip`` only for presence (the caller checks them)."""
        if type(value) is not dict:
            raise self.fail(value, path)
        for name, node in self.fields.items():
            if name in value:
                if name not in skip:
                    node.check(value[name], field_path(path, name))
            elif name not in self.optional:
                raise SchemaError(path, f"missing field {name!r}")


@dataclass(frozen=True)
class Tagged(Node):
    """An object whose ``tag`` field picks its schema (an entry's ``kind``)."""

    tag: str
    kinds: Mapping[str, Node]
    expected = "an object"

    def check(self, value: Any, path: str) -> None:
        if type(value) is not dict:
            raise self.fail(value, path)
        if self.tag not in value:
            raise SchemaError(path, f"missing field {self.tag!r}")
        kind = value[self.tag]
        node = self.kinds.get(kind) if type(kind) is str else None
        if node is None:
            known = " or ".join(map(repr, self.kinds))
            raise SchemaError(field_path(path, self.tag), f"unknown kind {show(kind)} (expected {known})")
        node.check(value, path)


SIZE = Int()
POSITIVE = Int(low=1)
INTS = ListOf(SIZE, "non-negative integers")


def chunk_schema(checksums: str) -> Obj:
    """One chunk; its list of block checksums is called ``checksums`` (``crc32`` in version 1)."""
    return Obj(
        {
            "offsets": INTS,
            "sizes": INTS,
            "file": Str(),
            "byte_offset": SIZE,
            "byte_length": SIZE,
            checksums: ListOf(Int(high=CHECKSUM_LIMIT), "checksums (integers in [0, 2**64))"),
        }
    )


#: An entry's path (version 3): checked against its key by ``paths.decode_path``; ignored before.
PATH = AnyJSON()


def tensor_schema(dtypes: tuple[str, ...], checksums: str, table: bool = False) -> Obj:
    """A tensor entry; with ``table`` (version 4) its chunks are in the chunk table, not here."""
    fields: dict[str, Node] = {"path": PATH, "dtype": OneOf(dtypes), "shape": INTS}
    if not table:
        fields["chunks"] = ListOf(chunk_schema(checksums), "chunks")
    return Obj(fields, optional=frozenset({"path"}))


#: Version 4's ``chunk_table``: the chunk table file, its size, row count and XXH3-64 digest.
CHUNK_TABLE = Obj({"path": Str(), "size": SIZE, "rows": SIZE, "xxh3_64": Int(high=CHECKSUM_LIMIT)})


def manifest_schema(
    dtypes: tuple[str, ...], checksums: tuple[str, ...], sums: str, value: Node, table: bool = False
) -> Obj:
    """The whole document of one format version (``format`` and ``version`` are checked before).

    ``sums``: the chunks' checksum field name; ``value``: how a stored value is checked;
    ``table``: the chunks are in a chunk table the document names (version 4).
    """
    entry = Tagged(
        "kind",
        {
            "tensor": tensor_schema(dtypes, sums, table),
            "value": Obj({"path": PATH, "value": value}, optional=frozenset({"path"})),
        },
    )
    return Obj(
        {
            "save_id": Str(empty=True),
            "world_size": POSITIVE,
            "created": Number(),
            "block_size": POSITIVE,
            "checksum": OneOf(checksums),
            "user_metadata": MapOf(AnyJSON()),
            "files": ListOf(Obj({"path": Str(), "size": SIZE, "rank": SIZE}), "files"),
            **({"chunk_table": CHUNK_TABLE} if table else {}),
            "entries": MapOf(entry),
        },
        optional=frozenset({"created", "checksum", "user_metadata"}),
    )
