"""``CheckpointDir``'s directory handling on local disks and object stores."""

from __future__ import annotations

import pyarrow.fs as pafs

from rayckpt.storage.checkpoint_dir import CheckpointDir, _single_put_filesystem


def test_delete_dir_if_empty_removes_only_an_empty_directory(tmp_path):
    ckdir = CheckpointDir.resolve(tmp_path / "ckpt")
    ckdir.makedirs()
    (tmp_path / "ckpt" / "sub").mkdir()
    ckdir.delete_dir_if_empty()  # no file, but a subdirectory: kept, with what is in it
    assert (tmp_path / "ckpt" / "sub").is_dir()
    ckdir.child("sub").delete_dir_if_empty()
    ckdir.delete_dir_if_empty()
    assert not (tmp_path / "ckpt").exists()


def test_object_stores_get_no_directories_and_s3_writes_small_objects_in_one_put():
    s3 = pafs.S3FileSystem(
        endpoint_override="127.0.0.1:1", scheme="http", access_key="a", secret_key="b", region="us-east-1"
    )
    ckdir = CheckpointDir(s3, "bucket/run/step", "s3://bucket/run/step")
    assert ckdir.is_object_store and not CheckpointDir.resolve("/tmp").is_object_store
    ckdir.makedirs()  # no request at all (the endpoint does not exist)
    twin = _single_put_filesystem(s3)
    assert twin.__reduce__()[1][0]["allow_delayed_open"] is True
    assert twin.__reduce__()[1][0]["endpoint_override"] == "127.0.0.1:1"
    assert _single_put_filesystem(twin) is twin
    local = pafs.LocalFileSystem()
    assert _single_put_filesystem(local) is local
