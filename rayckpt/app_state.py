"""``AppState``, where the README has always shown it; it lives in ``rayckpt.engine.app_state``."""

from .engine.app_state import AppState

__all__ = ["AppState"]
