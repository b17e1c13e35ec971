"""Pure unit tests for rayckpt.manifest: JSON encode/decode, values, validation."""

from __future__ import annotations

import gc
import io
import json
import math
import pickle

import pytest

import rayckpt.format.manifest as manifest_module
from rayckpt.errors import CorruptCheckpointError, FormatVersionError, InvalidStateError, RayckptError
from rayckpt.format.boxes import Box
from rayckpt.format.manifest import (
    READ_VERSIONS,
    ChunkEntry,
    FileEntry,
    Manifest,
    TensorEntry,
    ValueEntry,
    decode_manifest,
    encode_manifest,
    itemsize,
)
from rayckpt.format.manifest_checks import find_manifest_problems
from rayckpt.format.values import decode_value, encode_value


def B(offsets, sizes) -> Box:
    return Box(tuple(offsets), tuple(sizes))


def sample_manifest(block_size: int = 32, version: int = 3) -> Manifest:
    """(6, 4) float32 saved dim-0 by 2 ranks, a bfloat16 vector, a 0-dim step, and values.

    Version 3 by default: these tests are about the JSON with its chunks inline
    (version 4's chunk table: ``test_manifest_files.py``).
    """

    def chunk(box, file, off, isz):
        n = box.volume * isz
        return ChunkEntry(
            box=box, file=file, byte_offset=off, byte_length=n, checksums=tuple(range(100, 100 + -(-n // block_size)))
        )

    w0 = chunk(B((0, 0), (3, 4)), "shard-0.arrow", 64, 4)
    w1 = chunk(B((3, 0), (3, 4)), "shard-1.arrow", 64, 4)
    b0 = chunk(B((0,), (5,)), "shard-0.arrow", 112, 2)
    step = chunk(Box((), ()), "shard-1.arrow", 112, 8)
    return Manifest(
        save_id="step-000100",
        world_size=2,
        block_size=block_size,
        entries={
            "model.w": TensorEntry("float32", (6, 4), (w0, w1)),
            "model.b": TensorEntry("bfloat16", (5,), (b0,)),
            "optim.step": TensorEntry("int64", (), (step,)),
            "optim.lr": ValueEntry(encode_value(0.001, "optim.lr")),
            "extra": ValueEntry(encode_value({"epoch": 3, 2: (1, "a"), "loss": float("inf")}, "extra")),
        },
        files=(FileEntry("shard-0.arrow", 256, 0), FileEntry("shard-1.arrow", 256, 1)),
        created=1700000000.25,
        version=version,
        user_metadata={"step": 100, "run": "demo", "metrics": {"loss": 1.5}},
    )


def doc_of(m: Manifest) -> dict:
    return json.loads(encode_manifest(m))


def raw(doc: dict) -> bytes:
    return json.dumps(doc).encode()


# ---------------------------------------------------------------------------
# Round trip


def test_manifest_round_trip_exact():
    m = sample_manifest()
    data = encode_manifest(m)
    back = decode_manifest(data)
    assert back == m
    assert back.version == 3
    assert back.entries["model.w"].chunks[1].box == B((3, 0), (3, 4))
    assert back.entries["optim.step"].chunks[0].box == Box((), ())
    assert back.tensor("model.b").dtype == "bfloat16"
    assert back.total_bytes == 512
    # stable: encoding the decoded manifest gives the same bytes
    assert encode_manifest(back) == data
    # and it is plain JSON with the documented top-level fields
    doc = json.loads(data)
    assert doc["format"] == "rayckpt"
    assert doc["version"] == 3
    assert doc["checksum"] == "xxh3_64"
    assert doc["entries"]["model.w"]["kind"] == "tensor"
    assert doc["entries"]["model.w"]["chunks"][0]["checksums"] == list(m.entries["model.w"].chunks[0].checksums)
    assert doc["entries"]["optim.lr"] == {"kind": "value", "value": 0.001}


def test_manifest_tensor_lookup():
    m = sample_manifest()
    assert m.tensor("model.w").shape == (6, 4)
    with pytest.raises(KeyError):
        m.tensor("optim.lr")  # a value, not a tensor
    with pytest.raises(KeyError):
        m.tensor("nope")


def same(a, b) -> bool:
    """Equal in value and in type, recursively; nan equals nan."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k1, k2) and same(a[k1], b[k2]) for k1, k2 in zip(a, b))
    if isinstance(a, io.BytesIO):
        return a.getvalue() == b.getvalue() and b.tell() == 0
    return a == b


VALUES = [
    None,
    True,
    False,
    0,
    -7,
    2**70,
    1.5,
    -0.0,
    float("inf"),
    float("-inf"),
    float("nan"),
    "",
    'text with "quotes" and unicode \u00e9',
    (),
    (1, 2.5, "x"),
    ((1, 2), (3, (4,))),
    [],
    [[1, [2, (3,)]], [], [None, True]],
    {},
    {"a": 1, "b": [1, 2]},
    {1: "one", 2: "two"},
    {(1, 2): [3, 4], "s": (5,)},
    {True: 1, None: 2, 1.5: 3},
    {"__tuple__": 1},  # a str key that looks like a tag
    {"__float__": "nan", "x": {"__dict__": []}},
    {"nested": {3: {"deep": (float("nan"), float("inf"))}}},
    [1, True, 1.0],  # bool and float must not collapse into int
    b"",
    bytes(range(256)),  # every byte value, base64 in the JSON
    bytearray(b"\x00rng"),
    io.BytesIO(b"torch.save output"),
    {"losses": io.BytesIO(), "rng": [b"\xff" * 3, (b"a",)]},
    {"__bytes__": "not a tag here"},  # a str key that looks like the bytes tag
]


@pytest.mark.parametrize("value", VALUES, ids=[repr(v)[:40] for v in VALUES])
def test_value_round_trip_exact(value):
    encoded = encode_value(value, "k")
    # JSON only, no NaN/Infinity literals (strict JSON readers reject them)
    text = json.dumps(encoded, allow_nan=False)
    assert same(decode_value(json.loads(text)), value)


def test_values_round_trip_through_manifest():
    entries = {f"v{i}": ValueEntry(encode_value(v, f"v{i}")) for i, v in enumerate(VALUES)}
    m = Manifest(save_id="s", world_size=1, block_size=16, entries=entries, files=(), version=3)
    back = decode_manifest(encode_manifest(m))
    for i, v in enumerate(VALUES):
        assert same(decode_value(back.entries[f"v{i}"].value), v)


@pytest.mark.parametrize(
    "bad, where, type_name",
    [
        (object(), "'optim.param_groups'", "object"),
        ({1, 2}, "'optim.param_groups'", "set"),
        (memoryview(b"bytes"), "'optim.param_groups'", "memoryview"),
        # nested values name the path down to the bad element
        ([1, object()], "'optim.param_groups.1'", "object"),
        ({"a": (1, 2j)}, "'optim.param_groups.a.1'", "complex"),
    ],
)
def test_encode_value_rejects_unsupported(bad, where, type_name):
    with pytest.raises(InvalidStateError) as info:
        encode_value(bad, "optim.param_groups")
    msg = str(info.value)
    assert f"key {where}" in msg
    assert f"type {type_name}," in msg
    assert "pickle-free" in msg


def test_encode_value_names_type():
    with pytest.raises(InvalidStateError, match="type object"):
        encode_value({"a": [object()]}, "x")


def test_itemsize():
    assert itemsize("float32") == 4
    assert itemsize("bfloat16") == 2
    assert itemsize("int64") == 8
    with pytest.raises(InvalidStateError, match="'complex128'"):
        itemsize("complex128")


# ---------------------------------------------------------------------------
# Decode errors


def test_decode_not_json():
    with pytest.raises(CorruptCheckpointError, match=r"^ckpt/manifest\.json: not valid JSON"):
        decode_manifest(b"{not json", where="ckpt/manifest.json")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        decode_manifest(b"\xff\xfe\xfa")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        decode_manifest(b"")


@pytest.mark.parametrize("doc", [[], "rayckpt", {"format": "dcp", "version": 1}, {"version": 1}])
def test_decode_wrong_format(doc):
    with pytest.raises(CorruptCheckpointError, match="not a rayckpt manifest") as info:
        decode_manifest(raw(doc))
    assert not isinstance(info.value, FormatVersionError)


def test_version_1_manifest_reads_as_crc32_and_encodes_back_unchanged():
    doc = doc_of(sample_manifest())
    doc["version"] = 1
    del doc["checksum"]  # version 1 may lack it: its checksums are always CRC-32
    for entry in doc["entries"].values():
        for c in entry.get("chunks", []):
            c["crc32"] = c.pop("checksums")
    m = decode_manifest(raw(doc))
    assert (m.version, m.checksum, m.blocks.checksum) == (1, "crc32", "crc32")
    assert m.tensor("model.w").chunks[0].checksums == sample_manifest().tensor("model.w").chunks[0].checksums
    again = doc_of(m)
    assert again["version"] == 1 and again["checksum"] == "crc32"
    assert "crc32" in again["entries"]["model.w"]["chunks"][0]
    assert "checksums" not in again["entries"]["model.w"]["chunks"][0]


@pytest.mark.parametrize(("version", "checksum"), [(2, "md5"), (2, None), (1, "xxh3_64")])
def test_unknown_or_mismatched_checksum_is_refused(version, checksum):
    doc = doc_of(sample_manifest())
    doc["version"], doc["checksum"] = version, checksum
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"m.json: checksum {checksum!r} is not supported by format "
        rf"version {version} \(known: xxh3_64, crc32\)",
    ):
        decode_manifest(raw(doc), where="m.json")


@pytest.mark.parametrize("version", [max(READ_VERSIONS) + 1, 0, 999, "1", None])
def test_decode_unknown_version(version):
    doc = doc_of(sample_manifest())
    if version is None:
        del doc["version"]
    else:
        doc["version"] = version
    with pytest.raises(FormatVersionError) as info:
        decode_manifest(raw(doc), where="gs://bucket/c/manifest.json")
    msg = str(info.value)
    assert msg.startswith("gs://bucket/c/manifest.json")
    assert f"format version {version!r}" in msg
    assert "upgrade rayckpt" in msg
    # callers that handle corrupt checkpoints also catch this
    assert isinstance(info.value, CorruptCheckpointError)


@pytest.mark.parametrize(
    "path",
    ["../x.arrow", "../../etc/passwd", "a/../../x.arrow", "..", "/etc/passwd", "\\\\server\\x", "C:x", "a\\..\\..\\x"],
)
@pytest.mark.parametrize("where", ["files", "chunk"])
def test_decode_path_escapes(path, where):
    doc = doc_of(sample_manifest())
    if where == "files":
        doc["files"][0]["path"] = path
    else:
        doc["entries"]["model.w"]["chunks"][0]["file"] = path
    with pytest.raises(CorruptCheckpointError, match="escapes the checkpoint directory") as info:
        decode_manifest(raw(doc))
    assert repr(path) in str(info.value)


@pytest.mark.parametrize("path", ["", None, 3])
def test_decode_path_not_string(path):
    doc = doc_of(sample_manifest())
    doc["files"][1]["path"] = path
    with pytest.raises(CorruptCheckpointError, match=r"files\[1\]\.path: expected a non-empty string"):
        decode_manifest(raw(doc))


def test_decode_normalizes_paths():
    doc = doc_of(sample_manifest())
    doc["files"][0]["path"] = "./sub/../shard-0.arrow"
    m = decode_manifest(raw(doc))
    assert m.files[0].path == "shard-0.arrow"
    assert m.entries["model.w"].chunks[0].file == "shard-0.arrow"


def test_decode_chunk_file_not_listed():
    doc = doc_of(sample_manifest())
    doc["entries"]["model.b"]["chunks"][0]["file"] = "shard-9.arrow"
    with pytest.raises(CorruptCheckpointError) as info:
        decode_manifest(raw(doc))
    msg = str(info.value)
    assert "'model.b'" in msg
    assert "'shard-9.arrow'" in msg
    assert "missing from 'files'" in msg


def test_decode_unknown_kind():
    doc = doc_of(sample_manifest())
    doc["entries"]["model.b"]["kind"] = "sparse"
    with pytest.raises(CorruptCheckpointError, match=r"entries\['model.b'\]\.kind: unknown kind 'sparse'"):
        decode_manifest(raw(doc))


def _drop(path):
    def edit(doc):
        *parents, last = path
        node = doc
        for p in parents:
            node = node[p]
        del node[last]

    return edit


def _set(path, value):
    def edit(doc):
        *parents, last = path
        node = doc
        for p in parents:
            node = node[p]
        node[last] = value

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (_drop(["save_id"]), "the document: missing field 'save_id'"),
        (_drop(["files"]), "the document: missing field 'files'"),
        (_drop(["entries"]), "the document: missing field 'entries'"),
        (_drop(["block_size"]), "the document: missing field 'block_size'"),
        (_drop(["files", 0, "size"]), "files[0]: missing field 'size'"),
        (_drop(["entries", "model.w", "kind"]), "entries['model.w']: missing field 'kind'"),
        (_drop(["entries", "model.w", "shape"]), "entries['model.w']: missing field 'shape'"),
        (_drop(["entries", "optim.lr", "value"]), "entries['optim.lr']: missing field 'value'"),
        (_drop(["entries", "model.w", "chunks", 1, "byte_offset"]), "entries['model.w'].chunks[1]: missing field"),
        (_drop(["entries", "model.w", "chunks", 0, "checksums"]), "entries['model.w'].chunks[0]: missing field"),
        (_set(["files"], 7), "files: expected a list of files, got 7"),
        (_set(["world_size"], "many"), "world_size: expected a positive integer, got 'many'"),
        (_set(["block_size"], 0), "block_size: expected a positive integer, got 0"),
        (
            _set(["entries", "model.w", "chunks", 0, "offsets"], [0]),
            "entries['model.w'].chunks[0].offsets: expected 2 integer(s), one per dimension of the shape [6, 4], got 1",
        ),
        (
            _set(["entries", "model.w", "chunks", 0, "offsets"], [-1, 0]),
            "entries['model.w'].chunks[0].offsets[0]: expected a non-negative integer, got -1",
        ),
        (
            _set(["entries", "model.w", "chunks", 1, "byte_offset"], -16),
            "entries['model.w'].chunks[1].byte_offset: expected a non-negative integer, got -16",
        ),
    ],
)
def test_decode_malformed_names_the_json_path(edit, message):
    doc = doc_of(sample_manifest())
    edit(doc)
    with pytest.raises(CorruptCheckpointError) as info:
        decode_manifest(raw(doc), where="c/manifest.json")
    assert str(info.value).startswith(f"c/manifest.json: {message}"), str(info.value)


def test_errors_survive_pickling():
    with pytest.raises(FormatVersionError) as info:
        decode_manifest(raw({"format": "rayckpt", "version": 7}))
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is FormatVersionError
    assert str(back) == str(info.value)
    assert isinstance(back, RayckptError)


# ---------------------------------------------------------------------------
# find_manifest_problems


def with_chunks(m: Manifest, key: str, *chunks: ChunkEntry) -> Manifest:
    e = m.entries[key]
    entries = dict(m.entries)
    entries[key] = TensorEntry(e.dtype, e.shape, tuple(chunks))
    return Manifest(
        save_id=m.save_id,
        world_size=m.world_size,
        block_size=m.block_size,
        entries=entries,
        files=m.files,
        created=m.created,
        version=m.version,
        user_metadata=m.user_metadata,
    )


def replace_chunk(c: ChunkEntry, **kw) -> ChunkEntry:
    fields = {"box": c.box, "file": c.file, "byte_offset": c.byte_offset, "byte_length": c.byte_length}
    fields["checksums"] = c.checksums
    fields.update(kw)
    return ChunkEntry(**fields)


def test_valid_manifest_has_no_problems():
    assert find_manifest_problems(sample_manifest()) == []
    # block size that does not divide the chunk: last block partial
    assert find_manifest_problems(sample_manifest(block_size=20)) == []
    # block larger than every chunk: one checksum per chunk
    m = sample_manifest(block_size=4096)
    assert all(len(c.checksums) == 1 for e in m.entries.values() if isinstance(e, TensorEntry) for c in e.chunks)
    assert find_manifest_problems(m) == []


def test_problem_wrong_byte_length():
    m = sample_manifest()
    w0, w1 = m.entries["model.w"].chunks
    bad = with_chunks(m, "model.w", replace_chunk(w0, byte_length=40, checksums=(1, 2)), w1)
    problems = find_manifest_problems(bad)
    assert problems == ["key 'model.w' chunk [0, 0] in file 'shard-0.arrow': byte_length 40 != 12 elements x 4 bytes"]


def test_problem_wrong_checksum_count():
    m = sample_manifest()
    w0, w1 = m.entries["model.w"].chunks
    assert len(w1.checksums) == 2  # 48 bytes in blocks of 32
    bad = with_chunks(m, "model.w", w0, replace_chunk(w1, checksums=(7,)))
    problems = find_manifest_problems(bad)
    assert problems == ["key 'model.w' chunk [3, 0] in file 'shard-1.arrow': 1 checksums for 2 blocks"]


def test_problem_chunk_past_file_size():
    m = sample_manifest()
    w0, w1 = m.entries["model.w"].chunks
    bad = with_chunks(m, "model.w", w0, replace_chunk(w1, byte_offset=220))
    problems = find_manifest_problems(bad)
    assert len(problems) == 1
    assert "key 'model.w' chunk [3, 0] in file 'shard-1.arrow'" in problems[0]
    assert "[220, 268)" in problems[0]
    assert "recorded size 256" in problems[0]
    # a chunk ending exactly at the file's end is fine
    assert find_manifest_problems(with_chunks(m, "model.w", w0, replace_chunk(w1, byte_offset=208))) == []


def test_problem_overlapping_chunks():
    m = sample_manifest()
    w0, w1 = m.entries["model.w"].chunks
    over = replace_chunk(w1, box=B((2, 0), (3, 4)))
    problems = find_manifest_problems(with_chunks(m, "model.w", w0, over))
    assert len(problems) == 1
    assert problems[0].startswith("key 'model.w': ")
    assert "overlap" in problems[0]


def test_problem_gap():
    m = sample_manifest()
    w0, _ = m.entries["model.w"].chunks
    problems = find_manifest_problems(with_chunks(m, "model.w", w0))
    assert problems == ["key 'model.w': chunks cover 12 of 24 elements: a gap"]


def test_problem_unknown_dtype_and_several_at_once():
    m = sample_manifest()
    entries = dict(m.entries)
    entries["model.b"] = TensorEntry("float128", (5,), m.entries["model.b"].chunks)
    w0, w1 = m.entries["model.w"].chunks
    entries["model.w"] = TensorEntry("float32", (6, 4), (replace_chunk(w0, checksums=()), w1))
    bad = Manifest(save_id=m.save_id, world_size=m.world_size, block_size=m.block_size, entries=entries, files=m.files)
    problems = find_manifest_problems(bad)
    assert len(problems) == 2
    assert "key 'model.b': unknown dtype 'float128'" in problems
    assert any("0 checksums for 2 blocks" in p for p in problems)


def test_zero_block_size_is_reported():
    doc = doc_of(sample_manifest())
    doc["block_size"] = 0
    try:
        m = decode_manifest(raw(doc))
    except CorruptCheckpointError as exc:
        assert "block_size" in str(exc)
        return
    problems = find_manifest_problems(m)
    assert any("block_size" in p or "block size" in p for p in problems), problems


def test_negative_byte_offset_is_reported():
    m = sample_manifest()
    w0, w1 = m.entries["model.w"].chunks
    problems = find_manifest_problems(with_chunks(m, "model.w", w0, replace_chunk(w1, byte_offset=-16)))
    assert any("-16" in p for p in problems), problems


def test_boolean_version_is_not_version_one():
    doc = doc_of(sample_manifest())
    doc["version"] = True
    with pytest.raises(FormatVersionError, match="format version True"):
        decode_manifest(raw(doc))


@pytest.mark.parametrize("field", ["offsets", "sizes", "checksums"])
def test_non_integer_chunk_lists_are_corrupt(field):
    doc = doc_of(sample_manifest())
    chunk = doc["entries"]["model.w"]["chunks"][0]
    chunk[field] = ["abc"] + chunk[field][1:]
    with pytest.raises(
        CorruptCheckpointError, match=rf"entries\['model.w'\]\.chunks\[0\]\.{field}\[0\]: expected .*, got 'abc'"
    ):
        decode_manifest(raw(doc))


def test_decode_pauses_the_garbage_collector_and_restores_its_state():
    data = encode_manifest(sample_manifest())
    seen = []
    real = manifest_module._decode

    def spy(d, where, table):
        seen.append(gc.isenabled())
        return real(d, where, table)

    manifest_module._decode = spy
    try:
        assert gc.isenabled() and decode_manifest(data) == sample_manifest()
        assert seen == [False] and gc.isenabled()
        with pytest.raises(CorruptCheckpointError):
            decode_manifest(b"{")
        assert gc.isenabled()  # restored on errors too
        gc.disable()
        decode_manifest(data)
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()
        manifest_module._decode = real
