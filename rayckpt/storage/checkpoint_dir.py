"""Where checkpoint bytes live: a directory on any ``pyarrow.fs`` filesystem.

Local directories get what durability needs (fsync of files and directory, atomic
rename, memory-mapped reads); other filesystems (S3, GCS, ...) get ranged reads
and whole-object writes, which are atomic there. On object stores a directory is
a key prefix: rayckpt creates no directory marker objects (pyarrow writes one when
it deletes an object), and a small whole object (the manifest, a lease) goes up in
one PUT.
"""

from __future__ import annotations

import ctypes
import os
import posixpath
import stat
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, RayckptError
from ..format.file_paths import SHARED_DIR
from ..phases import phase
from ..redaction import redact

#: ``sync_file_range(2)``'s flag: start writeback of the range's dirty pages, return at once.
SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or ``None`` where the C library has none."""
    try:
        func = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    func.restype = ctypes.c_int
    return func


_SYNC_FILE_RANGE = _sync_file_range()


def _fsync(path: str) -> None:
    """fsync the file or directory ``path`` (timed as the ``fsync`` phase)."""
    with phase("fsync"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _split_query(location: str) -> tuple[str, str]:
    """(path part, ``?query`` or "") of a URI; a local path has no query (``?`` is a file-name character)."""
    if "://" not in location:
        return location, ""
    base, sep, query = location.partition("?")
    return base, sep + query


def join_location(location: str, rel: str) -> str:
    """``location/rel``, keeping a URI's query string at the end: a URI a user can paste back.

    ``s3://b/run?endpoint_override=h:9000`` and ``step-1`` give ``s3://b/run/step-1?endpoint_override=h:9000``.
    """
    base, query = _split_query(location)
    return posixpath.join(base, rel) + query


def parent_location(location: str) -> str:
    """The directory holding ``location``, a URI's query string kept at the end."""
    base, query = _split_query(location)
    return posixpath.dirname(base.rstrip("/")) + query


#: ``FileSystem.type_name`` of object stores: a "directory" there is a key prefix, there while objects are.
#: rayckpt's memory tier (``ray.memory``) is one too: whole files, no directories of their own.
MEMORY_TIER = "py::rayckpt-mem"
OBJECT_STORES = ("s3", "gcs", MEMORY_TIER)


def _single_put_filesystem(fs: pafs.FileSystem) -> pafs.FileSystem:
    """``fs``, or for S3 its twin with ``allow_delayed_open``: an object smaller than one upload part then
    goes up in one PutObject (one request, nothing half-uploaded left by a killed writer) instead of a
    three-request multipart upload. Both are atomic: readers see the old object or the whole new one."""
    if not isinstance(fs, pafs.S3FileSystem):
        return fs
    try:
        rebuild, (options,) = fs.__reduce__()
        return fs if options.get("allow_delayed_open") else rebuild({**options, "allow_delayed_open": True})
    except Exception:  # noqa: BLE001 - pyarrow changed its pickling: multipart writes are atomic too
        return fs


