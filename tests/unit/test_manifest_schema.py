"""The manifest's JSON Schema file: a valid schema, it accepts every golden manifest, refuses hostile ones
with the decoder's messages, and its compiled check (what decoding runs) agrees with jsonschema."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayckpt.errors import CorruptCheckpointError
from rayckpt.format.manifest import CHECKSUMS, DTYPES, READ_VERSIONS, decode_manifest, encode_manifest
from rayckpt.format.manifest_files import manifest_file_bytes
from rayckpt.format.manifest_schema import SCHEMA_PATH, accepts, document_definition, manifest_schema, validator
from tests.helpers import golden
from tests.unit.test_manifest import doc_of, sample_manifest


def golden_manifests() -> dict[str, dict]:
    """The golden (version-2) manifest, and a sample one in every version this rayckpt writes or reads."""
    docs = {"golden_save.json": golden.expected()["manifest"]}
    for version in (1, 2, 3):
        m = sample_manifest(version=version)
        m = replace(m, checksum="crc32") if version == 1 else m  # version 1 knows no other
        docs[f"sample version {version}"] = json.loads(encode_manifest(m))
    for version in (4, 5):
        m = sample_manifest(version=version)
        docs[f"sample version {version}"] = json.loads(manifest_file_bytes(m)["manifest.json"])
    return docs


GOLDEN = golden_manifests()


def test_the_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(manifest_schema())
    assert json.loads(SCHEMA_PATH.read_text())["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_the_published_schema_is_the_one_the_decoder_reads():
    published = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "docs", "manifest.schema.json"
    )
    assert os.path.realpath(published) == str(SCHEMA_PATH.resolve())  # one file: docs/ links to the package's


def test_the_schema_lists_what_the_code_reads():
    defs = manifest_schema()["$defs"]
    assert defs["dtype"]["enum"] == list(DTYPES)
    assert defs["checksum"]["enum"] == list(CHECKSUMS)
    assert manifest_schema()["properties"]["version"]["enum"] == list(READ_VERSIONS)


@pytest.mark.parametrize("name", list(GOLDEN))
def test_the_schema_accepts_every_golden_manifest(name):
    doc = GOLDEN[name]
    # A plain Draft 2020-12 validator (what a reader elsewhere uses), the decoder's, and its compiled check.
    assert list(jsonschema.Draft202012Validator(manifest_schema()).iter_errors(doc)) == []
    assert list(validator().iter_errors(doc)) == []
    assert accepts(doc, document_definition(doc["version"]))


def _hostile(edit):
    doc = doc_of(sample_manifest())  # version 3: its chunks in the JSON
    edit(doc)
    return doc


def _w(doc):
    return doc["entries"]["model.w"]


# A hostile document, and the start of what decoding says about it.
HOSTILE = {
    "entries a list": (lambda d: d.update(entries=[1, 2]), "entries: expected an object, got a list of 2 item(s)"),
    "dtype a list": (lambda d: _w(d).update(dtype=["float32"]), "entries['model.w'].dtype: expected one of 'float64'"),
    "shape of floats": (lambda d: _w(d).update(shape=[6.0, 4]), "entries['model.w'].shape[0]: expected a non-negative"),
    "negative byte_offset": (
        lambda d: _w(d)["chunks"][0].update(byte_offset=-5),
        "entries['model.w'].chunks[0].byte_offset: expected a non-negative integer, got -5",
    ),
    "byte_offset past int64": (
        lambda d: _w(d)["chunks"][0].update(byte_offset=2**63),
        "entries['model.w'].chunks[0].byte_offset: expected a non-negative integer below 2**63, got 922337203685",
    ),
    "checksum past uint64": (
        lambda d: _w(d)["chunks"][0]["checksums"].__setitem__(0, 2**64),
        "entries['model.w'].chunks[0].checksums[0]: expected a non-negative integer below 2**64",
    ),
    "a bool for an integer": (lambda d: d.update(block_size=True), "block_size: expected a positive integer, got True"),
    "files an object": (lambda d: d.update(files={"a": 1}), "files: expected a list of files, got an object"),
    "chunks a string": (lambda d: _w(d).update(chunks="x"), "entries['model.w'].chunks: expected a list of chunks"),
    "created NaN": (
        lambda d: d.update(created=float("nan")),
        "created: expected a finite non-negative number, got nan",
    ),
    "unknown kind": (
        lambda d: _w(d).update(kind="sparse"),
        "entries['model.w'].kind: unknown kind 'sparse' (expected 'tensor' or 'value')",
    ),
    "missing save_id": (lambda d: d.pop("save_id"), "the document: missing field 'save_id'"),
    "missing chunk file": (
        lambda d: _w(d)["chunks"][1].pop("file"),
        "entries['model.w'].chunks[1]: missing field 'file'",
    ),
    "empty file path": (lambda d: d["files"][0].update(path=""), "files[0].path: expected a non-empty string, got ''"),
    "bad path part": (lambda d: _w(d).update(path=["model", 1.5]), "entries['model.w'].path: key 'model.w' has a bad"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_schema_refuses_hostile_manifests_with_the_decoder_s_messages(case):
    edit, message = HOSTILE[case]
    doc = _hostile(edit)
    assert not accepts(doc, "version_3")
    assert not validator().is_valid(doc)
    with pytest.raises(CorruptCheckpointError) as info:
        decode_manifest(json.dumps(doc).encode(), where="c/manifest.json")
    assert str(info.value).startswith(f"c/manifest.json: {message}"), str(info.value)


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 1.0, 1.5, float("inf"), float("nan")]),
    st.sampled_from(["", "x", "float32", "tensor", "value", "crc32", "xxh3_64"]),
    # Fresh containers each draw: a shared one could end up inside itself.
    st.builds(list),
    st.builds(dict),
    st.builds(lambda: [1, 2]),
)


def _places(doc, path=()):
    """Every place in ``doc`` but its ``format`` and ``version`` (decoding checks those before the schema)."""
    if path[:1] not in (("format",), ("version",)):
        yield path
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in children:
        yield from _places(v, (*path, k))


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(list(GOLDEN)))
def test_the_compiled_check_agrees_with_jsonschema(data, name):
    doc = copy.deepcopy(GOLDEN[name])
    for _ in range(data.draw(st.integers(1, 2))):
        *parents, last = data.draw(st.sampled_from(list(_places(doc))[1:]))
        node = doc
        for p in parents:
            node = node[p]
        if isinstance(node, dict) and data.draw(st.booleans()):
            del node[last]
        else:
            node[last] = data.draw(_VALUES)
    definition = document_definition(doc["version"])
    assert accepts(doc, definition) == validator(definition).is_valid(doc)
