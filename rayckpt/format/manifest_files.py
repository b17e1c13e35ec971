"""A manifest as the files it is stored in: ``manifest.json`` and, from version 4, its chunk table.

Version 4 keeps ``manifest.json`` small (ids, files, each tensor's dtype, shape
and path, values) and stores one row per chunk in an Arrow IPC file, the chunk
table, written before the JSON and named by it with its size, row count and
XXH3-64 digest: the commit stays the one atomic write of the JSON. A reader
checks the digest, then the table's schema and every row's ids and numbers with
array operations, and maps the columns straight into ``ChunkColumns`` (no
per-chunk Python object). Pure: pyarrow, numpy and xxhash, no I/O of its own
(``storage.commit`` reads and writes the files). ``docs/FORMAT.md`` describes the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidStateError
from .chunk_columns import ChunkColumns
from .chunk_rows import ChunkRows
from .manifest import (
    CHUNK_TABLE_VERSION,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    TensorEntry,
    chunk_table_name,
    decode_manifest,
    encode_manifest,
)

#: The chunk table's columns, one row per chunk: the tensor (its index among the manifest's
#: tensor entries, in their order), the shard file (index into ``files``), the chunk's byte range
#: in it, its box, and its block checksums.
TABLE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.int32(), nullable=False),
        pa.field("file", pa.int32(), nullable=False),
        pa.field("byte_offset", pa.int64(), nullable=False),
        pa.field("byte_length", pa.int64(), nullable=False),
        pa.field("offsets", pa.list_(pa.int64()), nullable=False),
        pa.field("sizes", pa.list_(pa.int64()), nullable=False),
        pa.field("checksums", pa.large_list(pa.uint64()), nullable=False),
    ]
)
#: Buffers are zstd-compressed: ids and box columns repeat, so the table shrinks to little
#: more than its checksums (FORMAT.md; docs/benchmarks.md, "Planning at scale").
COMPRESSION = "zstd"


@dataclass(frozen=True, slots=True)
class TableRef:
    """A version-4 manifest's ``chunk_table`` field: the chunk table file and how to check it."""

    path: str
    #: Bytes of the file, its rows (one per chunk) and the XXH3-64 of its bytes.
    size: int
    rows: int
    xxh3_64: int


@dataclass(frozen=True, slots=True)
class TableLayout:
    """What the JSON says about the chunk table's rows: the tensors (in manifest order) and files they index."""

    keys: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    files: tuple[str, ...]

    @classmethod
    def of(cls, m: Manifest) -> TableLayout:
        tensors = [(k, e) for k, e in m.entries.items() if isinstance(e, TensorEntry)]
        return cls(
            keys=tuple(k for k, _ in tensors),
            dtypes=tuple(e.dtype for _, e in tensors),
            shapes=tuple(e.shape for _, e in tensors),
            files=tuple(f.path for f in m.files),
        )


def encode_manifest_files(m: Manifest) -> list[tuple[str, bytes]]:
    """The files that store ``m``, in the order they must be written: the chunk table (version 4), then the JSON."""
    if m.version < CHUNK_TABLE_VERSION:
        return [(MANIFEST_NAME, encode_manifest(m))]
    columns = ChunkColumns.from_manifest(m, checksums=True)
    if len(columns.files) != len(m.files):
        extra = sorted(set(columns.files) - {f.path for f in m.files})
        raise InvalidStateError(f"chunks name file(s) the manifest does not list: {extra[:5]}")
    name = chunk_table_name(m.save_id)
    data = encode_chunk_table(columns, m.save_id)
    ref = {"path": name, "size": len(data), "rows": columns.num_chunks, "xxh3_64": xxhash.xxh3_64_intdigest(data)}
    return [(name, data), (MANIFEST_NAME, encode_manifest(m, ref))]


def manifest_file_bytes(m: Manifest) -> dict[str, bytes]:
    """``encode_manifest_files`` as a dict: file name -> bytes."""
    return dict(encode_manifest_files(m))


def manifest_from_bytes(files: Mapping[str, bytes], where: str = MANIFEST_NAME) -> Manifest:
    """The manifest stored in ``files`` (name -> bytes, as ``manifest_file_bytes`` gives), checked as on storage."""

    def read(path: str) -> bytes:
        if path not in files:
            raise FileNotFoundError(path)
        return files[path]

    return decode_manifest_files(files[MANIFEST_NAME], where, read, lambda path: path)


