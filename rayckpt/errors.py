"""The errors rayckpt raises. One root, a subclass per way a caller reacts.

Every exception here is picklable with its message intact (``__reduce__``), so it
survives crossing a Ray actor or a ``torch.distributed`` object collective. A message
never shows a location's credentials: each one is redacted (``rayckpt.redaction``).
"""

from __future__ import annotations

from .redaction import redact_text


class RayckptError(Exception):
    """Root of every error rayckpt raises on purpose."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact_text(a) if isinstance(a, str) else a for a in args))

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (str(self),))


class CheckpointNotFoundError(RayckptError):
    """No committed checkpoint (no manifest) at the given location."""


class CorruptCheckpointError(RayckptError):
    """Stored bytes or the manifest do not match what was committed."""


class IncompatibleStateError(RayckptError):
    """The state dict asked for does not fit the checkpoint (keys, shapes, dtypes)."""


class FormatVersionError(CorruptCheckpointError):
    """The manifest was written by an unknown format version."""


class RestoreFailedError(RayckptError):
    """No committed checkpoint of a run could be restored; the message names each one tried and why."""


class SaveFailedError(RayckptError):
    """A save failed on at least one rank; nothing was committed."""


class CheckpointExistsError(SaveFailedError):
    """``save(..., overwrite=False)`` found a committed checkpoint at the location; it is untouched."""


class PeerLostError(SaveFailedError):
    """A collective of a save failed (a peer rank died or stopped answering); the process group is unusable."""


class InvalidStateError(RayckptError):
    """The state dict given to ``save`` cannot be stored (type, key, placement)."""


class DataPositionError(RayckptError):
    """A data position cannot be saved or resumed: another dataset, a changed length, ranks out of step."""


#: Links of an exception's cause chain ``describe_error`` names.
_CAUSES_SHOWN = 4


def describe_error(exc: BaseException) -> str:
    """What went wrong, without the frames of a traceback: ``Type: message`` of ``exc``, then
    ``; caused by Type: message`` for each exception it was raised from (or while handling).

    A rayckpt error's message is kept as written and ends the chain (it names its cause
    itself); another one's is put on one line. At most ``_CAUSES_SHOWN`` links are named.

    Args:
        exc: The exception to describe.

    Returns:
        One string, credentials redacted.
    """
    parts: list[str] = []
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen and len(parts) < _CAUSES_SHOWN:
        seen.add(id(link))
        if isinstance(link, RayckptError):
            parts.append(f"{type(link).__name__}: {link}")
            break
        text = redact_text(" ".join(str(link).split()))
        parts.append(f"{type(link).__name__}: {text}" if text else type(link).__name__)
        link = link.__cause__ if link.__cause__ is not None or link.__suppress_context__ else link.__context__
    return "; caused by ".join(parts)
