"""What a manifest's JSON must hold: ``manifest.schema.json`` (JSON Schema 2020-12) beside this module. Pure.

The standard library only, until a document fails: then jsonschema is imported to name what is wrong.

The schema file is the one statement of what is valid: the docs publish it, a reader
in another language implements it, and this module checks documents against it
two ways, each built once per process from the file:

- ``accepts``: a check compiled from the schema's keywords into Python closures.
  Decoding runs it on every manifest: jsonschema, written for any schema, would
  take most of the decode of a large one (``docs/decisions.md``).
- ``find_problem``: when ``accepts`` refuses a document, jsonschema (imported
  then, not before) validates it and its first error becomes a ``SchemaError``
  carrying the JSON path of the bad field (``entries['model.w'].chunks[3].byte_offset``)
  and what was expected; ``manifest.decode_manifest`` turns that into a
  ``CorruptCheckpointError`` naming the file.

Both read integers strictly (a JSON integer, never ``1.0`` or ``true``) and numbers
as finite, as the schema's description says. ``tests/unit/test_manifest_schema.py``
keeps the two in agreement.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

#: The schema file, shipped in the package (``pyproject.toml``'s package data); the docs publish it.
SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")


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


def json_path(parts: list[str | int]) -> str:
    """``entries['model.w'].chunks[3].byte_offset`` for the parts of a path into the document."""
    out = ""
    for i, part in enumerate(parts):
        if type(part) is int:
            out += f"[{part}]"
        elif i == 1 and parts[0] == "entries":  # a key of the state dict, not a field name
            out += f"[{part!r}]"
        else:
            out += f".{part}" if out else part
    return out


@cache
def manifest_schema() -> dict[str, Any]:
    """The schema document (``manifest.schema.json``)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def document_definition(version: int) -> str:
    """The name of the ``$defs`` entry that holds the document schema of format ``version``."""
    return f"version_{min(version, 4)}"


# ---------------------------------------------------------------------------
# the compiled check

Check = Callable[[Any], bool]


def accepts(doc: Any, definition: str) -> bool:
    """Whether ``doc`` matches ``$defs[definition]`` of the schema (the compiled check)."""
    return _compiled(definition)(doc)


@cache
def _compiled(definition: str) -> Check:
    return _Compiler(manifest_schema()["$defs"]).ref(f"#/$defs/{definition}")


def _is_number(v: Any) -> bool:
    return type(v) is int or (type(v) is float and math.isfinite(v))


#: JSON Schema's types as the manifest reads them: integers strictly, numbers finite.
TYPES: dict[str, Check] = {
    "integer": lambda v: type(v) is int,
    "number": _is_number,
    "string": lambda v: type(v) is str,
    "object": lambda v: type(v) is dict,
    "array": lambda v: type(v) is list,
    "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
}
_MISSING = object()
#: Markers in a compiled record: the field is an integer (a list of integers) in the field's bounds.
_INTEGER = object()
_INTEGERS = object()


def _integers(s: dict[str, Any]) -> bool:
    """Whether a node is an integer in bounds and nothing else."""
    return s.get("type") == "integer" and set(s) - _ANNOTATIONS <= {"type", "minimum", "maximum"}


#: Keywords that only describe: the compiled check skips them.
_ANNOTATIONS = frozenset({"$schema", "$defs", "title", "description"})


def _equal(a: Any, b: Any) -> bool:
    """JSON equality (``enum``, ``const``): ``true`` is not ``1``."""
    return (type(a) is bool) == (type(b) is bool) and a == b


