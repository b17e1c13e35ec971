"""Format version 4: ``manifest.json`` plus its chunk table (an Arrow IPC file), written, read and refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest
import torch
import xxhash

import rayckpt
from rayckpt.errors import CorruptCheckpointError, InvalidStateError, SaveFailedError
from rayckpt.format import chunk_columns, manifest_files
from rayckpt.format.boxes import Box
from rayckpt.format.chunk_columns import ChunkColumns
from rayckpt.format.chunk_rows import ChunkRows
from rayckpt.format.manifest import (
    FORMAT_VERSION,
    ChunkEntry,
    FileEntry,
    chunk_table_name,
    decode_manifest,
    encode_manifest,
)
from rayckpt.format.manifest_checks import find_manifest_problems
from rayckpt.format.manifest_files import (
    TABLE_SCHEMA,
    encode_manifest_files,
    manifest_file_bytes,
    manifest_from_bytes,
)
from rayckpt.format.shard_file import WrittenChunk
from rayckpt.planning.chunk_table import ChunkTable
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import SaveSpec, WrittenShard, create_manifest, read_manifest, shard_file_save_id
from tests.unit.test_manifest import sample_manifest

TABLE = chunk_table_name("step-000100")


@pytest.fixture
def files() -> dict[str, bytes]:
    return manifest_file_bytes(sample_manifest(version=FORMAT_VERSION))


def test_version_4_writes_the_chunk_table_first_and_names_it_with_size_rows_and_digest():
    m = sample_manifest(version=FORMAT_VERSION)
    (table_name, table), (json_name, data) = encode_manifest_files(m)
    assert (table_name, json_name) == (TABLE, "manifest.json") == ("step-000100-chunks.arrow", "manifest.json")
    doc = json.loads(data)
    assert doc["version"] == 4
    assert doc["chunk_table"] == {
        "path": TABLE,
        "size": len(table),
        "rows": 4,
        "xxh3_64": xxhash.xxh3_64_intdigest(table),
    }
    # The JSON keeps each tensor's dtype, shape and path, and no chunk.
    assert doc["entries"]["model.w"] == {"kind": "tensor", "dtype": "float32", "shape": [6, 4]}
    assert all("chunks" not in e for e in doc["entries"].values())
    assert doc["entries"]["optim.lr"] == {"kind": "value", "value": 0.001}


def test_the_chunk_table_is_plain_arrow_one_row_per_chunk(files):
    reader = pa.ipc.open_file(pa.BufferReader(files[TABLE]))
    assert reader.schema.metadata[b"rayckpt.save_id"] == b"step-000100"
    rows = reader.read_all().to_pylist()
    m = sample_manifest(version=FORMAT_VERSION)
    w1 = m.tensor("model.w").chunks[1]
    assert [r["key"] for r in rows] == [0, 0, 1, 2]  # model.w twice, model.b, optim.step
    assert rows[1] == {
        "key": 0,
        "file": 1,
        "byte_offset": w1.byte_offset,
        "byte_length": w1.byte_length,
        "offsets": [3, 0],
        "sizes": [3, 4],
        "checksums": list(w1.checksums),
    }
    assert rows[3]["offsets"] == rows[3]["sizes"] == []  # the 0-dim step


def test_round_trip_gives_the_same_manifest_and_bytes(files):
    back = manifest_from_bytes(files)
    assert back == sample_manifest(version=FORMAT_VERSION)
    assert back.chunk_table == TABLE and back.table_files == (TABLE,)
    assert manifest_file_bytes(back) == files  # stable: a read manifest writes the same bytes
    assert find_manifest_problems(back) == []


def test_chunks_are_rows_built_only_when_asked(files, monkeypatch):
    built = []
    real = ChunkColumns.chunk
    monkeypatch.setattr(chunk_columns.ChunkColumns, "chunk", lambda self, row: built.append(row) or real(self, row))
    m = manifest_from_bytes(files)
    assert find_manifest_problems(m) == [] and ChunkTable.from_manifest(m).num_chunks == 4
    assert ChunkColumns.from_manifest(m) is m.columns
    assert built == []  # decoding, validating and the bulk planner's table build no chunk object
    rows = m.tensor("model.w").chunks
    assert isinstance(rows, ChunkRows) and len(rows) == 2 and built == []
    want = sample_manifest(version=FORMAT_VERSION).tensor("model.w").chunks
    assert rows[-1] == want[1] and built == [1]
    assert rows[0:2] == want and list(rows) == list(want) and hash(rows) == hash(want)
    with pytest.raises(IndexError):
        rows[2]


def test_version_4_needs_its_table_on_both_sides():
    m = sample_manifest(version=FORMAT_VERSION)
    with pytest.raises(InvalidStateError, match="encode it with manifest_files.encode_manifest_files"):
        encode_manifest(m)
    data = manifest_file_bytes(m)["manifest.json"]
    with pytest.raises(InvalidStateError, match="read it with manifest_files.decode_manifest_files"):
        decode_manifest(data)


# ---------------------------------------------------------------------------
# A damaged or hostile chunk table is refused, naming the file and the row


def retable(files: dict[str, bytes], table: pa.Table | bytes, **ref) -> dict[str, bytes]:
    """``files`` with another chunk table, the JSON's reference made to match it (or ``ref``'s values)."""
    doc = json.loads(files["manifest.json"])
    if isinstance(table, pa.Table):
        doc["chunk_table"]["rows"] = table.num_rows
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        table = sink.getvalue().to_pybytes()
    doc["chunk_table"].update(size=len(table), xxh3_64=xxhash.xxh3_64_intdigest(table))
    doc["chunk_table"].update(ref)
    return {**files, TABLE: table, "manifest.json": json.dumps(doc).encode()}


def edited(files: dict[str, bytes], row: int, **values) -> dict[str, bytes]:
    rows = pa.ipc.open_file(pa.BufferReader(files[TABLE])).read_all().to_pylist()
    rows[row].update(values)
    return retable(files, pa.Table.from_pylist(rows, schema=TABLE_SCHEMA))


def refused(files: dict[str, bytes]) -> str:
    with pytest.raises(CorruptCheckpointError) as info:
        manifest_from_bytes(files, where="ck/manifest.json")
    return str(info.value)


def test_a_missing_table_is_refused(files):
    del files[TABLE]
    assert refused(files).startswith(f"{TABLE}: the chunk table ck/manifest.json names is missing")


def test_a_truncated_table_is_refused(files):
    files[TABLE] = files[TABLE][:-10]
    msg = refused(files)
    assert msg.startswith(f"{TABLE}: has {len(files[TABLE])} bytes but the manifest recorded") and "truncated" in msg


def test_a_flipped_byte_is_caught_by_the_digest(files):
    data = bytearray(files[TABLE])
    data[len(data) // 2] ^= 0xFF
    files[TABLE] = bytes(data)
    assert "the chunk table is damaged or belongs to another save" in refused(files)


def test_bytes_that_are_not_arrow_are_refused(files):
    assert "not a readable Arrow IPC chunk table" in refused(retable(files, b"not an arrow file at all"))


def test_a_table_of_other_columns_is_refused(files):
    table = pa.ipc.open_file(pa.BufferReader(files[TABLE])).read_all()
    renamed = table.rename_columns(["key", "file", "offset", "byte_length", "offsets", "sizes", "checksums"])
    assert "columns are (key: int32, file: int32, offset: int64" in refused(retable(files, renamed))
    cast = table.set_column(2, "byte_offset", table.column(2).cast(pa.int32()))
    assert "byte_offset: int32" in refused(retable(files, cast))


def test_a_row_count_other_than_recorded_is_refused(files):
    table = pa.ipc.open_file(pa.BufferReader(files[TABLE])).read_all()
    assert "has 4 rows but the manifest recorded 5" in refused(retable(files, table, rows=5))


@pytest.mark.parametrize(
    "row, values, message",
    [
        (2, {"key": 9}, "row 2.key: expected a tensor id in [0, 3), got 9"),
        (3, {"key": 0}, "row 3.key: rows are not grouped by tensor in manifest order, got 0"),
        (1, {"file": 7}, "row 1 (entries['model.w'].chunks[1]).file: expected a file id in [0, 2), got 7"),
        (2, {"byte_offset": -5}, "row 2 (entries['model.b'].chunks[0]).byte_offset: expected a non-negative integer"),
        (0, {"offsets": [0]}, "row 0 (entries['model.w'].chunks[0]).offsets: expected one integer per dimension"),
        (1, {"sizes": [3, -4]}, "row 1 (entries['model.w'].chunks[1]).sizes: holds a negative number"),
        (1, {"file": None}, "row 1 (entries['model.w'].chunks[1]).file: is null"),
        (3, {"checksums": [None]}, "row 3 (entries['optim.step'].chunks[0]).checksums: holds a null"),
    ],
)
def test_a_bad_row_is_refused_naming_its_tensor_and_chunk(files, row, values, message):
    msg = refused(edited(files, row, **values))
    assert msg.startswith(f"{TABLE}: ") and message in msg


def test_a_table_path_outside_the_checkpoint_is_refused(files):
    doc = json.loads(files["manifest.json"])
    doc["chunk_table"]["path"] = "../elsewhere/chunks.arrow"
    msg = refused({**files, "manifest.json": json.dumps(doc).encode()})
    assert msg.startswith("ck/manifest.json: chunk_table.path: ") and "escapes the checkpoint directory" in msg
    del doc["chunk_table"]
    assert "missing field 'chunk_table'" in refused({**files, "manifest.json": json.dumps(doc).encode()})


def test_well_formed_rows_that_do_not_tile_are_refused_when_read(tmp_path, files):
    bad = edited(files, 1, offsets=[2, 0])  # model.w's chunks overlap on row 2
    ckdir = CheckpointDir.resolve(str(tmp_path))
    for name, data in bad.items():
        ckdir.write_atomic(name, data)
    with pytest.raises(CorruptCheckpointError) as info:
        read_manifest(ckdir)
    assert "inconsistent manifest (1 problem(s)):\n  key 'model.w': chunks offsets=[0, 0] sizes=[3, 4] and " in str(
        info.value
    )


# ---------------------------------------------------------------------------
# On storage: saved, swept, recognized


def test_a_save_writes_version_4_and_a_later_save_sweeps_the_old_table(tmp_path):
    path = str(tmp_path / "ck")
    state = {"w": torch.arange(12.0).reshape(4, 3), "step": 3}
    first = rayckpt.save(state, path)
    assert os.path.exists(os.path.join(path, chunk_table_name(first.save_id)))
    second = rayckpt.save(state, path)
    tables = sorted(n for n in os.listdir(path) if n.endswith("-chunks.arrow"))
    assert tables == [chunk_table_name(second.save_id)]
    target = {"w": torch.zeros(4, 3), "step": 0}
    rayckpt.load(target, path)
    assert torch.equal(target["w"], state["w"]) and target["step"] == 3
    info = rayckpt.inspect(path)
    assert (info.version, info.block_size) == (4, 64 * 1024) and rayckpt.verify(path).ok


def test_a_chunk_table_name_carries_its_save_id():
    assert shard_file_save_id("20260101T000000-01234567-chunks.arrow") == "20260101T000000-01234567"
    assert shard_file_save_id("20260101T000000-01234567-r00003-float.arrow") == "20260101T000000-01234567"
    assert shard_file_save_id("notes.arrow") is None


def test_columns_built_from_chunk_objects_gather_the_checksums():
    m = sample_manifest(version=FORMAT_VERSION)
    cols = ChunkColumns.from_manifest(m, checksums=True)
    want = [s for e in m.entries.values() if hasattr(e, "chunks") for c in e.chunks for s in c.checksums]
    assert cols.checksums is not None and cols.checksums.tolist() == want
    assert [cols.chunk(i) for i in range(cols.num_chunks)] == [c for k in cols.keys for c in m.tensor(k).chunks]
    assert ChunkColumns.from_manifest(m).checksums is None
    with pytest.raises(ValueError, match="hold no checksums"):
        ChunkColumns.from_manifest(m).chunk(0)
    after_w = int(cols.num_checksums[:2].sum())  # model.b's and optim.step's follow model.w's two chunks
    assert np.array_equal(cols.select(1, 3).checksums, cols.checksums[after_w:])


@pytest.mark.parametrize("seed", range(5))
def test_chunks_reported_in_any_order_become_rows_grouped_by_key_in_box_order(seed):
    """``from_chunks`` orders as sorting each key's ``ChunkEntry`` objects by box offsets would (stable)."""
    rng = np.random.default_rng(seed)
    keys = ["a", "b", "c", "d"]
    ndims = {"a": 0, "b": 1, "c": 2, "d": 3}
    written = []
    for i in range(60):
        key = keys[int(rng.integers(4))]
        d = ndims[key]
        box = Box(tuple(rng.integers(0, 3, d).tolist()), tuple(rng.integers(1, 4, d).tolist()))
        sums = tuple(rng.integers(0, 2**63, int(rng.integers(0, 4))).tolist())
        written.append(
            WrittenChunk(key=key, box=box, file=f"f{i % 3}", byte_offset=i * 10, byte_length=i, checksums=sums)
        )
    cols = ChunkColumns.from_chunks(keys, ["float32"] * 4, [(9,) * ndims[k] for k in keys], ["f0", "f1"], written)
    want = [
        ChunkEntry(box=w.box, file=w.file, byte_offset=w.byte_offset, byte_length=w.byte_length, checksums=w.checksums)
        for k in keys
        for w in sorted((w for w in written if w.key == k), key=lambda w: w.box.offsets)
    ]
    assert [cols.chunk(i) for i in range(cols.num_chunks)] == want
    assert cols.counts.tolist() == [sum(w.key == k for w in written) for k in keys]
    assert cols.files == ("f0", "f1", "f2")  # the listed files first, then by first use


