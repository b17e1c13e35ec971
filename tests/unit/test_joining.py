"""Which Ray cluster a driver joins: a dead address is found out before ``ray.init`` waits on it."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from rayckpt.ray.joining import ClusterUnreachableError, address_file, answers, cluster_address


@pytest.fixture
def ray_tmp(tmp_path, monkeypatch):
    """Ray's temp directory in ``tmp_path`` (``RAY_TMPDIR``), no ``RAY_ADDRESS``."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    os.makedirs(tmp_path / "ray")
    return tmp_path


@contextlib.contextmanager
def listener(reply: bytes) -> Iterator[str]:
    """A loopback address whose server sends ``reply`` to each connection it accepts."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(reply)
                conn.recv(64)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        server.close()


@pytest.fixture
def live():
    """A loopback address where a server answers as a gRPC server does: with an HTTP/2 SETTINGS frame."""
    with listener(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])) as address:
        yield address


def dead() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def leave(address: str) -> str:
    with open(address_file(), "w") as f:
        f.write(address + "\n")
    return address_file()


def test_the_address_file_is_where_ray_start_leaves_it(ray_tmp):
    assert address_file() == str(ray_tmp / "ray" / "ray_current_cluster")


def test_with_no_file_the_default_starts_a_local_ray_and_auto_leaves_the_search_to_ray(ray_tmp):
    assert cluster_address(None) == "local"
    assert cluster_address("auto") == "auto"


def test_a_live_cluster_in_the_file_is_joined(ray_tmp, live):
    leave(live)
    assert cluster_address(None) == live
    assert cluster_address("auto") == live


def test_a_stale_file_is_skipped_with_one_warning_naming_address_and_file(ray_tmp, caplog):
    gone = dead()
    path = leave(gone)
    with caplog.at_level(logging.WARNING, logger="rayckpt.ray.joining"):
        assert cluster_address(None) == "local"
    [record] = caplog.records
    assert gone in record.getMessage() and path in record.getMessage()
    assert "stopped without `ray stop`" in record.getMessage()


def test_auto_with_a_stale_file_fails_saying_what_to_do(ray_tmp):
    gone = dead()
    path = leave(gone)
    with pytest.raises(ClusterUnreachableError) as exc:
        cluster_address("auto")
    assert str(exc.value) == (
        f"--address auto: the cluster last started on this machine ({gone}, from {path}) does not answer; "
        "start one (ray start --head), remove that file, or pass --address local for a new local Ray"
    )


def test_an_address_named_that_does_not_answer_is_refused_naming_where_it_came_from(ray_tmp, monkeypatch, live):
    gone = dead()
    with pytest.raises(ClusterUnreachableError, match=rf"the Ray cluster at {gone} \(from --address\) does not"):
        cluster_address(gone, timeout_s=0.5)
    assert cluster_address(live) == live
    monkeypatch.setenv("RAY_ADDRESS", gone)
    with pytest.raises(ClusterUnreachableError, match=rf"the Ray cluster at {gone} \(from RAY_ADDRESS\)"):
        cluster_address(None, timeout_s=0.5)
    monkeypatch.setenv("RAY_ADDRESS", live)
    assert cluster_address("auto") == live


def test_local_and_urls_are_passed_through_untouched(ray_tmp):
    leave(dead())
    assert cluster_address("local") == "local"
    assert cluster_address("ray://head:10001") == "ray://head:10001"
    with pytest.raises(ClusterUnreachableError, match="not-an-address"):
        cluster_address("not-an-address", timeout_s=0.5)


def test_a_port_that_accepts_but_is_no_grpc_server_does_not_count(live):
    assert answers(live)
    with listener(b"HTTP/1.1 400 Bad Request\r\n\r\n") as other:
        assert not answers(other, timeout_s=1.0)
    with listener(b"") as silent:
        assert not answers(silent, timeout_s=0.5)
