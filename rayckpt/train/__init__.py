"""The TorchTrainer integration: ``Checkpointer`` for train loops, ``RayckptCallback`` for the controller.

Owns how a Ray Train run names, reports and resumes its checkpoints (with any
worker count). May import ``rayckpt.ray`` and everything below it, and
``ray.train``.
"""

from .callback import RayckptCallback
from .checkpointer import Checkpointer

__all__ = ["Checkpointer", "RayckptCallback"]
