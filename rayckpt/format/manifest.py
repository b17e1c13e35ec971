"""The manifest: the committed description of one checkpoint. Pure: stdlib only.

A checkpoint exists once ``manifest.json`` exists. It is JSON (no pickle): the
format version, who saved it, the shard files, and for every key its path in the
nested state dict and either a tensor (dtype, global shape, chunks) or a JSON
value. See ``docs/FORMAT.md``.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..errors import CorruptCheckpointError, FormatVersionError, InvalidStateError
from .boxes import Box
from .file_paths import is_shared, safe_file_path
from .manifest_schema import SchemaError, accepts, document_definition, find_problem, show
from .paths import Path, decode_path, encode_path
from .values import check_value

FORMAT_NAME = "rayckpt"
FORMAT_VERSION = 4
#: The version of a manifest that names shard files in the run's shared store (an incremental
#: save's): a self-contained checkpoint is still written as ``FORMAT_VERSION``, which older readers read.
SHARED_VERSION = 5


#: Versions this rayckpt reads: 1 (CRC-32 blocks), 2 (the checksum is named), 3 (each key's path;
#: bytes values), 4 (the chunks in a columnar chunk table), 5 (files in the shared store).
READ_VERSIONS = (1, 2, 3, 4, 5)


#: The first version whose chunks live in the chunk table (an Arrow IPC file) instead of the JSON.
CHUNK_TABLE_VERSION = 4
#: Block checksum algorithms: XXH3-64 (the default, faster than zlib's CRC-32: every byte read
#: is checksummed) and CRC-32 (what version 1 wrote).
CHECKSUMS = ("xxh3_64", "crc32")
DEFAULT_CHECKSUM = "xxh3_64"


MANIFEST_NAME = "manifest.json"
#: torch dtype name -> (bytes per element, Arrow storage type name).
#: Dtypes Arrow lacks are stored as same-width unsigned integers.
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "double"),
    "float32": (4, "float"),
    "float16": (2, "halffloat"),
    "bfloat16": (2, "uint16"),
    "float8_e4m3fn": (1, "uint8"),
    "float8_e5m2": (1, "uint8"),
    "float8_e4m3fnuz": (1, "uint8"),
    "float8_e5m2fnuz": (1, "uint8"),
    "int64": (8, "int64"),
    "int32": (4, "int32"),
    "int16": (2, "int16"),
    "int8": (1, "int8"),
    "uint8": (1, "uint8"),
    "uint16": (2, "uint16"),
    "uint32": (4, "uint32"),
    "uint64": (8, "uint64"),
    "bool": (1, "uint8"),
    "complex64": (8, "uint64"),
}


def itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype][0]
    except KeyError:
        raise InvalidStateError(f"dtype {dtype!r} is not supported; supported: {sorted(DTYPES)}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkEntry:
    """One stored box of a tensor inside a shard file."""

    box: Box
    file: str
    #: Absolute byte offset of the chunk's row-major data inside ``file``.
    byte_offset: int
    byte_length: int
    #: The ``Manifest.checksum`` of each ``block_size`` block of the data, the last one partial.
    checksums: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    #: A tuple, or for a version-4 manifest read from storage its rows of the chunk table (``ChunkRows``).
    chunks: Sequence[ChunkEntry]
    #: Where the key sits in the nested state dict (None before format version 3).
    path: Path | None = None


@dataclass(frozen=True, slots=True)
class ValueEntry:
    #: The value in tagged JSON form (see ``encode_value``).
    value: Any
    #: Where the key sits in the nested state dict (None before format version 3).
    path: Path | None = None


Entry = TensorEntry | ValueEntry


@dataclass(frozen=True, slots=True)
class Blocks:
    """How a checkpoint's chunk data is checksummed: block size and algorithm."""

    size: int
    checksum: str = DEFAULT_CHECKSUM


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    size: int
    rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    save_id: str
    world_size: int
    block_size: int
    entries: dict[str, Entry]
    files: tuple[FileEntry, ...]
    created: float = 0.0
    version: int = FORMAT_VERSION
    #: Free-form JSON the caller attached (step, metrics, run name).
    user_metadata: dict[str, Any] = field(default_factory=dict)
    #: The job's place in its data when it saved (``rayckpt.data.DataPosition``'s fields); None: not saved.
    data_position: dict[str, Any] | None = None
    #: Algorithm of every chunk's block checksums (one of ``CHECKSUMS``).
    checksum: str = DEFAULT_CHECKSUM
    #: Read from storage (version 4): the chunk table's file name and its columns
    #: (``chunk_columns.ChunkColumns``, which the tensor entries' ``chunk_rows.ChunkRows`` index).
    #: The columns always hold the checksums: the rows' ``ChunkEntry`` objects are built from them.
    chunk_table: str | None = field(default=None, compare=False)
    columns: Any = field(default=None, compare=False, repr=False)

    @property
    def blocks(self) -> Blocks:
        return Blocks(self.block_size, self.checksum)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def table_files(self) -> tuple[str, ...]:
        """Files of the checkpoint besides the shard files and ``manifest.json``: its chunk table (version 4)."""
        if self.version < CHUNK_TABLE_VERSION:
            return ()
        return (self.chunk_table or chunk_table_name(self.save_id),)

    def path(self, key: str) -> Path:
        """Where ``key`` sits in the saved state dict (the key itself before format version 3)."""
        return self.entries[key].path or (key,)

    def tensor(self, key: str) -> TensorEntry:
        entry = self.entries.get(key)
        if not isinstance(entry, TensorEntry):
            raise KeyError(key)
        return entry


