"""rayckpt: sharded PyTorch checkpoints for training on Ray, in an open Arrow format."""

from .conversions import convert
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
from .tools import consolidate, inspect, plan
from .verification import verify

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
    "consolidate",
    "convert",
    "inspect",
    "load",
    "plan",
    "read_manifest",
    "save",
    "verify",
]
__version__ = "0.1.0"
