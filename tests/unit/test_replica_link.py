"""Memory-tier replicas over the writers' link (``ray.replica_link``): a real TCP stream on the loopback
between two real ``MemoryStore``s, without Ray; and ``memory.replication.replicate`` falling back to Ray's object
store when the link cannot be reached."""

from __future__ import annotations

import logging
import os
import socket
import time

import pytest

from rayckpt.ray.memory import link as replica_link
from rayckpt.ray.memory import replication
from rayckpt.ray.memory.link import HEADER, ReplicaServer
from rayckpt.ray.memory.store import MemoryStore

PAYLOAD = bytes(range(256)) * 4099  # ~1 MiB, not a multiple of a page


@pytest.fixture
def stores(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = MemoryStore("node-aaaaaaaaaaaa", str(tmp_path / "a"), budget=8 << 20)
    b = MemoryStore("node-bbbbbbbbbbbb", str(tmp_path / "b"), budget=8 << 20)
    server = ReplicaServer(b, "127.0.0.1")
    yield a, b, server
    server.close()
    a.close()
    b.close()


def _held(store: MemoryStore, path: str) -> tuple[int, int]:
    _pid, fd, size, _ino = store.where(path)
    return fd, size


def _settled(directory, server: ReplicaServer, streams: int = 1) -> bool:
    """Wait (up to 30 s) until the listener has finished with ``streams`` connections; whether it left
    nothing named behind in ``directory``."""
    deadline = time.monotonic() + 30
    while server.streams < streams and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.streams >= streams and os.listdir(directory) == []


def test_a_replica_is_streamed_into_the_peer_s_store_bit_exact_and_nameless(stores, tmp_path):
    a, b, server = stores
    a.put("mem/run/step/shard.arrow", PAYLOAD)
    a.put("mem/run/step/empty", b"")
    for path in ("mem/run/step/shard.arrow", "mem/run/step/empty"):
        replica_link.send(server.endpoint, path, *_held(a, path))
    assert b.read("mem/run/step/shard.arrow", 0, len(PAYLOAD) + 1) == PAYLOAD
    assert b.stat(["mem/run/step/empty"]) == {"mem/run/step/empty": 0}
    assert os.listdir(tmp_path / "b") == []  # held unlinked, as a file written there is
    assert server.endpoint[0] == "127.0.0.1" and len(server.endpoint[2]) == 16


def test_a_stream_without_the_listener_s_token_is_dropped_unread(stores, tmp_path):
    a, b, server = stores
    a.put("x", PAYLOAD)
    host, port, _token = server.endpoint
    with pytest.raises(OSError, match="closed the stream before holding the file|Connection reset|Broken pipe") as err:
        replica_link.send((host, port, b"\0" * 16), "x", *_held(a, "x"))
    assert not isinstance(err.value, replica_link.LinkUnreachable)  # reached, refused: not a reason to go round it
    assert b.files == {} and _settled(tmp_path / "b", server)


def test_a_replica_over_the_peer_s_budget_is_refused_with_its_reason(stores, tmp_path):
    a, b, server = stores
    b.budget = 1000
    a.put("mem/big", PAYLOAD)
    with pytest.raises(OSError, match=r"MemoryBudgetExceeded: memory tier of node node-bbbbbbb: mem/big \(1049344"):
        replica_link.send(server.endpoint, "mem/big", *_held(a, "mem/big"))
    assert b.files == {} and _settled(tmp_path / "b", server)


def test_a_sender_that_stops_mid_stream_leaves_nothing_held_or_named(stores, tmp_path):
    _a, b, server = stores
    host, port, token = server.endpoint
    with socket.create_connection((host, port)) as conn:
        conn.sendall(HEADER.pack(token, 1000, 4) + b"half" + b"x" * 10)
    assert _settled(tmp_path / "b", server) and b.files == {}


def test_an_unreachable_peer_is_told_once_and_the_replica_goes_through_ray(stores, monkeypatch, caplog):
    a, _b, _server = stores
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = ("127.0.0.1", closed.getsockname()[1], b"t" * 16)  # nobody listens there once closed
    monkeypatch.setattr(replication, "ring_peer", lambda node: ("node-cccccccccccc", "handle"))
    monkeypatch.setattr(replication, "_endpoint", lambda node, handle: dead)
    sent: list = []
    monkeypatch.setattr(replication, "_replicate_through_ray", lambda h, path, fd, size: sent.append((h, path, size)))
    monkeypatch.setattr(replication, "_UNREACHABLE", set())
    with caplog.at_level(logging.WARNING, logger="rayckpt.ray.memory.replication"):
        for path in ("p1", "p2"):
            out = a.create(path, replicate=True)
            out.write(b"abc")
            out.close()
    assert sent == [("handle", "p1", 3), ("handle", "p2", 3)]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "replicas to node node-cccccccccccc go through Ray instead" in warned[0]
    assert "cannot reach the replica listener at 127.0.0.1:" in warned[0]


def test_without_splice_the_replica_is_copied_through_a_buffer_bit_exact(stores, monkeypatch):
    a, b, server = stores
    monkeypatch.delattr(os, "splice")  # a system without splice(2)
    a.put("mem/shard", PAYLOAD)
    replica_link.send(server.endpoint, "mem/shard", *_held(a, "mem/shard"))
    assert b.read("mem/shard", 0, len(PAYLOAD)) == PAYLOAD


def test_a_short_replica_is_refused_naming_what_came(stores, tmp_path):
    _a, b, server = stores
    host, port, token = server.endpoint
    with socket.create_connection((host, port)) as conn:
        conn.sendall(HEADER.pack(token, 1000, 4) + b"half" + b"x" * 10)
        conn.shutdown(socket.SHUT_WR)
        answer = replica_link._recv_answer(conn)
    assert answer == b"ConnectionError: the sender closed the stream after 10 of 1000 bytes"
    assert b.files == {} and _settled(tmp_path / "b", server)


def test_a_stalled_sender_times_out_and_nothing_is_held(stores, tmp_path, monkeypatch):
    _a, b, server = stores
    monkeypatch.setattr(replica_link, "STREAM_TIMEOUT_S", 0.2)
    host, port, token = server.endpoint
    with socket.create_connection((host, port)) as conn:
        conn.sendall(HEADER.pack(token, 1000, 4) + b"slow" + b"x" * 10)
        answer = replica_link._recv_answer(conn)  # the listener gives up and answers; the sender never closed
    assert answer.startswith(b"TimeoutError: no bytes from the sender for 0.2 s after 10 of 1000")
    assert b.files == {} and _settled(tmp_path / "b", server)