#: Attaches a version-4 manifest's chunk table: (the manifest, its tensor entries still without
#: chunks; the JSON's ``chunk_table`` object) -> the whole manifest (``manifest_files``).
TableLoader = Callable[["Manifest", dict[str, Any]], "Manifest"]


def chunk_table_name(save_id: str) -> str:
    """The chunk table file of a version-4 save (docs/FORMAT.md: file naming)."""
    return f"{save_id}-chunks.arrow"


def encode_manifest(m: Manifest, table: dict[str, Any] | None = None) -> bytes:
    """The manifest's JSON. Version 4 names its chunk table (``table``: the ``chunk_table`` object)
    and lists no chunk itself; ``manifest_files.encode_manifest_files`` writes both."""
    by_table = m.version >= CHUNK_TABLE_VERSION
    if by_table and table is None:
        raise InvalidStateError(
            f"a version-{m.version} manifest lists its chunks in a chunk table: "
            "encode it with manifest_files.encode_manifest_files"
        )
    # Version 1 has no algorithm field per chunk: its list is called "crc32".
    sums = "crc32" if m.version == 1 else "checksums"
    entries: dict[str, Any] = {}
    for key, e in m.entries.items():
        if isinstance(e, TensorEntry):
            entries[key] = {
                "kind": "tensor",
                **_path_field(m.version, e.path),
                "dtype": e.dtype,
                "shape": list(e.shape),
            }
            if not by_table:
                entries[key]["chunks"] = [
                    {
                        "offsets": list(c.box.offsets),
                        "sizes": list(c.box.sizes),
                        "file": c.file,
                        "byte_offset": c.byte_offset,
                        "byte_length": c.byte_length,
                        sums: list(c.checksums),
                    }
                    for c in e.chunks
                ]
        else:
            entries[key] = {"kind": "value", **_path_field(m.version, e.path), "value": e.value}
    doc = {
        "format": FORMAT_NAME,
        "version": m.version,
        "save_id": m.save_id,
        "world_size": m.world_size,
        "created": m.created,
        "block_size": m.block_size,
        "checksum": m.checksum,
        "user_metadata": m.user_metadata,
        **({"data_position": m.data_position} if m.data_position is not None else {}),
        "files": [{"path": f.path, "size": f.size, "rank": f.rank} for f in m.files],
    }
    if table is not None and by_table:
        doc["chunk_table"] = table
    doc["entries"] = entries
    return json.dumps(doc, separators=(",", ":")).encode()


def _path_field(version: int, path: Path | None) -> dict[str, Any]:
    return {"path": encode_path(path)} if version >= 3 and path is not None else {}


