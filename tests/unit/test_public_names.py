"""The public names of ``rayckpt.ray`` and ``rayckpt.train``: each resolves to the object its module defines."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os

import pytest

import rayckpt.ray
import rayckpt.train


@pytest.mark.parametrize("name", rayckpt.ray.__all__)
def test_each_ray_name_is_its_module_s_object(name):
    module = importlib.import_module(rayckpt.ray._EXPORTS[name])
    assert getattr(rayckpt.ray, name) is getattr(module, name)


def test_the_ray_exports_static_tools_see_are_the_ones_served():
    """The ``TYPE_CHECKING`` imports (what the API docs and type checkers read) name exactly ``__all__``,
    each from the module ``_EXPORTS`` serves it from."""
    with open(os.path.join(os.path.dirname(rayckpt.ray.__file__), "__init__.py")) as f:
        tree = ast.parse(f.read())
    (guarded,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    seen = {
        alias.name: importlib.util.resolve_name("." * node.level + node.module, "rayckpt.ray")
        for node in guarded.body
        for alias in node.names
    }
    assert seen == rayckpt.ray._EXPORTS
    assert sorted(rayckpt.ray.__all__) == sorted(rayckpt.ray._EXPORTS)


def test_an_unknown_ray_name_is_refused_by_name():
    with pytest.raises(AttributeError, match="module 'rayckpt.ray' has no attribute 'save_sync'"):
        rayckpt.ray.save_sync  # noqa: B018


def test_the_train_names():
    from rayckpt.train.callback import RayckptCallback
    from rayckpt.train.checkpointer import Checkpointer

    assert rayckpt.train.Checkpointer is Checkpointer and rayckpt.train.RayckptCallback is RayckptCallback


def test_no_public_ray_name_is_also_a_module_s_name():
    """A module ``rayckpt/ray/load.py`` would replace the function ``rayckpt.ray.load`` once imported."""
    here = os.path.dirname(rayckpt.ray.__file__)
    clash = [
        n
        for n in rayckpt.ray.__all__
        if os.path.exists(os.path.join(here, n + ".py")) or os.path.isdir(os.path.join(here, n))
    ]
    assert not clash, clash