def encode_chunk_table(columns: ChunkColumns, save_id: str) -> bytes:
    """The chunk table of ``columns`` (with checksums) as an Arrow IPC file, one record batch."""
    assert columns.checksums is not None

    def lists(kind: type[pa.ListArray] | type[pa.LargeListArray], counts: np.ndarray, values: pa.Array) -> pa.Array:
        ends = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=ends[1:])
        width = pa.int64() if kind is pa.LargeListArray else pa.int32()
        return kind.from_arrays(arrow_of(ends, width), values)

    batch = pa.record_batch(
        [
            arrow_of(columns.key, pa.int32()),
            arrow_of(columns.file, pa.int32()),
            arrow_of(columns.byte_offset, pa.int64()),
            arrow_of(columns.byte_length, pa.int64()),
            lists(pa.ListArray, columns.ndim, arrow_of(columns.offsets, pa.int64())),
            lists(pa.ListArray, columns.ndim, arrow_of(columns.sizes, pa.int64())),
            lists(pa.LargeListArray, columns.num_checksums, arrow_of(columns.checksums, pa.uint64())),
        ],
        schema=TABLE_SCHEMA.with_metadata(
            {"rayckpt.version": str(FORMAT_VERSION), "rayckpt.save_id": save_id, "rayckpt.table": "chunks"}
        ),
    )
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=COMPRESSION)
    with pa.ipc.new_file(sink, batch.schema, options=options) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def decode_manifest_files(
    data: bytes, where: str, read: Callable[[str], bytes], locate: Callable[[str], str]
) -> Manifest:
    """Parse and check a manifest (``data``, named ``where``) and, from version 4, the chunk table it names.

    ``read(path)``: the bytes of a file of the checkpoint (``FileNotFoundError`` or
    ``CheckpointNotFoundError`` when missing); ``locate(path)``: its name in errors.
    The rows' tiling and bounds are ``manifest_checks``' (the caller runs them).
    """

    def attach(m: Manifest, doc: dict[str, Any]) -> Manifest:
        ref = TableRef(doc["path"], doc["size"], doc["rows"], doc["xxh3_64"])
        at = locate(ref.path)
        try:
            table = read(ref.path)
        except (FileNotFoundError, CheckpointNotFoundError) as exc:
            raise CorruptCheckpointError(f"{at}: the chunk table {where} names is missing ({exc})") from None
        return with_rows(m, ref.path, decode_chunk_table(table, ref, TableLayout.of(m), at))

    return decode_manifest(data, where, attach)


def with_rows(m: Manifest, path: str, columns: ChunkColumns) -> Manifest:
    """``m`` (its tensor entries without chunks) with the rows of its chunk table as each tensor's chunks."""
    entries = dict(m.entries)
    lo = 0
    for key, n in zip(columns.keys, columns.counts.tolist()):
        e = entries[key]
        assert isinstance(e, TensorEntry)
        entries[key] = TensorEntry(e.dtype, e.shape, ChunkRows(columns, lo, lo + n), e.path)
        lo += n
    return replace(m, entries=entries, chunk_table=path, columns=columns)


def decode_chunk_table(data: bytes, ref: TableRef, layout: TableLayout, where: str) -> ChunkColumns:
    """The columns of a chunk table, checked against its reference and the JSON's tensors and files.

    Raises ``CorruptCheckpointError`` naming ``where`` and, for a bad row, the
    tensor and chunk it belongs to.
    """
    if len(data) != ref.size:
        raise CorruptCheckpointError(
            f"{where}: has {len(data)} bytes but the manifest recorded {ref.size}: truncated or replaced"
        )
    digest = xxhash.xxh3_64_intdigest(data)
    if digest != ref.xxh3_64:
        raise CorruptCheckpointError(
            f"{where}: XXH3-64 of its bytes is {digest} but the manifest recorded {ref.xxh3_64}: "
            "the chunk table is damaged or belongs to another save"
        )
    try:
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: not a readable Arrow IPC chunk table ({exc})") from None
    got = [(f.name, f.type) for f in table.schema]
    want = [(f.name, f.type) for f in TABLE_SCHEMA]
    if got != want:
        shown = ", ".join(f"{n}: {t}" for n, t in got)
        raise CorruptCheckpointError(f"{where}: columns are ({shown}); expected the schema in docs/FORMAT.md")
    if table.num_rows != ref.rows:
        raise CorruptCheckpointError(f"{where}: has {table.num_rows} rows but the manifest recorded {ref.rows}")
    return _Rows(table, layout, where).columns()