def decode_manifest(data: bytes, where: str = "manifest", table: TableLoader | None = None) -> Manifest:
    """Parse and validate a manifest; ``where`` names it in errors.

    A version-4 manifest's chunks come from its chunk table, through ``table``
    (``manifest_files.decode_manifest_files`` passes one that reads the file).

    The cyclic garbage collector is paused meanwhile: a large manifest creates
    millions of objects (none cyclic) and each collection would rescan them all
    while freeing none of them.
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        return _decode(data, where, table)
    finally:
        if paused:
            gc.enable()


def _decode(data: bytes, where: str, table: TableLoader | None) -> Manifest:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: not a rayckpt manifest (JSON nested too deeply)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a rayckpt manifest (no 'format': 'rayckpt')")
    version = doc.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise FormatVersionError(
            f"{where}: format version {show(version)} is not supported by this rayckpt "
            f"(reads versions {', '.join(map(str, READ_VERSIONS))}); upgrade rayckpt to read it"
        )
    checksum = doc.get("checksum", "crc32")
    if checksum not in CHECKSUMS or (version == 1 and checksum != "crc32"):
        raise CorruptCheckpointError(
            f"{where}: checksum {show(checksum)} is not supported by format version {version} "
            f"(known: {', '.join(CHECKSUMS)})"
        )
    if version >= CHUNK_TABLE_VERSION and table is None:
        raise InvalidStateError(
            f"{where}: a version-{version} manifest lists its chunks in a chunk table: "
            "read it with manifest_files.decode_manifest_files"
        )
    try:
        manifest = _decode_document(doc, version, checksum)
    except (SchemaError, CorruptCheckpointError) as exc:
        # CorruptCheckpointError: a key's path (``decode_path``) names its JSON path, not the file.
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    if table is None or version < CHUNK_TABLE_VERSION:
        return manifest
    ref = dict(doc["chunk_table"])
    try:
        ref["path"] = safe_file_path(ref["path"], "chunk_table.path")
        if is_shared(ref["path"]):
            raise SchemaError("chunk_table.path", f"the chunk table {ref['path']!r} is not in the checkpoint directory")
    except SchemaError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    return table(manifest, ref)


def _decode_document(doc: dict[str, Any], version: int, checksum: str) -> Manifest:
    """The manifest of a document whose format and version are known; raises ``SchemaError``.

    The schema (``manifest_schema``) checks every field's type and range; what it cannot
    say is checked here: file paths stay inside the checkpoint, each chunk names a listed
    file and one offset and size per dimension, stored values decode, paths spell their keys.
    """
    definition = document_definition(version)
    if not accepts(doc, definition):
        _raise_problem(doc, definition)
    files = tuple(
        FileEntry(safe_file_path(f["path"], f"files[{i}].path"), f["size"], f["rank"])
        for i, f in enumerate(doc["files"])
    )
    for i, f in enumerate(files):
        if version < SHARED_VERSION and is_shared(f.path):
            raise SchemaError(f"files[{i}].path", f"file path {f.path!r} is in the shared store: format version 5 only")
    known = {f.path for f in files}
    if len(known) != len(files):
        dup = next(i for i, f in enumerate(files) if f.path in {g.path for g in files[:i]})
        raise SchemaError(f"files[{dup}].path", f"{files[dup].path!r} is listed twice")
    sums = "crc32" if version == 1 else "checksums"
    listed: dict[str, str] = {}  # file name as written -> its checked path (a few files, millions of chunks)
    entries: dict[str, Entry] = {}
    for key, e in doc["entries"].items():
        at = f"entries[{key!r}]"
        path = decode_path(e["path"], key, f"{at}.path") if "path" in e and version >= 3 else None
        if e["kind"] == "value":
            try:
                check_value(e["value"])
            except ValueError as exc:
                raise SchemaError(f"{at}.value", str(exc)) from None
            entries[key] = ValueEntry(e["value"], path)
            continue
        shape = e["shape"]
        ndim = len(shape)
        chunks = []
        for i, c in enumerate(() if version >= CHUNK_TABLE_VERSION else e["chunks"]):
            offsets, sizes, name = c["offsets"], c["sizes"], c["file"]
            if len(offsets) != ndim or len(sizes) != ndim:
                field = "offsets" if len(offsets) != ndim else "sizes"
                raise SchemaError(
                    f"{at}.chunks[{i}].{field}",
                    f"expected {ndim} integer(s), one per dimension of the shape {shape}, got {len(c[field])}",
                )
            file = listed.get(name)
            if file is None:
                file = safe_file_path(name, f"{at}.chunks[{i}].file")
                if file not in known:
                    raise SchemaError(f"{at}.chunks[{i}].file", f"{file!r} is missing from 'files'")
                listed[name] = file
            chunks.append(
                ChunkEntry(
                    box=Box(tuple(offsets), tuple(sizes)),
                    file=file,
                    byte_offset=c["byte_offset"],
                    byte_length=c["byte_length"],
                    checksums=tuple(c[sums]),
                )
            )
        entries[key] = TensorEntry(e["dtype"], tuple(shape), tuple(chunks), path)
    return Manifest(
        save_id=doc["save_id"],
        world_size=doc["world_size"],
        block_size=doc["block_size"],
        entries=entries,
        files=files,
        created=float(doc.get("created", 0.0)),
        version=version,
        checksum=checksum,
        user_metadata=dict(doc.get("user_metadata", {})),
        data_position=doc.get("data_position"),
    )


def _raise_problem(doc: dict[str, Any], definition: str) -> NoReturn:
    """Raise what is wrong with a document the schema refuses (a key's bad ``path`` as ``decode_path`` says it)."""
    found = find_problem(doc, definition)
    if found is None:  # pragma: no cover - the compiled check and jsonschema agree (tests/unit/test_manifest_schema.py)
        raise SchemaError("", "does not match the manifest schema")
    parts, error = found
    if len(parts) > 2 and parts[0] == "entries" and parts[2] == "path":
        key = str(parts[1])
        decode_path(doc["entries"][key]["path"], key, f"entries[{key!r}].path")
    raise error


def manifest_values(manifest: Manifest, keys: Iterable[str]) -> dict[str, Any]:
    """The stored values of ``keys`` that the manifest has as values."""
    out = {}
    for k in keys:
        entry = manifest.entries.get(k)
        if isinstance(entry, ValueEntry):
            out[k] = entry.value
    return out
