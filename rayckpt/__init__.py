"""rayckpt: sharded PyTorch checkpoints for training on Ray, in an open Arrow format."""

from .engine import LoadInfo, SaveInfo, load, read_manifest, save
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompatibleStateError,
    InvalidStateError,
    RayckptError,
    SaveFailedError,
)

__all__ = [
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "IncompatibleStateError",
    "InvalidStateError",
    "LoadInfo",
    "RayckptError",
    "SaveFailedError",
    "SaveInfo",
    "load",
    "read_manifest",
    "save",
]
__version__ = "0.1.0"
