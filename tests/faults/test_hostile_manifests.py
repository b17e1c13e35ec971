"""Hostile or damaged manifests: each problem is a rayckpt error naming the file and JSON path, never a traceback."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import rayckpt
from rayckpt import tools
from rayckpt.cli import commands as cli
from rayckpt.errors import CorruptCheckpointError, FormatVersionError, RayckptError
from rayckpt.format.manifest import READ_VERSIONS, decode_manifest
from rayckpt.format.manifest_schema import validator
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import read_manifest
from tests.helpers.checkpoints import manifest_of
from tests.helpers.manifest_faults import (
    assert_loads_bit_exact,
    assert_one_line_error,
    empty_like,
    run_cli,
    save_run,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Step 1 (kept intact: the previous committed checkpoint) and step 2 (the one damaged)."""
    return save_run(str(tmp_path_factory.mktemp("run")), steps=(1, 2))


@pytest.fixture
def victim(run, tmp_path):
    """A fresh copy of step 2 to damage, and its state."""
    src, state = run[2]
    path = str(tmp_path / "rayckpt-step-00000002")
    shutil.copytree(src, path)
    return path, state


def write_doc(path: str, doc) -> None:
    """Write a damaged document. The faults here damage the JSON, chunks included: a version-4
    document (its chunk table's rows inline, from ``manifest_of``) is written as version 3, the
    form that holds chunks in its JSON. Faults of version 4's chunk table: ``test_a_damaged_chunk_table...``
    below and ``tests/unit/test_manifest_files.py``."""
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(as_version_3(doc), f)


def as_version_3(doc):
    if isinstance(doc, dict) and doc.get("version") == 4:
        doc = {k: v for k, v in doc.items() if k != "chunk_table"}
        doc["version"] = 3
    return doc


def tensor_key(doc) -> str:
    """The (37, 5) float32 tensor of ``make_state``."""
    assert doc["entries"]["model.w"]["shape"] == [37, 5]
    return "model.w"


def _set(*where, value):
    def edit(doc):
        node = doc
        for p in where[:-1]:
            node = node[p(doc) if callable(p) else p]
        node[where[-1]] = value
        return doc

    return edit


def _w(doc):
    return tensor_key(doc)


