"""Interfaces read at the call site: records of more than four fields are built by keyword, nothing in
the Ray layer (where calls cross actors) takes more than five positional parameters, and below the
public entry points no function takes more than six parameters: options travel as records."""

from __future__ import annotations

import ast
import os

import rayckpt

PKG_DIR = os.path.dirname(rayckpt.__file__)
MAX_POSITIONAL = 5
MAX_POSITIONAL_FIELDS = 4
MAX_PARAMETERS = 6
#: The public entry points that keep a keyword argument per option, for users; each builds the
#: records the layers below it take. ``path: function`` -> why it may take more than six.
ENTRY_POINTS = {
    "engine/save.py: save": "rayckpt.save, a user's call",
    "engine/load.py: load": "rayckpt.load, a user's call",
    "ray/rank/async_save.py: save_async": "rayckpt.ray.save_async, a user's call",
    "ray/rank/loading.py: load": "rayckpt.ray.load, a user's call",
    "train/checkpointer.py: __init__": "Checkpointer(...), a user's call",
    "data/sampler.py: __init__": "ResumableSampler(...), a user's call in place of DistributedSampler's",
    "dcp/writer.py: __init__": "rayckpt.dcp.StorageWriter(...), a user's call in place of FileSystemWriter's",
    "tools/convert/core.py: convert": "rayckpt.tools.convert.convert, a user's call (and rayckpt convert's)",
}


def trees(root: str):
    for dirpath, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    yield os.path.relpath(path, PKG_DIR), ast.parse(f.read())


def wide_functions(tree: ast.AST) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if len(names) > MAX_POSITIONAL:
                out.append((node.name, len(names)))
    return out


def crowded_functions(tree: ast.AST) -> list[tuple[str, int]]:
    """Functions taking more than ``MAX_PARAMETERS`` parameters, positional and keyword-only (self, cls
    and ``*args`` / ``**kwargs`` not counted)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            if len(names) > MAX_PARAMETERS:
                out.append((node.name, len(names)))
    return out


def positional_records(tree: ast.AST) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if not any(d.startswith(("dataclass", "dataclasses.dataclass")) for d in decorators):
            continue
        fields = [n for n in node.body if isinstance(n, ast.AnnAssign) and "ClassVar" not in ast.unparse(n.annotation)]
        if len(fields) > MAX_POSITIONAL_FIELDS and not any("kw_only=True" in d for d in decorators):
            out.append((node.name, len(fields)))
    return out


def test_no_ray_layer_function_takes_more_than_five_positional_parameters():
    wide = [
        f"{path}: {name} ({n})"
        for path, tree in trees(os.path.join(PKG_DIR, "ray"))
        for name, n in wide_functions(tree)
    ]
    assert not wide, wide


def test_below_the_public_entry_points_no_function_takes_more_than_six_parameters():
    crowded = [f"{path}: {name}" for path, tree in trees(PKG_DIR) for name, _ in crowded_functions(tree)]
    assert sorted(set(crowded) - set(ENTRY_POINTS)) == []
    assert sorted(set(ENTRY_POINTS) - set(crowded)) == []  # an entry point that no longer needs its place


def test_every_record_of_more_than_four_fields_is_keyword_only():
    found = [f"{path}: {name} ({n} fields)" for path, tree in trees(PKG_DIR) for name, n in positional_records(tree)]
    assert not found, found


def test_the_checks_see_a_wide_function_and_a_positional_record():
    tree = ast.parse(
        "def f(self, a, b, c, d, e, g): pass\n"
        "def ok(self, a, b, c, d, e, *, g): pass\n"
        "@dataclass(frozen=True)\nclass R:\n    a: int\n    b: int\n    c: int\n    d: int\n    e: int\n"
        "@dataclass(frozen=True, kw_only=True)\nclass K:\n    a: int\n    b: int\n    c: int\n    d: int\n    e: int\n"
    )
    assert wide_functions(tree) == [("f", 6)]
    assert positional_records(tree) == [("R", 5)]


def test_the_parameter_check_sees_a_function_of_seven():
    tree = ast.parse(
        "def seven(a, b, c, d, e, f, *, g): pass\n"
        "def six(self, a, b, c, d, *args, e, f, **kwargs): pass\n"
        "class C:\n    def method(self, a, b, c, d, e, f, g): pass\n"
    )
    assert crowded_functions(tree) == [("seven", 7), ("method", 7)]
