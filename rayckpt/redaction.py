"""Credentials in a location never printed: ``s3://KEY:SECRET@bucket/run`` shows as ``s3://KEY:***@bucket/run``.

pyarrow reads an object store's credentials from a URI's user info
(``s3://ACCESS_KEY:SECRET_KEY@bucket/path``) and from query parameters such as
``secret_key=`` and ``session_token=``. rayckpt opens storage with the location as
given and shows it everywhere else (messages, logs, reports, ``--json``, events)
through ``redact``. Pure string work: no I/O, no imports of the rest of rayckpt.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["HIDDEN", "redact", "redact_fields", "redact_text"]

#: What a secret is replaced with.
HIDDEN = "***"

#: A query parameter whose value is a secret: ``secret_key``, ``session_token``, a password, ...
_SECRET_PARAM = re.compile(r"(?i)([?&;][^=&;#]*(?:secret|token|password|passwd|credential|signature)[^=&;#]*=)[^&;#]*")
#: A URI in free text: ends at white space, a quote or a closing bracket.
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"`<>()\[\]{}]+")


def redact(location: str) -> str:
    """``location`` with its secrets replaced by ``***``: the password of a URI's user info
    (the whole user info when it has no ``:``) and secret query parameters. A local path,
    or a URI without credentials, comes back unchanged."""
    scheme, sep, rest = location.partition("://")
    if not sep:
        return location
    end = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    head, query = rest[:end], rest[end:]
    slash = head.find("/")
    authority = head if slash < 0 else head[:slash]
    # User info ends at the authority's last "@". A secret with a raw "/" in it (pyarrow wants it
    # percent-encoded) puts the "@" past that "/": the ":" before it says so; then the last "@" ends it.
    at = authority.rfind("@")
    if at < 0 and ":" in authority:
        at = head.rfind("@")
    if at >= 0:
        user, colon, _ = head[:at].partition(":")
        head = (f"{user}:{HIDDEN}" if colon else HIDDEN) + head[at:]
    return f"{scheme}://{head}{_SECRET_PARAM.sub(_hide_value, query)}"


def _hide_value(match: re.Match[str]) -> str:
    return match.group(1) + HIDDEN


def redact_text(text: str) -> str:
    """``text`` with every URI in it passed through ``redact`` (a message that quotes locations)."""
    if "://" not in text:
        return text
    return _URI_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


def redact_fields(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` (an event, a report as a dict) with ``redact_text`` applied to its string values."""
    return {k: redact_text(v) if isinstance(v, str) else v for k, v in record.items()}