# (edit of the manifest document, JSON path named in the error, what the error says)
CASES = {
    "entries a list": (_set("entries", value=[1, 2]), "entries:", "expected an object, got a list"),
    "entries a string": (_set("entries", value="model.w"), "entries:", "expected an object, got 'model.w'"),
    "dtype a list": (_set("entries", _w, "dtype", value=["float32"]), ".dtype:", "expected one of"),
    "shape not integers": (_set("entries", _w, "shape", value=[37.0, 5]), ".shape[0]:", "got 37.0"),
    "negative byte_offset": (
        _set("entries", _w, "chunks", 0, "byte_offset", value=-5),
        ".chunks[0].byte_offset:",
        "expected a non-negative integer, got -5",
    ),
    "byte_offset past int64": (
        _set("entries", _w, "chunks", 0, "byte_offset", value=2**70),
        ".chunks[0].byte_offset:",
        "below 2**63",
    ),
    "chunk a string": (_set("entries", _w, "chunks", 0, value="chunk"), ".chunks[0]:", "expected an object"),
    "checksum a float": (_set("entries", _w, "chunks", 0, "checksums", 0, value=1.5), "checksums[0]:", "got 1.5"),
    "offsets of another rank": (
        _set("entries", _w, "chunks", 0, "offsets", value=[0, 0, 0]),
        ".chunks[0].offsets:",
        "one per dimension",
    ),
    "files an object": (_set("files", value={"a": 1}), "files:", "expected a list of files"),
    "file rank a string": (_set("files", 0, "rank", value="0"), "files[0].rank:", "non-negative integer"),
    "world_size zero": (_set("world_size", value=0), "world_size:", "expected a positive integer, got 0"),
    "created NaN": (_set("created", value=float("nan")), "created:", "finite"),
    "user_metadata a list": (_set("user_metadata", value=[]), "user_metadata:", "expected an object"),
    "unknown kind": (_set("entries", _w, "kind", value="sparse"), ".kind:", "unknown kind 'sparse'"),
    "bad tagged value": (_set("entries", "step", "value", value={"__tuple__": 5}), "['step'].value:", "stored value"),
    "bad base64": (_set("entries", "step", "value", value={"__bytes__": "!!"}), "['step'].value:", "base64"),
    "path spells another key": (_set("entries", _w, "path", value=["nope"]), ".path:", "spells another key"),
    "missing field": (lambda d: d["entries"][_w(d)]["chunks"][0].pop("file") and d, ".chunks[0]:", "missing field"),
    "missing save_id": (lambda d: d.pop("save_id") and d, "", "missing field 'save_id'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_fault_is_a_corrupt_checkpoint_error_naming_file_and_field(victim, run, case):
    path, state = victim
    edit, field, what = CASES[case]
    doc = manifest_of(path)
    key = tensor_key(doc)
    write_doc(path, edit(doc))
    where = f"{path}/manifest.json: "

    with pytest.raises(CorruptCheckpointError) as info:
        read_manifest(CheckpointDir.resolve(path))
    msg = str(info.value)
    assert msg.startswith(where) and field in msg and what in msg, msg
    if field.startswith("."):
        assert f"entries[{key!r}]{field}" in msg, msg

    # Every entry point says the same, as a rayckpt error (load keeps the type, not a generic wrap).
    with pytest.raises(CorruptCheckpointError, match="manifest.json: "):
        rayckpt.load(empty_like(state), path)
    for fn in (rayckpt.inspect, rayckpt.consolidate):
        with pytest.raises(CorruptCheckpointError, match="manifest.json: "):
            fn(path)
    report = rayckpt.verify(path)
    assert not report.ok and report.problems[0].kind == "manifest" and what in report.problems[0].message

    for command in (["verify", path], ["inspect", path], ["inspect", path, "--tensor", key], ["ls", path]):
        status, out, err = run_cli(*command)
        if command[0] == "ls":  # listed, with the reason
            assert status == 0 and "corrupt" in out and not err, (out, err)
        else:
            assert status == 1, (command, out, err)
            if command[0] == "verify":
                assert "manifest" in out and what in out and "Traceback" not in out + err
            else:
                assert_one_line_error(err, "manifest.json: ", what)

    assert_loads_bit_exact(*run[1])  # the previous committed checkpoint is untouched


def _flip_middle(path: str, name: str) -> None:
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(path, name)) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize(
    "damage, what",
    [
        (lambda path, name: os.remove(os.path.join(path, name)), "names is missing"),
        (lambda path, name: os.truncate(os.path.join(path, name), 100), "bytes but the manifest recorded"),
        (_flip_middle, "the chunk table is damaged or belongs to another save"),
    ],
)
def test_a_damaged_chunk_table_is_refused_by_every_entry_point(victim, run, damage, what):
    path, state = victim
    name = manifest_of(path)["chunk_table"]["path"]
    damage(path, name)
    where = f"{path}/{name}: "
    with pytest.raises(CorruptCheckpointError) as info:
        rayckpt.load(empty_like(state), path)
    assert str(info.value).startswith(where) and what in str(info.value)
    for fn in (rayckpt.inspect, rayckpt.consolidate):
        with pytest.raises(CorruptCheckpointError, match=what):
            fn(path)
    report = rayckpt.verify(path)
    assert not report.ok and report.problems[0].kind == "manifest" and what in report.problems[0].message
    status, out, err = run_cli("inspect", path)
    assert status == 1
    assert_one_line_error(err, where, what)
    assert_loads_bit_exact(*run[1])  # the previous committed checkpoint is untouched


def test_json_nested_past_the_recursion_limit(victim):
    path, _ = victim
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write('{"format": "rayckpt", "version": 3, "user_metadata": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CorruptCheckpointError, match="nested too deeply"):
        read_manifest(CheckpointDir.resolve(path))
    status, _, err = run_cli("inspect", path)
    assert status == 1
    assert_one_line_error(err, "nested too deeply")


def test_value_nested_deeper_than_decoding_can_go(victim):
    path, state = victim
    doc = manifest_of(path)
    doc["entries"]["step"]["value"] = "DEEP"
    text = json.dumps(doc).replace('"DEEP"', "[" * 600 + "]" * 600)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write(text)
    with pytest.raises(CorruptCheckpointError, match=r"entries\['step'\]\.value: a stored value nested too deeply"):
        rayckpt.load(empty_like(state), path)


@pytest.mark.parametrize("version", [99, "3", [3], None])
def test_unknown_version_is_a_format_version_error(victim, version):
    path, state = victim
    doc = manifest_of(path)
    doc["version"] = version
    write_doc(path, doc)
    with pytest.raises(FormatVersionError, match="format version .* is not supported"):
        rayckpt.load(empty_like(state), path)


def test_cli_turns_any_other_exception_into_one_line_and_debug_shows_the_traceback(victim, monkeypatch):
    path, _ = victim

    def broken(_ckpt):
        raise TypeError("a bug")

    monkeypatch.setattr(tools, "inspect", broken)
    status, _, err = run_cli("inspect", path)
    assert status == cli.EXIT_FAILED
    assert_one_line_error(err, "internal error (TypeError: a bug)", "--debug")

    for argv in (["--debug", "inspect", path], ["inspect", path, "--debug"]):
        status, _, err = run_cli(*argv)
        assert status == cli.EXIT_FAILED
        assert "Traceback (most recent call last)" in err and "TypeError: a bug" in err
        assert err.strip().splitlines()[-1].startswith("rayckpt: error: internal error")


def test_debug_shows_the_traceback_of_a_rayckpt_error_too(victim):
    path, _ = victim
    write_doc(path, {"format": "rayckpt", "version": 3, "entries": []})
    status, _, err = run_cli("--debug", "inspect", path)
    assert status == 1 and "Traceback" in err and "CorruptCheckpointError" in err


# ---------------------------------------------------------------------------
# fuzzing: mutate a valid manifest anywhere; only rayckpt errors may come out


def _nodes(doc, path=()):
    """(path, node) for every container and leaf of the document."""
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, (*path, i))


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["float32", "../x", "/etc/passwd", "tensor", "value", "__tuple__", "__bytes__", "a\\b"]),
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
_MUTATION = st.sampled_from(["replace", "delete", "wrap", "nest", "duplicate", "empty", "scale"])


