"""Range GETs for object storage: a load plan's ranges coalesced into fewer, larger requests. Pure.

On object storage each ranged read is one HTTP GET whose fixed cost (time to
first byte, request price) dwarfs a small transfer, so neighbouring ranges of
one file are fetched with one GET when the bytes between them are few. The
bytes in the gaps are fetched and discarded; three limits keep that bounded.
A large GET is in turn fetched as several ranged requests of at most
``GET_PART_BYTES`` run in parallel (``get_parts``): one HTTP stream is slower
than several. Local files do not use this: they read each range straight into
its target.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .load_plan import FileRead

#: Two ranges of one file merge only if at most this many bytes lie between them
#: (about what an object store transfers in one request's time to first byte).
COALESCE_GAP_BYTES = 2**20
#: A merged GET spans at most this many bytes (a single planned range longer than
#: this stays one GET of its own: ranges are never split across GETs).
MAX_GET_BYTES = 64 * 2**20
#: A GET is fetched as ranged requests of at most this many bytes, run in parallel
#: (``get_parts``), so one large range is not one HTTP stream on one thread. 8 MiB is
#: AWS's suggested size for byte-range fetches (8-16 MB): large enough that a
#: request's fixed cost stays a few percent, small enough to spread a rank's share.
GET_PART_BYTES = 8 * 2**20
#: A merged GET's discarded gap bytes stay at most this fraction of its length,
#: so coalescing never costs more than 5% extra transfer.
MAX_GAP_FRACTION = 0.05
#: Ranged requests one rank has in flight at once (a thread each; ``read_into``).
GET_CONCURRENCY = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class RangeGet:
    """One ranged GET: ``length`` bytes at ``offset`` of ``file``, covering ``reads``."""

    file: str
    offset: int
    length: int
    reads: tuple[FileRead, ...]
    #: Bytes fetched that no read covers (fetched and discarded).
    gap_bytes: int


def create_range_gets(
    reads: Iterable[FileRead],
    max_gap: int = COALESCE_GAP_BYTES,
    max_bytes: int = MAX_GET_BYTES,
    max_gap_fraction: float = MAX_GAP_FRACTION,
) -> tuple[RangeGet, ...]:
    """Coalesce ``reads`` (any order) into GETs sorted by file and offset.

    A read joins the GET before it (same file) when the gap between them is at
    most ``max_gap`` bytes, the merged GET spans at most ``max_bytes``, and its
    gap bytes stay at most ``max_gap_fraction`` of its length. Every read lies
    inside exactly one GET.
    """
    out: list[RangeGet] = []
    cur: list[FileRead] = []
    start = end = gaps = 0
    for r in sorted(reads, key=lambda r: (r.file, r.offset, r.length)):
        if cur and r.file == cur[0].file:
            gap = max(r.offset - end, 0)
            new_end = max(end, r.offset + r.length)
            if gap <= max_gap and new_end - start <= max_bytes and gaps + gap <= max_gap_fraction * (new_end - start):
                cur.append(r)
                end, gaps = new_end, gaps + gap
                continue
        if cur:
            out.append(RangeGet(file=cur[0].file, offset=start, length=end - start, reads=tuple(cur), gap_bytes=gaps))
        cur, start, end, gaps = [r], r.offset, r.offset + r.length, 0
    if cur:
        out.append(RangeGet(file=cur[0].file, offset=start, length=end - start, reads=tuple(cur), gap_bytes=gaps))
    return tuple(out)


def get_parts(get: RangeGet, part_bytes: int = GET_PART_BYTES) -> tuple[tuple[int, int], ...]:
    """The ``(offset, length)`` requests that fetch ``get``: in file order, each at most ``part_bytes``."""
    end = get.offset + get.length
    if get.length == 0:
        return ((get.offset, 0),)
    return tuple((o, min(part_bytes, end - o)) for o in range(get.offset, end, part_bytes))
