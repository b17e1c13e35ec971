"""Each key's path through the nested state dict: recorded by flatten, kept by the manifest, rebuilt by nest."""

from __future__ import annotations

import json

import pytest
import torch

from rayckpt.engine.state import flatten
from rayckpt.errors import CorruptCheckpointError
from rayckpt.format.manifest import FORMAT_VERSION, Manifest, TensorEntry, ValueEntry, decode_manifest, encode_manifest
from rayckpt.format.manifest_files import manifest_file_bytes, manifest_from_bytes
from rayckpt.format.paths import DictKey, add_prefix, dcp_path, join_path, nest, strip_prefix


def test_flatten_records_each_keys_path_dict_keys_list_indices_and_other_dict_keys():
    t = torch.zeros(1)
    flat = flatten(
        {
            "model": {"layers.0.weight": t},  # one dict key with dots in it
            "optim": {"state": {0: {"exp_avg": t}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "lst": [t, {"x": t}],
            (1, "a"): t,
        }
    )
    assert flat.paths == {
        "model.layers.0.weight": ("model", "layers.0.weight"),
        "optim.state.0.exp_avg": ("optim", "state", DictKey(0), "exp_avg"),
        "optim.param_groups": ("optim", "param_groups"),  # a container without tensors is one value
        "lst.0": ("lst", 0),
        "lst.1.x": ("lst", 1, "x"),
        "(1, 'a')": (DictKey((1, "a")),),
    }
    assert all(join_path(p) == k for k, p in flat.paths.items())


def test_nest_rebuilds_dicts_lists_and_non_str_keys():
    items = [
        (("model", "layers.0.weight"), 1),
        (("optim", "state", DictKey(0), "step"), 2),
        (("optim", "state", DictKey(1), "step"), 3),
        (("lst", 1, "x"), 4),
        (("lst", 0), 5),
        (("top",), {"already": "whole"}),
    ]
    assert nest(items) == {
        "model": {"layers.0.weight": 1},
        "optim": {"state": {0: {"step": 2}, 1: {"step": 3}}},
        "lst": [5, {"x": 4}],
        "top": {"already": "whole"},
    }
    assert nest([(("a", 2), "c")]) == {"a": [None, None, "c"]}  # a selection may skip indices


@pytest.mark.parametrize(
    "items, message",
    [
        ([(("a", "b"), 1), (("a",), 2)], "key 'a' is stored twice or holds other keys"),
        ([(("a",), 1), (("a", "b"), 2)], "key 'a.b' lies under 'a', which is a value"),
        ([(("a", 0), 1), (("a", "x"), 2)], "key 'a.x': a is a list for another key"),
        ([(("a", "x"), 1), (("a", 0), 2)], "key 'a.0': a is a dict for another key"),
        ([((), 1)], "a key has an empty path"),
    ],
)
def test_nest_names_the_key_whose_path_disagrees(items, message):
    with pytest.raises(CorruptCheckpointError, match=message.replace(".", r"\.")):
        nest(items)


def test_prefixes_strip_and_add_whole_parts():
    path = ("app", "model", "layers.0.weight")
    assert strip_prefix(path, "app.model.layers.0.weight", "app.model.") == ("layers.0.weight",)
    assert strip_prefix(path, "app.model.layers.0.weight", "") == path
    # a prefix that ends inside a part leaves the rest of the key flat
    assert strip_prefix(path, "app.model.layers.0.weight", "app.model.layers.") == ("0.weight",)
    assert add_prefix("app.model.", ("layers.0.weight",)) == ("app", "model", "layers.0.weight")
    assert add_prefix("pre_", ("w", 0)) == ("pre_w", 0)
    assert join_path(add_prefix("a.b", (DictKey(3), "x"))) == "a.b3.x"
    assert dcp_path(("optim", DictKey(0), 1)) == ("optim", "0", 1)


def _manifest(entries, version: int = FORMAT_VERSION) -> Manifest:
    return Manifest(save_id="s", world_size=1, block_size=16, entries=entries, files=(), version=version)


def test_paths_round_trip_through_the_manifest():
    paths = {
        "model.layers.0.weight": ("model", "layers.0.weight"),
        "optim.state.0.step": ("optim", "state", DictKey(0), "step"),
        "odd.(1, 'a').1.5": ("odd", DictKey((1, "a")), DictKey(1.5)),
        "lst.3": ("lst", 3),
    }
    entries = {k: ValueEntry(1, p) for k, p in paths.items()}
    entries["t"] = TensorEntry("float32", (0,), (), ("t",))
    files = manifest_file_bytes(_manifest(entries))
    back = manifest_from_bytes(files)
    assert {k: back.path(k) for k in paths} == paths and back.path("t") == ("t",)
    doc = json.loads(files["manifest.json"])
    assert doc["version"] == FORMAT_VERSION
    assert doc["entries"]["optim.state.0.step"]["path"] == ["optim", "state", {"key": 0}, "step"]


def test_a_manifest_without_paths_gives_each_key_as_its_own_path():
    doc = json.loads(encode_manifest(_manifest({"a.b": ValueEntry(1, ("a", "b"))}, version=3)))
    doc["version"] = 2
    del doc["entries"]["a.b"]["path"]
    assert decode_manifest(json.dumps(doc).encode()).path("a.b") == ("a.b",)


@pytest.mark.parametrize(
    "path, message",
    [
        (["a", "c"], "key 'a.b' has path ['a', 'c'], which spells another key"),
        ("a.b", "key 'a.b' has path 'a.b', not a non-empty list"),
        ([], "key 'a.b' has path [], not a non-empty list"),
        (["a", 1.5], "key 'a.b' has a bad path part 1.5"),
        (["a", -1], "key 'a.b' has a bad path part -1"),
        (["a", True], "key 'a.b' has a bad path part True"),
        (["a", {"key": ["b"]}], "key 'a.b' has an unhashable dict key in its path"),
        (["a", {"k": "b"}], "key 'a.b' has a bad path part {'k': 'b'}"),
    ],
)
def test_a_hand_edited_path_is_refused_naming_the_key(path, message):
    files = manifest_file_bytes(_manifest({"a.b": ValueEntry(1, ("a", "b"))}))
    doc = json.loads(files["manifest.json"])
    doc["entries"]["a.b"]["path"] = path
    with pytest.raises(CorruptCheckpointError) as info:
        manifest_from_bytes({**files, "manifest.json": json.dumps(doc).encode()}, where="ck/manifest.json")
    assert str(info.value).startswith("ck/manifest.json: ") and message in str(info.value)
