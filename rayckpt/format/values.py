"""Plain (non-tensor) values as tagged JSON: what the manifest stores for them. Pure: stdlib only.

JSON holds None, bool, int, finite float, str, list and dict with str keys as
themselves; what it lacks is tagged (see ``docs/FORMAT.md``). Nothing is pickled.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any

from ..errors import CorruptCheckpointError, InvalidStateError


def encode_value(value: Any, key: str) -> Any:
    """Turn a plain Python value into JSON-able data, tagging what JSON lacks.

    Tagged: tuples, dicts with non-str keys, non-finite floats, and (since format
    version 3) ``bytes``, ``bytearray`` and ``io.BytesIO`` as base64.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, f"{key}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, f"{key}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode_value(v, f"{key}.{k}") for k, v in value.items()}
        return {"__dict__": [[encode_value(k, key), encode_value(v, f"{key}.{k}")] for k, v in value.items()]}
    for tag, kind in _BYTES_TAGS.items():
        if isinstance(value, kind):
            raw = value.getvalue() if isinstance(value, io.BytesIO) else bytes(value)
            return {tag: base64.b64encode(raw).decode("ascii")}
    raise InvalidStateError(
        f"value at key {key!r} has type {type(value).__name__}, which the pickle-free format "
        "cannot store; use a tensor, a JSON-able value (None, bool, int, float, str, list, "
        "tuple, dict), bytes, bytearray, io.BytesIO or a Stateful object"
    )


#: Tag -> the binary type it restores (base64 in the JSON).
_BYTES_TAGS: dict[str, type] = {"__bytes__": bytes, "__bytearray__": bytearray, "__bytesio__": io.BytesIO}


def decode_value(data: Any) -> Any:
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if isinstance(data, dict):
        if "__tuple__" in data:
            return tuple(decode_value(v) for v in data["__tuple__"])
        if "__float__" in data:
            return float(data["__float__"])
        if "__dict__" in data:
            return {decode_value(k): decode_value(v) for k, v in data["__dict__"]}
        for tag, kind in _BYTES_TAGS.items():
            if tag in data:
                return kind(_b64(data[tag]))
        return {k: decode_value(v) for k, v in data.items()}
    return data


def check_value(data: Any) -> None:
    """Raise ``ValueError`` saying why ``data`` is not a stored value that ``decode_value`` restores.

    The manifest's schema runs it on every stored value when a manifest is read,
    so a bad tag (``{"__tuple__": 5}``, a float tag that is no float, bad base64,
    an unhashable dict key) or a value nested past Python's recursion limit is
    found there, not when the value is loaded.
    """
    try:
        decode_value(data)
    except RecursionError:
        raise ValueError("a stored value nested too deeply to decode") from None
    except (CorruptCheckpointError, ValueError, TypeError) as exc:
        raise ValueError(f"not a valid stored value ({exc})"[:300]) from None


def _b64(text: Any) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise CorruptCheckpointError(f"a bytes value is not valid base64: {str(text)[:60]!r}") from None
