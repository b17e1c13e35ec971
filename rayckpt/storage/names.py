"""The names a save gives its files: its id, its shard files, and how a file name says which save wrote it."""

from __future__ import annotations

import re
import time
import uuid

_SHARD_FILE = re.compile(r"^(.+)-r\d{5,}-[^-]+\.arrow$")
#: A version-4 save's chunk table (``manifest.chunk_table_name``).
_CHUNK_TABLE = re.compile(r"^(.+)-chunks\.arrow$")
#: The list of shared shard files an incremental save keeps alive while it runs (``storage.shared.keeps_name``).
_KEEPS = re.compile(r"^(.+)-keeps\.json$")


def new_save_id() -> str:
    """A save's id: its start time and a random suffix (``20260101T120000-1a2b3c4d``).

    Shard files start with it, so a failed save's files can be found by prefix.
    """
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def shard_file_name(save_id: str, rank: int, storage_type: str, part: int = 0) -> str:
    """The shard file ``rank`` writes for one storage type; ``part`` > 0: its further files of
    that type, when its bytes were split to be written at once (docs/FORMAT.md: file naming)."""
    return f"{save_id}-r{rank:05d}-{storage_type}{f'.{part}' if part else ''}.arrow"


def shard_file_save_id(name: str) -> str | None:
    """The save id a shard file's or chunk table's name starts with (``None``: neither)."""
    match = _SHARD_FILE.match(name) or _CHUNK_TABLE.match(name) or _KEEPS.match(name)
    return match.group(1) if match else None
