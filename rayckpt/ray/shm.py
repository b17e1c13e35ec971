"""A node's shared memory as the Ray layer uses it: the staging directory, its file names, a staged region.

Three kinds of process meet in it: a training rank stages its share into a
file there (``staging.StagingBuffer``), the node's ShardWriter maps that file
and writes from it (``writer.regions``), and the memory tier holds its files in
the same directory (``memory.store``). Each process reads ``RAYCKPT_SHM_DIR``
from its own environment, so set it on the node (``RAYCKPT_SHM_DIR=/mnt/stage ray
start ...``) for all of them to see the same directory.
"""

from __future__ import annotations

import functools
import mmap
import os
from dataclasses import dataclass

import ray

SHM_DIR = "/dev/shm"
#: The staging directory of the processes that read it (ranks and the node's ShardWriter), default ``SHM_DIR``.
SHM_DIR_ENV = "RAYCKPT_SHM_DIR"
#: Every file rayckpt creates there is named ``<PREFIX><pid>-...``: ``writer.regions.sweep_stale`` relies on it.
PREFIX = "rayckpt-stage-"
#: Shared mappings with their page tables filled in one call: a write that faults page by page is slower.
POPULATED = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def staging_dir() -> str:
    """This process's staging directory: ``RAYCKPT_SHM_DIR``, else ``/dev/shm``."""
    return os.environ.get(SHM_DIR_ENV) or SHM_DIR


def shm_room(directory: str) -> int:
    """Bytes rayckpt's files may still take in ``directory``: its filesystem's free space, less the room of this
    node's Ray object store where that store is on the same filesystem (``object_store_room``).

    Ray's object store takes its pages of the filesystem only as objects are made: a file of ours
    that took them would leave a later ``ray.put`` on the node to die of ``SIGBUS``.
    """
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize - object_store_room(directory, st.f_blocks * st.f_frsize)


def object_store_room(directory: str, size: int) -> int:
    """This node's Ray object store size (``object_store_memory``) when it is kept on the filesystem of
    ``directory`` (``size`` bytes), else 0; 0 outside Ray.

    Ray keeps it in ``/dev/shm`` when that holds it (else in ``/tmp``). Counted whole: the pages it
    already took are counted as used too.
    """
    if not ray.is_initialized():
        return 0
    try:
        same = os.stat(directory).st_dev == os.stat(SHM_DIR).st_dev
    except OSError:
        return 0
    store = _object_store_bytes(ray.get_runtime_context().get_node_id()) if same else 0
    return store if store <= size else 0


@functools.cache
def _object_store_bytes(node_id: str) -> int:
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return int(node.get("Resources", {}).get("object_store_memory", 0))
    return 0


def created_in(path: str) -> str:
    """The directory the open file ``path`` (``/proc/<pid>/fd/<fd>``) was created in, named or not."""
    return os.path.dirname(os.readlink(path).removesuffix(" (deleted)"))


@dataclass(frozen=True, slots=True)
class StagedRegion:
    """Where a rank's staged chunks are: what a ShardWriter on the same node needs."""

    #: Where a process on the node opens it: ``/proc/<rank pid>/fd/<fd>`` for a staging buffer.
    path: str
    node_id: str
    #: (offset, length) in the file of each chunk, in the save plan's order.
    spans: tuple[tuple[int, int], ...]
    #: The file's inode, checked on opening (a descriptor number can be reused); 0: not checked.
    inode: int = 0

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.spans)
