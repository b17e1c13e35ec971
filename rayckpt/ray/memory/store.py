"""The memory tier: checkpoints held in the nodes' memory by their ShardWriters, each file also on a peer node.

A memory checkpoint is an ordinary checkpoint (Arrow shard files, manifest last,
every block checksummed) on ``memory_filesystem()``: a ``pyarrow`` filesystem
whose files live in the ShardWriter actors, not in storage. Every save path,
the commit protocol, the catalog and the load planner work on it unchanged.

- **Where the bytes are.** Each node's ShardWriter holds a ``MemoryStore``:
  files in the node's shared memory (``/dev/shm``, or ``RAYCKPT_SHM_DIR``),
  unlinked as soon as written and kept open by the writer's process, so they
  are freed with it, however it ends (``ray.shutdown`` included), and survive
  the death of any training worker. Not the object store: its objects die with
  their owner and may be spilled to disk; these files are plain memory with a
  size the writer accounts for (``budget``).
- **Who writes what.** A shard file is written by the ShardWriter of the rank's
  node into its own store, then copied to one peer's store (the next node in
  the ring of live nodes that run a ShardWriter, sorted by node id) before the
  write returns: a save commits only once every share and its replica are
  held. Small files written elsewhere (the manifest by the MetadataActor, a
  lease by rank 0) go to every ShardWriter.
- **Reads.** A process opens a file from its own node's store when it is there
  (memory-mapped through ``/proc/<writer pid>/fd/<fd>``: no copy), else reads its
  ranges from a node that holds it, over Ray (``peer_bytes`` counts those).
"""

from __future__ import annotations

import io
import logging
import os
import threading
import uuid
from collections.abc import Iterable
from typing import Any

from ...format.manifest import MANIFEST_NAME
from ...storage.catalog import checkpoint_step
from ..shm import PREFIX, shm_room, staging_dir
from . import replication

logger = logging.getLogger(__name__)

#: ``FileSystemHandler.get_type_name`` of the memory tier (pyarrow shows it as ``py::rayckpt-mem``).
TYPE_NAME = "rayckpt-mem"
#: Bytes a node's store may hold: ``RAYCKPT_MEMORY_BUDGET`` (bytes), else this fraction of its tmpfs.
BUDGET_ENV = "RAYCKPT_MEMORY_BUDGET"
DEFAULT_BUDGET_FRACTION = 0.5
#: Bytes this process read from another node's store (the rest of a memory load came from its own node).
_COUNTS = {"peer_bytes": 0}
_COUNTS_LOCK = threading.Lock()
#: The store of this process, when it is a ShardWriter's.
_LOCAL: MemoryStore | None = None


class MemoryBudgetExceeded(OSError):
    """A node's memory tier cannot hold one more file within its budget."""


def peer_bytes() -> int:
    """Bytes this process has read from other nodes' memory stores so far."""
    return _COUNTS["peer_bytes"]


def default_budget(directory: str) -> int:
    """``RAYCKPT_MEMORY_BUDGET``, else half the size of the filesystem ``directory`` is on."""
    text = os.environ.get(BUDGET_ENV)
    if text:
        try:
            return int(float(text))
        except ValueError:
            raise ValueError(f"{BUDGET_ENV}={text!r}: expected a number of bytes") from None
    st = os.statvfs(directory)
    return int(st.f_blocks * st.f_frsize * DEFAULT_BUDGET_FRACTION)


