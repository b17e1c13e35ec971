"""The layers stay layers: each subpackage imports only the layers below it (docs/architecture.md's layers).

Three checks: a static one over every module's import statements (function-level
imports included), with the Ray layer's own rooms (the rank side, the MetadataActor,
the ShardWriter, the memory tier) in their order; no import circle anywhere in the
package; and a run-time one that imports a whole layer in a fresh interpreter and
looks at what came with it.
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

BASE = {"errors", "redaction", "phases", "bounded", "lazy"}
#: Subpackage -> the rayckpt subpackages (and top-level modules) it may import.
ALLOWED = {
    "format": BASE | {"format"},
    "planning": BASE | {"format", "planning"},
    "storage": BASE | {"format", "storage"},
    "data": BASE | {"data"},
    "engine": BASE | {"format", "planning", "storage", "data", "engine"},
    "observe": BASE | {"observe"},
    "ray": BASE | {"format", "planning", "storage", "data", "engine", "observe", "ray"},
    "train": BASE | {"format", "planning", "storage", "data", "engine", "ray", "train"},
    "tools": BASE | {"format", "planning", "storage", "data", "engine", "tools"},
    "testing": BASE | {"format", "planning", "storage", "data", "engine", "testing"},
    "dcp": BASE | {"format", "planning", "storage", "data", "engine", "ray", "dcp"},
}
#: Subpackage -> third-party packages it must not import.
FORBIDDEN = {
    "format": {"torch", "ray"},
    "observe": {"torch", "ray"},
    "planning": {"torch", "ray", "pyarrow"},
    "storage": {"torch", "ray"},
    "data": {"ray"},
    "engine": {"ray"},
    "tools": {"ray"},
    "testing": {"ray"},
}
#: What must not come along when a lower layer is imported.
UPPER = ("ray", "rayckpt.ray", "rayckpt.train", "rayckpt.tools", "rayckpt.examples", "rayckpt.testing")


def modules_of(layer: str) -> list[str]:
    """The modules of subpackage ``layer`` ("": the whole package)."""
    root = os.path.join(PKG_DIR, layer) if layer else PKG_DIR
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


#: The Ray layer's rooms, bottom up: a module of a room may import the rooms listed for it (and its own).
#: ``shared``: what every process of the layer uses (names and lookups, the cluster to join, records, the
#: node's shared memory, metrics); ``status``: what ``rayckpt status`` shows (the snapshots the actors
#: publish, the MetadataActor's report, the operator's reader); the MetadataActor's process; the memory
#: tier's node side (held in the ShardWriter's process); the ShardWriter; the memory tier as a filesystem
#: (``memory.fs``: any process; it starts a node's writer); the rank side.
RAY_ROOMS = {
    "shared": set(),
    "status": {"shared"},
    "metadata": {"shared", "status"},
    "memory": {"shared", "status"},
    "writer": {"shared", "metadata", "memory", "status"},
    "memory_fs": {"shared", "memory", "writer"},
    "rank": {"shared", "metadata", "memory", "writer", "memory_fs"},
}
SHARED = {"actors", "records", "shm", "metrics", "joining"}


def ray_room(module: str) -> str:
    """The room of a ``rayckpt.ray`` module (the package itself: the rank side, whose names it exports)."""
    parts = module.split(".")[2:]
    if not parts:
        return "rank"
    if parts[0] in SHARED:
        return "shared"
    if parts[:2] == ["memory", "fs"]:
        return "memory_fs"
    return parts[0]


def test_the_ray_layer_s_rooms_import_only_the_rooms_below_them():
    bad = []
    for module in modules_of("ray"):
        room = ray_room(module)
        for target, line in imports_of(module):
            if target.startswith("rayckpt.ray.") or target == "rayckpt.ray":
                other = ray_room(target)
                if other != room and other not in RAY_ROOMS[room]:
                    bad.append(f"{module}:{line} ({room}) imports {target} ({other})")
    assert not bad, "\n".join(bad)


def test_the_ray_rooms_check_sees_a_violation():
    assert ray_room("rayckpt.ray.metadata.commit_tracker") == "metadata"
    assert ray_room("rayckpt.ray.memory.fs") == "memory_fs"
    assert ray_room("rayckpt.ray.shm") == "shared" and ray_room("rayckpt.ray.rank.async_save") == "rank"
    assert "writer" not in RAY_ROOMS["metadata"] and "rank" not in RAY_ROOMS["writer"]


def import_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports, statically (function-level imports
    included). Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so each module also
    depends on its parent packages, and an import of a package's name from it counts as that package."""
    modules = set(modules_of(""))
    graph: dict[str, set[str]] = {}
    for module in modules:
        deps = set()
        for target, _ in imports_of(module):
            while target and target not in modules:
                target = target.rpartition(".")[0]  # ``from pkg.mod import name``: the module
            if target.startswith("rayckpt"):
                parts = target.split(".")
                deps.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        graph[module] = {d for d in deps if d in modules and d != module and not module.startswith(d + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (its modules in order), or ``[]``."""
    done: set[str] = set()
    for root in sorted(graph):
        path: list[str] = []
        on_path: set[str] = set()
        stack = [(root, iter(sorted(graph[root])))]
        if root in done:
            continue
        path.append(root)
        on_path.add(root)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return path[path.index(child) :] + [child]
            elif child not in done:
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
                on_path.add(child)
    return []


def test_no_import_circle_anywhere_in_the_package():
    cycle = find_cycle(import_graph())
    assert not cycle, " -> ".join(cycle)


def test_the_circle_check_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    graph = import_graph()
    assert "rayckpt.engine.save" in graph["rayckpt.ray.rank.async_save"]
    assert "rayckpt.ray.memory" in graph["rayckpt.ray.writer.actor"]  # the package of a module it imports runs first


def test_the_static_check_sees_a_violation():
    # The checker itself: rayckpt.ray.rank.async_save does import the engine and ray.
    targets = {t for t, _ in imports_of("rayckpt.ray.rank.async_save")}
    assert {"ray", "rayckpt.engine.save", "rayckpt.storage.checkpoint_dir"} <= targets
    assert "rayckpt.format.manifest" in {t for t, _ in imports_of("rayckpt.storage.commit")}


IMPORT_LAYER = r"""
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("layers", [("format",), ("format", "planning"), ("storage",), ("engine",), ("observe",)])
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


#: The most lines of code (no docstring, comment or blank line) one function may have: past it, a function
#: usually does two things. Modules are sized by what they hold, not by a count.
MAX_FUNCTION_LINES = 70


def code_lines(source: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``node``'s body that hold code: its docstring, comments and blank lines not counted."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    lines = set()
    for statement in body:
        for n in range(statement.lineno, statement.end_lineno + 1):
            text = source[n - 1].strip()
            if text and not text.startswith("#"):
                lines.add(n)
    return len(lines)


def long_functions(text: str) -> list[tuple[str, int]]:
    source = text.splitlines()
    return [
        (node.name, n)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (n := code_lines(source, node)) > MAX_FUNCTION_LINES
    ]


def test_no_function_is_too_long():
    long = []
    for module in modules_of(""):
        path = os.path.join(PKG_DIR, *module.split(".")[1:])
        path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
        with open(path) as f:
            long.extend(f"{module}.{name}: {n} lines of code" for name, n in long_functions(f.read()))
    assert not long, long


def test_the_length_check_counts_code_only():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    doc = '    """A docstring\n\n    of four lines.\n    """\n    # a comment\n\n'
    assert long_functions(f"def f():\n{doc}{body}\n") == []
    assert long_functions(f"def f():\n{doc}{body}\n    return 1\n") == [("f", MAX_FUNCTION_LINES + 1)]