class _Rows:
    """The checks of a chunk table's rows, on its columns; a message only for the first row that fails."""

    def __init__(self, table: pa.Table, layout: TableLayout, where: str) -> None:
        self.layout, self.where = layout, where
        self.cols = {name: _one_array(table.column(name)) for name in table.column_names}
        #: Per tensor: its first row, once the rows are known to be grouped by tensor (else None).
        self.first: np.ndarray | None = None
        self.key = self.flat("key")

    def flat(self, name: str) -> np.ndarray:
        arr = self.cols[name]
        self.nulls(arr, name, "is null", None)
        return numpy_of(arr)

    def listed(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A list column's lengths per row and its values back to back."""
        arr = self.cols[name]
        self.nulls(arr, name, "is null", None)
        bounds = numpy_of(arr.offsets)
        lengths = np.diff(bounds).astype(np.int64)
        # The rows' values, as ``arr.flatten()`` gives them without its first call's import of pyarrow.compute
        # (75 ms: most of a fresh process's manifest read). No row is null (checked above).
        values = arr.values.slice(int(bounds[0]), int(bounds[-1] - bounds[0])) if len(bounds) else arr.values
        self.nulls(values, name, "holds a null", lengths)
        return lengths, numpy_of(values)

    def nulls(self, arr: pa.Array, name: str, why: str, lengths: np.ndarray | None) -> None:
        """Fails on the first null of ``arr`` (a column, or a list column's values of rows of ``lengths``)."""
        if arr.null_count:
            at = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
            self.fail(at if lengths is None else self.row_of(lengths, at), name, why)

    @staticmethod
    def row_of(lengths: np.ndarray, value: int) -> int:
        """The row holding value ``value`` of a list column whose rows hold ``lengths`` values."""
        return int(np.searchsorted(np.cumsum(lengths), value, "right"))

    def columns(self) -> ChunkColumns:
        layout, key = self.layout, self.key
        nkeys, nfiles = len(layout.keys), len(layout.files)
        self.bad(np.flatnonzero((key < 0) | (key >= nkeys)), "key", f"expected a tensor id in [0, {nkeys})", key)
        self.bad(np.flatnonzero(key[1:] < key[:-1]) + 1, "key", "rows are not grouped by tensor in manifest order", key)
        counts = np.bincount(key, minlength=nkeys).astype(np.int64)
        self.first = np.cumsum(counts) - counts  # from here on, a bad row is named by its tensor and chunk
        file = self.flat("file")
        self.bad(np.flatnonzero((file < 0) | (file >= nfiles)), "file", f"expected a file id in [0, {nfiles})", file)
        byte_offset, byte_length = self.flat("byte_offset"), self.flat("byte_length")
        for name, col in (("byte_offset", byte_offset), ("byte_length", byte_length)):
            self.bad(np.flatnonzero(col < 0), name, "expected a non-negative integer", col)
        key_ndim = np.fromiter(map(len, layout.shapes), np.int64, nkeys)
        ndim, offsets = self.listed("offsets")
        size_ndim, sizes = self.listed("sizes")
        num_checksums, checksums = self.listed("checksums")
        for name, lengths, values in (("offsets", ndim, offsets), ("sizes", size_ndim, sizes)):
            wrong = np.flatnonzero(lengths != key_ndim[key])
            self.bad(wrong, name, "expected one integer per dimension of the shape", lengths, counted=True)
            negative = np.flatnonzero(values < 0)
            if len(negative):
                self.fail(self.row_of(lengths, int(negative[0])), name, "holds a negative number")
        return ChunkColumns(
            keys=layout.keys,
            dtypes=layout.dtypes,
            shapes=layout.shapes,
            counts=counts,
            files=layout.files,
            file=file.astype(np.int32, copy=False),
            byte_offset=byte_offset,
            byte_length=byte_length,
            num_checksums=num_checksums,
            ndim=ndim,
            offsets=offsets,
            sizes=sizes,
            checksums=checksums,
        )

    def bad(self, rows: np.ndarray, name: str, why: str, values: np.ndarray, counted: bool = False) -> None:
        if len(rows):
            r = int(rows[0])
            got = f"{int(values[r])} value(s)" if counted else str(int(values[r]))
            self.fail(r, name, f"{why}, got {got}")

    def fail(self, row: int, name: str, why: str) -> None:
        at = f"row {row}"
        if self.first is not None:
            k = int(self.key[row])
            at += f" (entries[{self.layout.keys[k]!r}].chunks[{row - int(self.first[k])}])"
        raise CorruptCheckpointError(f"{self.where}: {at}.{name}: {why}")


#: The numpy dtype of each Arrow type the chunk table's columns hold.
_NUMPY = {pa.int32(): np.dtype(np.int32), pa.int64(): np.dtype(np.int64), pa.uint64(): np.dtype(np.uint64)}


def arrow_of(values: Any, typ: pa.DataType) -> pa.Array:
    """An Arrow array of ``typ`` over the numpy ``values`` (no copy when they already have its dtype).

    Not ``pa.array``: pyarrow's numpy conversions import pandas when it is installed,
    0.4 s that the first save of a fresh process paid inside its commit.
    """
    arr = np.ascontiguousarray(values, dtype=_NUMPY[typ])
    return pa.Array.from_buffers(typ, len(arr), [None, pa.py_buffer(arr)])


def numpy_of(arr: pa.Array) -> np.ndarray:
    """The values of a primitive Arrow array with no nulls, as numpy, without copying (not ``to_numpy``: see
    ``arrow_of``)."""
    dtype = _NUMPY[arr.type]
    if len(arr) == 0:
        return np.empty(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def _one_array(column: pa.ChunkedArray) -> pa.Array:
    if column.num_chunks == 1:
        return column.chunk(0)
    if column.num_chunks == 0:
        return pa.array([], column.type)
    return column.combine_chunks()
