"""The memory tier as a ``pyarrow`` filesystem: what ``store``'s stores hold, opened from any process.

Writes from a ShardWriter's process land in its own store (and its ring peer's);
small files written elsewhere (the manifest, a lease) go to every live
ShardWriter. Reads memory-map a file held on the reader's node, else read its
ranges from a node that holds it, over Ray (``store.peer_bytes``).
"""

from __future__ import annotations

import io
import mmap
import os
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import ray

from ..actors import ask_writers, writers
from ..shm import POPULATED
from ..writer.actor import get_shard_writer
from .store import TYPE_NAME, count_peer_bytes, local_store


class _RemoteIn(io.RawIOBase):
    """A held file read from another node's store, range by range, over Ray."""

    def __init__(self, handle: Any, path: str, size: int) -> None:
        super().__init__()
        self.handle, self.path, self.size, self.pos = handle, path, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else n
        data = ray.get(self.handle.mem_read.remote(self.path, self.pos, n))
        self.pos += len(data)
        count_peer_bytes(len(data))
        return data


class _BroadcastOut(io.RawIOBase):
    """A small file written from a process that holds no store: on close, held by every live ShardWriter."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path, self.buffer = path, io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self.buffer.write(data)

    def tell(self) -> int:
        return self.buffer.tell()

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        data = self.buffer.getvalue()
        held = ask_writers("mem_put", self.path, data)
        if not held:  # the run's first file (rank 0's lease): this node's writer is started for it
            ray.get(get_shard_writer().mem_put.remote(self.path, data))


class MemoryFileSystem(pafs.FileSystemHandler):
    """The memory tier as a ``pyarrow`` filesystem (``memory_filesystem()``); picklable, stateless."""

    def get_type_name(self) -> str:
        return TYPE_NAME

    def normalize_path(self, path: str) -> str:
        return path.strip("/")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemoryFileSystem)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(TYPE_NAME)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        paths = [self.normalize_path(p) for p in paths]
        found: dict[str, int] = {}
        for answer in ask_writers("mem_stat", paths).values():
            found.update(answer)
        return [_info(p, found.get(p)) for p in paths]

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        base = self.normalize_path(selector.base_dir)
        found: dict[str, int] = {}
        for answer in ask_writers("mem_listing", base, selector.recursive).values():
            found.update(answer)
        if not found and not selector.allow_not_found:
            raise FileNotFoundError(f"memory tier: no directory {base}")
        return [_info(p, s) for p, s in sorted(found.items())]

    def create_dir(self, path: str, recursive: bool) -> None:
        pass  # a directory is there while files are under it

    def delete_dir(self, path: str) -> None:
        ask_writers("mem_delete", self.normalize_path(path), True)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        ask_writers("mem_delete", self.normalize_path(path), True)

    def delete_root_dir_contents(self) -> None:
        ask_writers("mem_delete", "", True)

    def delete_file(self, path: str) -> None:
        if not sum(ask_writers("mem_delete", self.normalize_path(path), False).values()):
            raise FileNotFoundError(f"memory tier: no file {path}")

    def move(self, src: str, dest: str) -> None:
        raise NotImplementedError("the memory tier writes whole files: it has no rename")

    def copy_file(self, src: str, dest: str) -> None:
        raise NotImplementedError("the memory tier does not copy files")

    def open_append_stream(self, path: str, metadata: Any = None) -> Any:
        raise NotImplementedError("the memory tier writes whole files: it has no append")

    def open_output_stream(self, path: str, metadata: Any = None) -> Any:
        path = self.normalize_path(path)
        store = local_store()
        if store is not None:  # a ShardWriter writing a rank's shard: its own node, then the peer
            return pa.PythonFile(store.create(path, replicate=True), mode="w")
        return pa.PythonFile(_BroadcastOut(path), mode="w")

    def open_input_stream(self, path: str) -> Any:
        return self.open_input_file(path)

    def local_descriptor(self, path: str) -> int | None:
        """A descriptor of ``path`` if this node holds it (a rank reads it with ``preadv`` straight into
        its tensors, as a local file); ``None`` if only another node does."""
        path = self.normalize_path(path)
        store = local_store()
        if store is not None:
            held = store.where(path)
        else:
            here = ray.get_runtime_context().get_node_id()[:12]
            handle = writers().get(here)
            held = None if handle is None else ray.get(handle.mem_where.remote(path))
        return None if held is None else _open_held(held)

    def open_input_file(self, path: str) -> Any:
        path = self.normalize_path(path)
        store = local_store()
        if store is not None and (held := store.where(path)) is not None:
            return _mapped(held)
        here = ray.get_runtime_context().get_node_id()[:12]
        handles = writers()
        if here in handles:
            held = ray.get(handles[here].mem_where.remote(path))
            if held is not None:
                return _mapped(held)
        for node, size in ask_writers("mem_stat", [path]).items():
            if size.get(path, -1) >= 0:
                return pa.PythonFile(_RemoteIn(handles[node], path, size[path]), mode="r")
        raise FileNotFoundError(f"memory tier: no file {path} on any live node")


def _mapped(held: tuple[int, int, int, int]) -> Any:
    """A held file of this node, mapped with its page tables filled at once (``MAP_POPULATE``): a load reads
    most of it, and faulting it in page by page while copying out made a restore from memory no faster
    than one from a warm page cache."""
    size = held[2]
    mine = _open_held(held)
    try:
        if not size:
            return pa.BufferReader(b"")
        mapped = mmap.mmap(mine, size, flags=POPULATED, prot=mmap.PROT_READ)
    finally:
        os.close(mine)
    return pa.BufferReader(pa.py_buffer(mapped))


def _open_held(held: tuple[int, int, int, int]) -> int:
    """A descriptor of this node's held file ``(pid, fd, size, inode)``, opened through its holder's
    ``/proc/<pid>/fd``; refused if that no longer names the same file."""
    pid, fd, _, inode = held
    path = f"/proc/{pid}/fd/{fd}"
    mine = os.open(path, os.O_RDONLY)
    if os.fstat(mine).st_ino != inode:
        os.close(mine)
        raise FileNotFoundError(f"memory tier: {path} no longer names the held file")
    return mine


def _info(path: str, size: int | None) -> pafs.FileInfo:
    if size is None:
        return pafs.FileInfo(path, pafs.FileType.NotFound)
    if size < 0:
        return pafs.FileInfo(path, pafs.FileType.Directory)
    return pafs.FileInfo(path, pafs.FileType.File, size=size)


def memory_filesystem() -> pafs.FileSystem:
    """The memory tier as a filesystem: pass it as ``filesystem=`` to ``save_async``, ``load``, the catalog.

    Files live in the nodes' ShardWriters (``memory.store``), each also on a ring
    peer; any process may open it (it holds no state: every call asks the live writers).

    Returns:
        A ``pyarrow.fs.PyFileSystem`` over ``MemoryFileSystem``.
    """
    return pafs.PyFileSystem(MemoryFileSystem())