def _mutate(doc, data):
    """One mutation at one node of ``doc`` (in place)."""
    nodes = list(_nodes(doc))[1:]
    where, node = data.draw(st.sampled_from(nodes), label="node")
    parent = doc
    for p in where[:-1]:
        parent = parent[p]
    last = where[-1]
    kind = data.draw(_MUTATION, label="mutation")
    if kind == "replace":
        parent[last] = data.draw(_JSON, label="value")
    elif kind == "delete":
        del parent[last]
    elif kind == "wrap":
        parent[last] = [node]
    elif kind == "nest":  # written out by ``_text`` (json.dumps would refuse the deepest)
        parent[last] = {"__nest__": data.draw(st.sampled_from([10, 500, 990, 3000]), label="depth")}
    elif kind == "duplicate" and isinstance(node, list) and node:
        node.append(copy.deepcopy(node[0]))
    elif kind == "empty":
        parent[last] = type(node)() if isinstance(node, (list, dict, str)) else 0
    elif kind == "scale" and type(node) is int:
        parent[last] = node * data.draw(st.sampled_from([-1, 2, 2**40, 0]), label="factor")


def _text(doc) -> str:
    """The document as JSON, each ``{"__nest__": depth}`` as that many nested lists."""
    text = json.dumps(doc)
    for depth in (10, 500, 990, 3000):
        text = text.replace(json.dumps({"__nest__": depth}), "[" * depth + "]" * depth)
    return text


def _only_rayckpt_errors(fn, *args) -> str:
    """Call ``fn``; any exception but a rayckpt error fails the test. Says how it ended."""
    try:
        fn(*args)
    except RayckptError as exc:
        return type(exc).__name__
    return "ok"


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_fuzzed_manifests_raise_only_rayckpt_errors(run, victim, data):
    path, state = victim
    doc = as_version_3(manifest_of(run[2][0]))  # the intact original of the victim, its chunks in its JSON
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        _mutate(doc, data)
    text = _text(doc)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write(text)
    ckdir = CheckpointDir.resolve(path)
    event(f"read_manifest: {_only_rayckpt_errors(read_manifest, ckdir)}")  # --hypothesis-show-statistics
    _only_rayckpt_errors(rayckpt.verify, path)
    _only_rayckpt_errors(rayckpt.load, empty_like(state), path)
    _only_rayckpt_errors(rayckpt.inspect, path)
    _only_rayckpt_errors(rayckpt.consolidate, path)
    _only_rayckpt_errors(rayckpt.plan, path, 3)
    # Decoding accepts nothing the schema file refuses.
    try:
        decode_manifest(text.encode())
    except RayckptError:
        return
    doc = json.loads(text)
    problems = [error.message for error in validator().iter_errors(doc)]
    if problems:  # pragma: no cover - would be a bug
        pytest.fail(f"decoded a manifest the schema refuses: {problems[:3]}")
    assert doc["version"] in READ_VERSIONS
