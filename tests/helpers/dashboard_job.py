"""A driver with a local Ray of its own (``--temp-dir``, Ray's dashboard on): the MetadataActor installs rayckpt's
Grafana dashboard, is killed and restarted by Ray, and installs it again. Prints what it saw as one JSON line.

Run as its own process (``tests/ray/test_dashboard_install.py``): the test process's Ray is another one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import ray

from rayckpt.observe import dashboard
from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.ray.metadata.grafana import RAY_DEFAULT_DASHBOARD

WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def file_id(path: str) -> list[int] | None:
    """(inode, mtime) of ``path``: an install replaces the file, so either changes; None when absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_ino, st.st_mtime_ns]


def wait_for(what, until, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if until(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--temp-dir", required=True)
    args = parser.parse_args()
    ray.init(
        address="local",
        _temp_dir=args.temp_dir,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=free_port(),
        num_cpus=1,
        namespace="rayckpt-dashboard-test",
    )
    try:
        session = ray._private.worker.global_worker.node.get_session_dir_path()
        folder = dashboard.dashboards_folder(session)
        path = os.path.join(folder, dashboard.FILE_NAME)
        handle = get_metadata_actor()
        first_incarnation = ray.get(handle.incarnation.remote(), timeout=WAIT_S)
        first = wait_for(lambda: file_id(path), lambda v: v is not None)
        ray_default = wait_for(lambda: os.path.exists(os.path.join(folder, RAY_DEFAULT_DASHBOARD)), bool)
        listing_first = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        ray.kill(handle, no_restart=False)
        second_incarnation = wait_for(
            lambda: _incarnation(handle), lambda v: v is not None and v != first_incarnation, timeout=WAIT_S
        )
        second = wait_for(lambda: file_id(path), lambda v: v is not None and v != first)
        listing_second = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        print(
            json.dumps(
                {
                    "session": session,
                    "folder": folder,
                    "path": path,
                    "ray_default": ray_default,
                    "incarnations": [first_incarnation, second_incarnation],
                    "installs": [first, second],
                    "listing": [listing_first, listing_second],
                }
            ),
            flush=True,
        )
    finally:
        ray.shutdown()


def _incarnation(handle) -> str | None:
    try:
        return ray.get(handle.incarnation.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - restarting: ask again
        return None


if __name__ == "__main__":
    main()
