"""The shared S3 endpoint (``rayckpt.testing.s3_server``) and the counting server on it (``testbed.s3_counter``)."""

from __future__ import annotations

import os

import pytest

from rayckpt.testing.s3_server import start_moto_server
from testbed.s3_counter import counts_delta, read_counts

#: The server process imports ``testbed.s3_counter`` from the repository's root.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_delete_removes_every_object_under_a_prefix_and_nothing_else(s3_server, s3_prefix):
    fs = s3_server.filesystem()
    for rel in ("a/x.bin", "a/deep/y.bin", "b/z.bin"):
        with fs.open_output_stream(s3_server.fs_path(f"{s3_prefix}/{rel}")) as f:
            f.write(b"12345")
    s3_server.delete(f"{s3_prefix}/a")
    assert not s3_server.exists(f"{s3_prefix}/a")
    assert s3_server.listing(f"{s3_prefix}/b") == ["z.bin"]
    s3_server.delete(f"{s3_prefix}/never-written")  # nothing there: no error


@pytest.fixture(scope="module")
def counting_server(s3_env, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("counting") / "server.log")
    server = start_moto_server(log, "counted", module="testbed.s3_counter", env={"PYTHONPATH": REPO_ROOT})
    try:
        yield server.endpoint
    finally:
        server.stop()


def test_the_counting_server_counts_each_get_and_its_body_bytes(counting_server):
    fs = counting_server.filesystem()
    data = os.urandom(3 * 2**20 + 17)
    before = read_counts(counting_server.host_port)
    with fs.open_output_stream(counting_server.fs_path("obj.bin")) as f:
        f.write(data)
    written = read_counts(counting_server.host_port)
    with fs.open_input_file(counting_server.fs_path("obj.bin")) as f:
        assert f.read_at(1000, 2**20) == data[2**20 : 2**20 + 1000]
        assert f.read_at(2**20 + 5, 7) == data[7 : 2**20 + 12]
    after = read_counts(counting_server.host_port)

    put = counts_delta(before, written)
    assert sum(c["bytes_in"] for c in put.values()) >= len(data)
    assert "GET_object" not in put
    gets = counts_delta(written, after)["GET_object"]
    assert (gets["requests"], gets["ranged"], gets["aborted"], gets["bytes_out"]) == (2, 2, 0, 1000 + 2**20 + 5)
    assert gets["in_place"] == 2  # served from the range, not by moto's whole-object path


def test_the_counting_server_serves_s3fs_ranged_reads_in_place(counting_server):
    """s3fs (DCP's fsspec reader) sends If-Match with the object's ETag on its ranged reads."""
    s3fs = pytest.importorskip("s3fs")
    data = os.urandom(2**20)
    with counting_server.filesystem().open_output_stream(counting_server.fs_path("s3fs.bin")) as f:
        f.write(data)
    fs = s3fs.S3FileSystem(endpoint_url=f"http://{counting_server.host_port}", skip_instance_cache=True)
    before = read_counts(counting_server.host_port)
    with fs.open(counting_server.fs_path("s3fs.bin"), "rb", block_size=2**16) as f:
        f.seek(1000)
        assert f.read(5000) == data[1000:6000]
    gets = counts_delta(before, read_counts(counting_server.host_port))["GET_object"]
    assert gets["requests"] == gets["in_place"] >= 1