class _Compiler:
    """Turns schema nodes into closures. Knows the keywords the manifest's schema uses; any other fails loudly."""

    def __init__(self, defs: dict[str, Any]) -> None:
        self.defs = defs
        self.done: dict[str, Check] = {}

    def ref(self, ref: str) -> Check:
        name = ref.removeprefix("#/$defs/")
        if name not in self.done:
            self.done[name] = lambda v: self.done[name](v)  # until compiled: a reference back to itself
            self.done[name] = self.node(self.defs[name])
        return self.done[name]

    def node(self, s: dict[str, Any]) -> Check:
        unknown = set(s) - _ANNOTATIONS - set(_KEYWORDS)
        if unknown:
            raise ValueError(f"the manifest schema uses keyword(s) the compiled check lacks: {sorted(unknown)}")
        keywords = set(s) - _ANNOTATIONS
        # The nodes a manifest repeats most (chunks, files, lists of integers), each in one closure.
        if _integers(s):
            lo, hi = s.get("minimum", -math.inf), s.get("maximum", math.inf)
            return lambda v: type(v) is int and lo <= v <= hi
        if s.get("type") == "string" and keywords <= {"type", "minLength"}:
            n = s.get("minLength", 0)
            return lambda v: type(v) is str and len(v) >= n
        if s.get("type") == "object" and keywords <= {"type", "required", "properties"}:
            return self.record(s)
        if s.get("type") == "array" and keywords == {"type", "items"}:
            return self.items(s, strict=True)
        checks = [_KEYWORDS[k](self, s) for k in s if k in _KEYWORDS and k != "then"]
        if len(checks) == 1:
            return checks[0]
        if len(checks) == 2:
            first, second = checks
            return lambda v: first(v) and second(v)
        return lambda v: all(c(v) for c in checks)

    def type(self, s: dict[str, Any]) -> Check:
        return TYPES[s["type"]]

    def enum(self, s: dict[str, Any]) -> Check:
        choices = s["enum"]
        if all(type(c) is str for c in choices):
            names = frozenset(choices)
            return lambda v: type(v) is str and v in names
        return lambda v: any(_equal(v, c) for c in choices)

    def const(self, s: dict[str, Any]) -> Check:
        return lambda v: _equal(v, s["const"])

    def minimum(self, s: dict[str, Any]) -> Check:
        lo = s["minimum"]
        return lambda v: not _is_number(v) or not v < lo

    def maximum(self, s: dict[str, Any]) -> Check:
        hi = s["maximum"]
        return lambda v: not _is_number(v) or not v > hi

    def min_length(self, s: dict[str, Any]) -> Check:
        n = s["minLength"]
        return lambda v: type(v) is not str or len(v) >= n

    def min_items(self, s: dict[str, Any]) -> Check:
        n = s["minItems"]
        return lambda v: type(v) is not list or len(v) >= n

    def required(self, s: dict[str, Any]) -> Check:
        names = tuple(s["required"])
        return lambda v: type(v) is not dict or all(n in v for n in names)

    def properties(self, s: dict[str, Any]) -> Check:
        fields = tuple((name, self.node(sub)) for name, sub in s["properties"].items())

        def check(v: Any) -> bool:
            if type(v) is not dict:
                return True
            for name, c in fields:
                if name in v and not c(v[name]):
                    return False
            return True

        return check

    def additional_properties(self, s: dict[str, Any]) -> Check:
        sub, named = s["additionalProperties"], frozenset(s.get("properties", ()))
        if sub is False:
            return lambda v: type(v) is not dict or named.issuperset(v)
        c = self.node(sub)
        return lambda v: type(v) is not dict or all(c(x) for k, x in v.items() if k not in named)

    def items(self, s: dict[str, Any], strict: bool = False) -> Check:
        """``items``; with ``strict`` the node's ``"type": "array"`` too."""
        sub = self.resolve(s["items"])
        if _integers(sub):
            lo, hi = sub.get("minimum", -math.inf), sub.get("maximum", math.inf)

            def integers(v: Any) -> bool:
                if type(v) is not list:
                    return not strict
                for x in v:
                    if type(x) is not int or not lo <= x <= hi:
                        return False
                return True

            return integers
        c = self.node(sub)

        def check(v: Any) -> bool:
            if type(v) is not list:
                return not strict
            for x in v:
                if not c(x):
                    return False
            return True

        return check

    def record(self, s: dict[str, Any]) -> Check:
        """An object node of ``type``, ``required`` and ``properties`` only.

        One pass over its fields; an integer field, or a list of integers, is checked in the loop.
        """
        required = s.get("required", ())
        properties = s.get("properties", {})
        unlisted = tuple(name for name in required if name not in properties)
        fields = []
        for name, sub in properties.items():
            sub = self.resolve(sub)
            items = self.resolve(sub.get("items", {})) if set(sub) - _ANNOTATIONS == {"type", "items"} else {}
            if _integers(sub):
                fields.append(
                    (name, name in required, _INTEGER, sub.get("minimum", -math.inf), sub.get("maximum", math.inf))
                )
            elif sub.get("type") == "array" and _integers(items):
                fields.append(
                    (name, name in required, _INTEGERS, items.get("minimum", -math.inf), items.get("maximum", math.inf))
                )
            else:
                fields.append((name, name in required, self.node(sub), 0, 0))

        def check(v: Any) -> bool:
            if type(v) is not dict:
                return False
            for name, needed, c, lo, hi in fields:
                x = v.get(name, _MISSING)
                if x is _MISSING:
                    if needed:
                        return False
                elif c is _INTEGER:
                    if type(x) is not int or not lo <= x <= hi:
                        return False
                elif c is _INTEGERS:
                    if type(x) is not list:
                        return False
                    for i in x:
                        if type(i) is not int or not lo <= i <= hi:
                            return False
                elif not c(x):
                    return False
            for name in unlisted:
                if name not in v:
                    return False
            return True

        return check

    def resolve(self, s: dict[str, Any]) -> dict[str, Any]:
        """The definition a node that is only a ``$ref`` (and annotations) names; else the node."""
        return self.defs[s["$ref"].removeprefix("#/$defs/")] if set(s) - _ANNOTATIONS == {"$ref"} else s

    def reference(self, s: dict[str, Any]) -> Check:
        return self.ref(s["$ref"])

    def all_of(self, s: dict[str, Any]) -> Check:
        checks = [self.node(sub) for sub in s["allOf"]]
        return lambda v: all(c(v) for c in checks)

    def any_of(self, s: dict[str, Any]) -> Check:
        checks = [self.node(sub) for sub in s["anyOf"]]
        return lambda v: any(c(v) for c in checks)

    def if_then(self, s: dict[str, Any]) -> Check:
        condition, then = self.node(s["if"]), self.node(s.get("then", {}))
        return lambda v: not condition(v) or then(v)