def test_a_rank_reporting_chunks_of_an_unknown_key_fails_the_save():
    spec = SaveSpec(save_id="s", world_size=1, block_size=16, tensors={"w": ("float32", (2,))}, values={})
    chunk = WrittenChunk(key="nope", box=Box((0,), (2,)), file="f", byte_offset=0, byte_length=8, checksums=(1,))
    with pytest.raises(SaveFailedError, match="a rank wrote chunks of 'nope', which is not a tensor of this save"):
        create_manifest(spec, [WrittenShard(0, (chunk,), (FileEntry("f", 8, 0),))])


def test_list_columns_whose_offsets_do_not_start_at_zero_read_the_same(files, monkeypatch):
    """Arrow lets a list column leave unused values before its first row (offsets from K, not 0; the IPC
    writer rebases them, an in-memory array need not): the rows' values are the ones its offsets name."""
    plain = manifest_from_bytes(files, where="ck/manifest.json")
    one_array = manifest_files._one_array

    def shifted(column):
        col = one_array(column)
        if not pa.types.is_list(col.type):
            return col
        pad = pa.array([99, 98, 97], col.type.value_type)
        offsets = pa.array(np.asarray(col.offsets) + len(pad), pa.int32())
        col = pa.ListArray.from_arrays(offsets, pa.concat_arrays([pad, col.values]), type=col.type)
        assert col.offsets[0].as_py() == 3 and col.values[0].as_py() == 99
        return col

    monkeypatch.setattr(manifest_files, "_one_array", shifted)
    assert manifest_from_bytes(files, where="ck/manifest.json") == plain
