"""``AppState`` at ``rayckpt.app_state``, the import path the README shows; defined in ``rayckpt.engine.app_state``."""

from .engine.app_state import AppState

__all__ = ["AppState"]