_KEYWORDS: dict[str, Callable[[_Compiler, dict[str, Any]], Check]] = {
    "type": _Compiler.type,
    "enum": _Compiler.enum,
    "const": _Compiler.const,
    "minimum": _Compiler.minimum,
    "maximum": _Compiler.maximum,
    "minLength": _Compiler.min_length,
    "minItems": _Compiler.min_items,
    "required": _Compiler.required,
    "properties": _Compiler.properties,
    "additionalProperties": _Compiler.additional_properties,
    "items": _Compiler.items,
    "$ref": _Compiler.reference,
    "allOf": _Compiler.all_of,
    "anyOf": _Compiler.any_of,
    "if": _Compiler.if_then,
    "then": _Compiler.if_then,
}


# ---------------------------------------------------------------------------
# naming what is wrong: jsonschema


@cache
def validator(definition: str | None = None) -> Any:
    """A jsonschema validator of the schema (of ``$defs[definition]``), with the types read as ``TYPES`` reads them.

    jsonschema is imported here, on first use: decoding a valid manifest never needs it.
    """
    import jsonschema  # the one import outside the standard library, on first use (the purity test allows it)

    base = jsonschema.Draft202012Validator
    types = base.TYPE_CHECKER.redefine_many({name: _typed(check) for name, check in TYPES.items()})
    strict = jsonschema.validators.extend(base, type_checker=types)
    schema = manifest_schema()
    if definition is not None:
        schema = {"$ref": f"#/$defs/{definition}", "$defs": schema["$defs"]}
    return strict(schema)


def _typed(check: Check) -> Callable[[Any, Any], bool]:
    return lambda _checker, value: check(value)


def find_problem(doc: Any, definition: str) -> tuple[list[str | int], SchemaError] | None:
    """The first error jsonschema finds in ``doc`` against ``$defs[definition]``: its path's parts and the
    ``SchemaError`` that says it; None when there is none."""
    error = next(iter(validator(definition).iter_errors(doc)), None)
    if error is None:
        return None
    parts = list(error.absolute_path)
    return parts, SchemaError(json_path(parts), _why(error))


def _why(error: Any) -> str:
    """What a jsonschema error means, in the words of the manifest's messages."""
    s, value = error.schema, error.instance
    if error.validator == "required":
        return f"missing field {next(n for n in error.validator_value if n not in value)!r}"
    if error.validator == "enum" and s.get("title") == "kind":
        return f"unknown kind {show(value)} (expected {' or '.join(map(repr, s['enum']))})"
    if error.validator == "maximum":
        return f"expected {expected(s)} below 2**{(error.validator_value + 1).bit_length() - 1}, got {show(value)}"
    return f"expected {expected(s)}, got {show(value)}"


def expected(s: dict[str, Any]) -> str:
    """What a schema node accepts, in words ("a non-negative integer", "a list of chunks")."""
    if "$ref" in s and "type" not in s:
        s = _definition(s["$ref"])
    if "enum" in s:
        return "one of " + ", ".join(map(repr, s["enum"]))
    kind = s.get("type")
    if kind == "integer":
        low = s.get("minimum")
        return {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer >= {low}")
    if kind == "number":
        return "a finite non-negative number"
    if kind == "string":
        return "a non-empty string" if s.get("minLength") else "a string"
    if kind == "array":
        items = s.get("items", {})
        items = _definition(items["$ref"]) if "$ref" in items else items
        return f"a list of {items.get('title', 'value')}s"
    return "an object" if kind == "object" else "a valid value"


def _definition(ref: str) -> dict[str, Any]:
    return manifest_schema()["$defs"][ref.removeprefix("#/$defs/")]