class MemoryStore:
    """The files of the memory tier one ShardWriter holds (thread-safe: the writer is a threaded actor)."""

    def __init__(self, node_id: str, directory: str | None = None, budget: int | None = None) -> None:
        self.node_id = node_id
        self.directory = directory or staging_dir()
        self.budget = default_budget(self.directory) if budget is None else budget
        #: path -> (descriptor of the unlinked file, size, inode)
        self.files: dict[str, tuple[int, int, int]] = {}
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        with self._lock:
            return sum(size for _, size, _ in self.files.values())

    def room(self, root: str | None = None, keep: int = 0) -> tuple[int, str]:
        """Bytes it may still take, and what bounds them; with ``root``, after dropping the checkpoints under it
        that ``drop_old`` drops.

        Its budget less what it holds, or, where less, what its filesystem has left (``shm.shm_room``: free
        space less Ray's object store): other processes fill a tmpfs too. The second item says which, as
        "of its memory budget left" or "free in <directory> (its free space less Ray's object store)".
        """
        if root is not None:
            self.drop_old(root, keep)
        left, free = self.budget - self.held, max(0, shm_room(self.directory))
        if free < left:
            return free, f"free in {self.directory} (its free space less Ray's object store)"
        return left, "of its memory budget left"

    def drop_old(self, root: str, keep: int) -> int:
        """Drop the checkpoints under ``root`` older than the newest ``keep`` committed ones (0: every
        committed one), and leftovers older still; keep any newer (a save in flight). How many files went.

        Committed: the directory holds its manifest (written last). Every node applies the same rule
        to what it holds, so each frees its own room without waiting for the others. The files are
        no longer held (nor counted) on return; their descriptors are closed in the background, so
        the kernel's freeing of a dropped checkpoint's pages is not in the stall of the save that made room.
        """
        prefix = root.strip("/") + "/"
        with self._lock:
            steps: dict[int, list[str]] = {}
            committed: set[int] = set()
            for path in self.files:
                if path.startswith(prefix) and (step := checkpoint_step(path.rsplit("/", 1)[0])) is not None:
                    steps.setdefault(step, []).append(path)
                    committed.update([step] if path.endswith("/" + MANIFEST_NAME) else [])
            newest = sorted(committed, reverse=True)
            if len(newest) < max(keep, 1):
                return 0
            below = newest[keep - 1] if keep else newest[0] + 1
            fds = [self.files.pop(path)[0] for step, paths in steps.items() if step < below for path in paths]
        if fds:
            threading.Thread(target=_close_all, args=(fds,), name="rayckpt-mem-drop", daemon=True).start()
        return len(fds)

    def create(self, path: str, replicate: bool) -> _LocalOut:
        """A file to write ``path`` into; held once closed (and copied to the ring's peer with ``replicate``)."""
        name = os.path.join(self.directory, f"{PREFIX}{os.getpid()}-mem-{uuid.uuid4().hex[:12]}")
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return _LocalOut(self, path, name, fd, replicate)

    def put(self, path: str, data: Any) -> int:
        """Hold ``data`` (bytes or a uint8 array) as ``path``; its size."""
        out = self.create(path, replicate=False)
        out.write(memoryview(data).cast("B"))
        out.close()
        return out.size

    def hold_from(self, path: str, size: int, fill: Any) -> None:
        """Hold ``size`` bytes as ``path``, written by ``fill(fd)`` into the new file's descriptor from its start
        (a replica received from a peer); within the budget, or refused. Nothing is held if ``fill`` raises."""
        out = self.create(path, replicate=False)
        try:
            if size:
                fill(out.fd)
            written = os.fstat(out.fd).st_size
            if written != size:
                raise OSError(
                    f"memory tier of node {self.node_id[:12]}: {path}: {size} bytes expected, {written} written"
                )
        except BaseException:
            os.close(out.fd)
            os.unlink(out.name)
            raise
        out.size = size
        out.close()

    def adopt(self, path: str, name: str, fd: int) -> None:
        """Take the written file ``name`` (open as ``fd``) as ``path``, within the budget, or refuse it."""
        os.unlink(name)
        size = os.fstat(fd).st_size
        with self._lock:
            old = self.files.get(path)
            held = sum(s for _, s, _ in self.files.values()) - (old[1] if old else 0)
            if held + size > self.budget:
                os.close(fd)
                raise MemoryBudgetExceeded(
                    f"memory tier of node {self.node_id[:12]}: {path} ({size} bytes) does not fit: "
                    f"{held} of its {self.budget} bytes are held ({BUDGET_ENV} sets the budget)"
                )
            self.files[path] = (fd, size, os.fstat(fd).st_ino)
        if old:
            os.close(old[0])

    def stat(self, paths: Iterable[str]) -> dict[str, int]:
        """Size of each of ``paths`` held here; -1 for a path that is a directory of held files."""
        with self._lock:
            held = dict((p, s) for p, (_, s, _) in self.files.items())
        out = {}
        for path in paths:
            if path in held:
                out[path] = held[path]
            elif any(p.startswith(path.rstrip("/") + "/") for p in held) or path == "":
                out[path] = -1
        return out

    def listing(self, base: str, recursive: bool) -> dict[str, int]:
        """Files (size) and directories (-1) under ``base``: directly in it, or all with ``recursive``."""
        prefix = base.rstrip("/") + "/" if base.strip("/") else ""
        out: dict[str, int] = {}
        with self._lock:
            held = [(p, s) for p, (_, s, _) in self.files.items() if p.startswith(prefix)]
        for path, size in held:
            parts = path[len(prefix) :].split("/")
            for i in range(1, len(parts)):
                if recursive or i == 1:
                    out[prefix + "/".join(parts[:i])] = -1
            if recursive or len(parts) == 1:
                out[path] = size
        return out

    def delete(self, path: str, tree: bool) -> int:
        """Drop ``path`` (with ``tree``: everything under it too); how many files were dropped."""
        prefix = path.rstrip("/") + "/"
        with self._lock:
            gone = [p for p in self.files if p == path or (tree and (p.startswith(prefix) or not path.strip("/")))]
            fds = [self.files.pop(p)[0] for p in gone]
        for fd in fds:
            os.close(fd)
        return len(gone)

    def where(self, path: str) -> tuple[int, int, int, int] | None:
        """(writer pid, descriptor, size, inode) of ``path``, for a reader on this node; ``None``: not held."""
        with self._lock:
            held = self.files.get(path)
        return None if held is None else (os.getpid(), held[0], held[1], held[2])

    def read(self, path: str, offset: int, length: int) -> bytes:
        with self._lock:
            held = self.files.get(path)
        if held is None:
            raise FileNotFoundError(f"memory tier of node {self.node_id[:12]}: {path} is not held here")
        return os.pread(held[0], max(0, min(length, held[1] - offset)), offset)

    def close(self) -> None:
        self.delete("", tree=True)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class _LocalOut(io.RawIOBase):
    """A file being written into a ``MemoryStore`` (the ShardWriter's own process)."""

    def __init__(self, store: MemoryStore, path: str, name: str, fd: int, replicate: bool) -> None:
        super().__init__()
        self.store, self.path, self.name, self.fd, self.replicate = store, path, name, fd, replicate
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self.fd, view[done:])
        self.size += done
        return done

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self.store.adopt(self.path, self.name, self.fd)
        if self.replicate:
            try:
                replication.replicate(self.store.node_id, self.path, self.fd, self.size)
            except BaseException:
                self.store.delete(self.path, tree=False)  # never held without its replica
                raise


def local_store() -> MemoryStore | None:
    """This process's store, if it is a ShardWriter's."""
    return _LOCAL


def count_peer_bytes(n: int) -> None:
    with _COUNTS_LOCK:
        _COUNTS["peer_bytes"] += n


def hold_here(store: MemoryStore) -> None:
    """Make ``store`` this process's (a ShardWriter's): what it writes to the memory tier lands in it."""
    global _LOCAL
    _LOCAL = store