class CheckpointDir:
    """One checkpoint directory. Paths given to methods are relative to it."""

    def __init__(self, fs: pafs.FileSystem, fs_path: str, location: str) -> None:
        self.fs = fs
        #: The directory's path on ``fs``.
        self.fs_path = fs_path.rstrip("/") or "/"
        #: What the user passed: it reopens the directory (``resolve``, the actors). It may carry
        #: credentials (``s3://KEY:SECRET@bucket/...``): never show it, show ``location``.
        self.uri = location
        #: ``uri`` with its secrets redacted (``s3://KEY:***@bucket/...``): for messages, logs, reports.
        self.location = redact(location)
        self._put_fs: pafs.FileSystem | None = None  # write_atomic's filesystem (see _single_put_filesystem)

    @staticmethod
    def resolve(checkpoint_id: str | os.PathLike[str], filesystem: pafs.FileSystem | None = None) -> CheckpointDir:
        """Turn a local path or a URI (file://, s3://, gs://, mock://) into a directory.

        Args:
            checkpoint_id: A local path (made absolute) or a URI ``pyarrow.fs``
                understands; with ``filesystem``, a path on it.
            filesystem: A ``pyarrow.fs.FileSystem`` to use as given.

        Returns:
            The ``CheckpointDir``; nothing is created on storage.

        Raises:
            RayckptError: ``pyarrow.fs`` cannot open the URI (the message has its
                credentials redacted).
        """
        text = os.fspath(checkpoint_id)
        if filesystem is not None:
            return CheckpointDir(filesystem, text, text)
        if "://" in text:
            try:
                fs, path = pafs.FileSystem.from_uri(text)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
                raise RayckptError(f"cannot open checkpoint location {redact(text)!r}: {exc}") from None
            return CheckpointDir(fs, path, text)
        path = os.path.abspath(text)
        return CheckpointDir(pafs.LocalFileSystem(), path, path)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def reads_in_place(self) -> bool:
        """One plain read per range, no parallel GETs: local files, and the memory tier's (memory-mapped
        when held on this node)."""
        return self.is_local or self.fs.type_name == MEMORY_TIER

    def held_descriptor(self, rel: str) -> int | None:
        """A descriptor of file ``rel`` held in this node's memory, to read with ``preadv`` (the caller
        closes it); ``None`` where there is none: any other filesystem, or a memory-tier file held only
        by another node."""
        if self.fs.type_name != MEMORY_TIER:
            return None
        return self.fs.handler.local_descriptor(self.path(rel))

    @property
    def is_object_store(self) -> bool:
        return self.fs.type_name in OBJECT_STORES

    def path(self, rel: str) -> str:
        """``rel``'s path on ``fs``; a ``../`` path (a file of the shared store beside the checkpoint
        directories) is normalized, as object stores take keys literally."""
        joined = posixpath.join(self.fs_path, rel)
        return posixpath.normpath(joined) if rel.startswith("../") else joined

    def child(self, rel: str) -> CheckpointDir:
        return CheckpointDir(self.fs, self.path(rel), join_location(self.uri, rel))

    def parent(self) -> CheckpointDir:
        return CheckpointDir(self.fs, posixpath.dirname(self.fs_path), parent_location(self.uri))

    # -- write side -------------------------------------------------------

    def makedirs(self) -> None:
        """Create the directory and its parents; nothing on an object store (writing an object is enough,
        and a marker per level would cost a PUT each on every lease refresh and outlive the checkpoint)."""
        if not self.is_object_store:
            self.fs.create_dir(self.fs_path, recursive=True)

    def open_output(self, rel: str) -> Any:
        return self.fs.open_output_stream(self.path(rel))

    def sync_file(self, rel: str) -> None:
        """Make a written file durable (local disks; object stores are on close)."""
        if self.is_local:
            _fsync(self.path(rel))

    def start_sync(self, rel: str, offset: int, length: int) -> None:
        """Start writing ``length`` bytes of file ``rel`` from ``offset`` to the disk, without waiting
        (``sync_file_range``): a shard file's written part goes out while the rest is written, so its
        ``sync_file`` waits only for the tail. Local disks on Linux; nothing elsewhere."""
        if self.is_local and _SYNC_FILE_RANGE is not None:
            try:
                fd = os.open(self.path(rel), os.O_RDONLY)
            except OSError:
                return  # the write itself reports a missing file
            try:
                _SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE)
            finally:
                os.close(fd)

    def sync_dir(self) -> None:
        if self.is_local:
            _fsync(self.fs_path)

    def write_atomic(self, rel: str, data: bytes, durable: bool = True) -> None:
        """Write ``rel`` so that readers see the old file or the whole new one, never part.

        ``durable=False`` skips the fsyncs (a lease: it matters only while its writer runs).
        """
        if self.is_local:
            tmp = self.path(f".{rel}.tmp-{uuid.uuid4().hex[:8]}")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    if durable:
                        f.flush()
                        with phase("fsync"):
                            os.fsync(f.fileno())
                os.replace(tmp, self.path(rel))
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
            if durable:
                self.sync_dir()
        else:
            if self._put_fs is None:
                self._put_fs = _single_put_filesystem(self.fs)
            with self._put_fs.open_output_stream(self.path(rel)) as out:
                out.write(data)

    def delete(self, rel: str) -> None:
        try:
            self.fs.delete_file(self.path(rel))
        except FileNotFoundError:
            pass

    def delete_dir_if_empty(self) -> None:
        """Remove the directory when nothing (no file, no subdirectory) is left in it.

        On an object store the prefix is gone with its last object; what may be left is a
        marker object (pyarrow writes one for the parent when it deletes a prefix's last object).
        """
        try:
            if self.is_local:
                os.rmdir(self.fs_path)  # removes only an empty directory, whoever writes into it meanwhile
            elif not self.fs.get_file_info(pafs.FileSelector(self.fs_path, allow_not_found=True)):
                self.fs.delete_dir(self.fs_path)
        except OSError:
            pass

    # -- read side --------------------------------------------------------

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type == pafs.FileType.File

    def refuse_link(self, rel: str) -> None:
        """Raise ``CorruptCheckpointError`` when ``rel`` or a directory on its way is a symbolic link.

        Local filesystems only (object stores have no links). A link inside a
        checkpoint could point anywhere; rayckpt reads only what is in the
        directory, as it refuses ``..`` paths. The directory itself may be a link.
        """
        if not self.is_local:
            return
        path = self.fs_path
        for part in rel.split("/"):
            path = posixpath.join(path, part)
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return  # missing: the caller says so
            if stat.S_ISLNK(mode):
                raise CorruptCheckpointError(
                    f"{join_location(self.location, rel)} is a symbolic link ({path} -> {os.readlink(path)}); "
                    "rayckpt does not follow links inside a checkpoint: replace it with the file itself"
                )

    def size(self, rel: str) -> int | None:
        """The size of file ``rel`` on storage (None when missing); refuses links (``refuse_link``)."""
        self.refuse_link(rel)
        info = self.fs.get_file_info(self.path(rel))
        return info.size if info.type == pafs.FileType.File else None

    def read_bytes(self, rel: str) -> bytes:
        self.refuse_link(rel)
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                return f.read()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no {rel} in {self.location}: not a committed checkpoint") from None

    def open_input(self, rel: str) -> Any:
        """A random-access file; memory-mapped for local files (zero-copy reads)."""
        path = self.path(rel)
        self.refuse_link(rel)
        if self.is_local:
            return pa.memory_map(path, "r")
        return self.fs.open_input_file(path)

    def list_files(self) -> list[str]:
        """Names of the files directly in the directory."""
        return self._list(pafs.FileType.File)

    def list_dirs(self) -> list[str]:
        """Names of the directories directly in the directory; the shared store of incremental saves
        (``format.manifest.SHARED_DIR``) is no checkpoint and is left out (``storage.shared`` reads it)."""
        return [name for name in self._list(pafs.FileType.Directory) if name != SHARED_DIR]

    def _list(self, kind: pafs.FileType) -> list[str]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.fs_path, allow_not_found=True))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(posixpath.basename(i.path) for i in infos if i.type == kind)
