"""Memory-tier replicas sent from ShardWriter to ShardWriter over one TCP stream each, not through Ray's object store.

A shard file of a memory checkpoint is copied to the ring's peer node before its
write returns (``replication.replicate``). Through the object store that took
three copies of every byte on the CPU (into the sender's store, across to the
peer's, out into the peer's held file) and object-store memory on both nodes as
large as the file. Over the link the sender's kernel sends the held file itself
(``socket.sendfile``: no copy in user space) and the peer moves the stream into the
new held file with ``splice`` (a kernel pipe: no copy in user space either, and no
page faults, as receiving into a mapping has): no object-store memory.

Each ShardWriter listens (``ReplicaServer``) on its node's IP address, on a port the
system picks; its ``mem_endpoint()`` gives (host, port, token), through Ray. A
connection must present the token before anything is read. The peer answers
``ok`` once the file is held (within its budget), else the reason, which the sender
raises. Where the link cannot be reached (a firewall between the nodes, say) the
sender copies through Ray instead (``replication.replicate``).
"""

from __future__ import annotations

import fcntl
import hmac
import os
import secrets
import select
import socket
import struct
import threading
from typing import Any

#: A replica's stream begins with: the listener's token, the file's size, the length of its path (then the path).
HEADER = struct.Struct("!16sQI")
#: How long a stalled stream may sit before either side gives up (a peer that died mid-copy).
STREAM_TIMEOUT_S = 120.0
#: How long a sender waits for a listener to accept (a peer whose machine is gone answers nothing).
CONNECT_TIMEOUT_S = 10.0
#: The longest path a listener accepts.
MAX_PATH = 4096
#: The receiving pipe's size (``F_SETPIPE_SZ``; 1 MiB is Linux's default ceiling for it).
PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = 1031


class LinkUnreachable(ConnectionError):
    """Nothing listens at a replica endpoint (or it cannot be reached): nothing was sent."""


class ReplicaServer:
    """A ShardWriter's listener: each connection is one replica, held in ``store`` once fully received."""

    def __init__(self, store: Any, host: str) -> None:
        #: The ``store.MemoryStore`` replicas go into.
        self.store = store
        self.token = secrets.token_bytes(16)
        self.sock = socket.create_server((host, 0))
        self.endpoint = (host, self.sock.getsockname()[1], self.token)
        #: Replicas held through the link so far, and their bytes; ``streams``: connections it has finished with.
        self.received = {"files": 0, "bytes": 0}
        self.streams = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, name="rayckpt-replicas", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._receive, args=(conn,), daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(STREAM_TIMEOUT_S)
                answer = self._hold(conn)
                if answer is not None:
                    try:
                        conn.sendall(answer)
                    except OSError:
                        pass
        finally:
            with self._lock:
                self.streams += 1

    def _hold(self, conn: socket.socket) -> bytes | None:
        """Read one replica and hold it: the answer (``ok`` or the reason), ``None`` for a stranger."""
        try:
            token, size, length = HEADER.unpack(_recv_exactly(conn, HEADER.size))
            if not hmac.compare_digest(token, self.token) or length > MAX_PATH:
                return None  # not a replica for this writer: closed without a word
            path = _recv_exactly(conn, length).decode()
            self.store.hold_from(path, size, lambda fd: _splice_into(conn, fd, size))
        except Exception as exc:  # noqa: BLE001 - the sender raises it, naming this node
            return f"{type(exc).__name__}: {exc}".encode()[:MAX_PATH]
        with self._lock:
            self.received["files"] += 1
            self.received["bytes"] += size
        return b"ok"

    def close(self) -> None:
        self.sock.close()


def send(endpoint: tuple[str, int, bytes], path: str, fd: int, size: int) -> None:
    """Send the held file ``fd`` (``size`` bytes) as ``path`` to the listener at ``endpoint``; return once held there.

    Raises ``LinkUnreachable`` when the listener cannot be reached (nothing was
    sent), ``OSError`` with the peer's reason when it did not hold the file (or
    the stream broke: ``ConnectionResetError``...).
    """
    host, port, token = endpoint
    try:
        conn = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except OSError as exc:
        raise LinkUnreachable(f"cannot reach the replica listener at {host}:{port}: {exc}") from exc
    conn.settimeout(STREAM_TIMEOUT_S)
    with conn, os.fdopen(os.dup(fd), "rb") as f:
        encoded = path.encode()
        conn.sendall(HEADER.pack(token, size, len(encoded)) + encoded)
        if size:
            conn.sendfile(f, 0, size)
        answer = _recv_answer(conn)
    if answer != b"ok":
        raise OSError(answer.decode(errors="replace") or "the peer closed the stream before holding the file")


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:], len(view) - got)
        if k == 0:
            raise ConnectionError(f"the sender closed the stream after {got} of {len(view)} bytes")
        got += k


def _splice_into(conn: socket.socket, fd: int, size: int) -> None:
    """Move the next ``size`` bytes of ``conn`` into file ``fd`` from its start, through a pipe in the kernel
    (``splice``: no copy in user space, no page faults on a mapping); a plain read and write where the
    system has no ``splice``."""
    if not hasattr(os, "splice"):
        _copy_into(conn, fd, size)
        return
    r, w = os.pipe()
    try:
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # the system's default pipe size: more calls, same bytes
        got = 0
        while got < size:
            try:
                k = os.splice(conn.fileno(), w, min(PIPE_BYTES, size - got))
            except BlockingIOError:  # a socket with a timeout is non-blocking: wait for it
                if not select.select([conn], [], [], conn.gettimeout())[0]:
                    raise TimeoutError(
                        f"no bytes from the sender for {conn.gettimeout()} s after {got} of {size}"
                    ) from None
                continue
            if k == 0:
                raise ConnectionError(f"the sender closed the stream after {got} of {size} bytes")
            while k:
                moved = os.splice(r, fd, k, offset_dst=got)
                got += moved
                k -= moved
    finally:
        os.close(r)
        os.close(w)


def _copy_into(conn: socket.socket, fd: int, size: int) -> None:
    buf = memoryview(bytearray(min(size, PIPE_BYTES)))
    got = 0
    while got < size:
        k = conn.recv_into(buf, min(len(buf), size - got))
        if k == 0:
            raise ConnectionError(f"the sender closed the stream after {got} of {size} bytes")
        _write_all(fd, buf[:k], got)
        got += k


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _recv_answer(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(MAX_PATH):
        chunks.append(chunk)
    return b"".join(chunks)
