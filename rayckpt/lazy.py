"""Public names imported on first use: how ``rayckpt``, ``rayckpt.ray`` and ``rayckpt.tools`` export theirs."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module-level ``__getattr__`` and ``__dir__`` serving ``names`` on first use.

    Args:
        package: the package's ``__name__``.
        names: public name -> the (absolute) module that defines it.

    Returns:
        ``(__getattr__, __dir__)`` for the package: a name is imported from its module the
        first time it is asked for and kept in the package from then on.
    """

    def get(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def listing() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return get, listing
