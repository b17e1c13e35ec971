"""The layers stay layers: each subpackage imports only the layers below it (DESIGN.md's parts table).

Two checks: a static one over every module's import statements (function-level
imports included), and a run-time one that imports a whole layer in a fresh
interpreter and looks at what came with it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

import rayckpt

PKG_DIR = os.path.dirname(rayckpt.__file__)

BASE = {"errors", "redaction", "phases"}
#: Subpackage -> the rayckpt subpackages (and top-level modules) it may import.
ALLOWED = {
    "format": BASE | {"format"},
    "planning": BASE | {"format", "planning"},
    "storage": BASE | {"format", "storage"},
    "engine": BASE | {"format", "planning", "storage", "engine"},
    "ray": BASE | {"format", "planning", "storage", "engine", "ray"},
    "train": BASE | {"format", "planning", "storage", "engine", "ray", "train"},
    "tools": BASE | {"format", "planning", "storage", "engine", "tools"},
    "testing": BASE | {"format", "planning", "storage", "engine", "testing"},
}
#: Subpackage -> third-party packages it must not import.
FORBIDDEN = {
    "format": {"torch", "ray"},
    "planning": {"torch", "ray", "pyarrow"},
    "storage": {"torch", "ray"},
    "engine": {"ray"},
    "tools": {"ray"},
    "testing": {"ray"},
}
#: What must not come along when a lower layer is imported.
UPPER = ("ray", "rayckpt.ray", "rayckpt.train", "rayckpt.tools", "rayckpt.examples", "rayckpt.testing")


def modules_of(layer: str) -> list[str]:
    root = os.path.join(PKG_DIR, layer)
    found = []
    for dirpath, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), PKG_DIR)[:-3].replace(os.sep, ".")
                found.append("rayckpt." + rel.removesuffix(".__init__"))
    return sorted(found)


def imports_of(module: str) -> list[tuple[str, int]]:
    """(absolute module imported, line) for every import statement in ``module``."""
    is_pkg = os.path.exists(os.path.join(PKG_DIR, *module.split(".")[1:], "__init__.py"))
    path = os.path.join(PKG_DIR, *module.split(".")[1:], "__init__.py") if is_pkg else None
    path = path or os.path.join(PKG_DIR, *module.split(".")[1:]) + ".py"
    package = module.split(".") if is_pkg else module.split(".")[:-1]
    with open(path) as f:
        tree = ast.parse(f.read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if not node.module:  # from . import x: each x is a module of ``target``
                    out.extend((f"{target}.{alias.name}", node.lineno) for alias in node.names)
                    continue
                out.append((target, node.lineno))
            else:
                out.append((node.module, node.lineno))
    return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(layer):
    bad = []
    for module in modules_of(layer):
        for target, line in imports_of(module):
            parts = target.split(".")
            if parts[0] == "rayckpt":
                if len(parts) > 1 and parts[1] not in ALLOWED[layer]:
                    bad.append(f"{module}:{line} imports {target}")
            elif parts[0] in FORBIDDEN.get(layer, ()):
                bad.append(f"{module}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_the_static_check_sees_a_violation():
    # The checker itself: rayckpt.ray.async_save does import the engine and ray.
    targets = {t for t, _ in imports_of("rayckpt.ray.async_save")}
    assert {"ray", "rayckpt.engine.save", "rayckpt.storage.checkpoint_dir"} <= targets
    assert "rayckpt.format.manifest" in {t for t, _ in imports_of("rayckpt.storage.commit")}


IMPORT_LAYER = r"""
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("layers", [("format",), ("format", "planning"), ("storage",), ("engine",)])
def test_lower_layers_import_neither_ray_nor_the_layers_above(layers):
    modules = [m for layer in layers for m in modules_of(layer)]
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_LAYER, json.dumps(modules)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert set(modules) <= set(loaded)
    upper = sorted(m for m in loaded if any(m == u or m.startswith(u + ".") for u in UPPER))
    assert not upper, upper
    if "engine" not in layers:
        assert "torch" not in loaded


def test_the_run_time_check_sees_ray_come_in_with_the_ray_layer():
    modules = modules_of("ray")
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_LAYER, json.dumps(modules)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "ray" in json.loads(proc.stdout)


def test_no_module_is_too_long():
    # STYLE.md: a file past ~450 lines usually holds two concepts.
    long = []
    for dirpath, _, files in os.walk(PKG_DIR):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name)) as f:
                    n = sum(1 for _ in f)
                if n > 450:
                    long.append(f"{os.path.relpath(os.path.join(dirpath, name), PKG_DIR)}: {n} lines")
    assert not long, long
