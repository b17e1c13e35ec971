"""A local filesystem whose shard-file writes wait at a gate: pauses a ShardWriter mid-save, deterministically.

``gated_filesystem(gate)`` is a ``pyarrow.fs.PyFileSystem`` over the local disk
(picklable, so it travels to the actors with the save). Opening a ``.arrow``
file for writing first creates ``<gate>.reached`` (the test waits for it: the
save is then staged and registered, its writer blocked), then waits until the
file ``<gate>`` exists (the test creates it to let the writer go on). Each path that reached
the gate is appended to ``<gate>.reached``, one a line, so a test can wait for one rank's file.
``gated_filesystem(gate, match)`` gates only the ``.arrow`` files whose path contains ``match``
(say one checkpoint's directory name); the others pass. ``gated_filesystem({match: gate, ...})``
gates several checkpoints, each at its own gate.
"""

from __future__ import annotations

import os
import time

import pyarrow.fs as pafs

#: A writer never waits longer than this (a test that failed must not leave it blocked).
MAX_WAIT_S = 300.0


class GatedHandler(pafs.FileSystemHandler):
    def __init__(self, gate: str | dict[str, str], match: str = "") -> None:
        #: (match, gate) pairs: a path containing ``match`` waits at ``gate``.
        self.gates = tuple(sorted(gate.items())) if isinstance(gate, dict) else ((match, gate),)
        self.local = pafs.LocalFileSystem()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GatedHandler) and other.gates == self.gates

    def __ne__(self, other: object) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return "gated"

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.local.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("refusing to empty the root directory")

    def delete_file(self, path: str) -> None:
        self.local.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.local.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.local.copy_file(src, dest)

    def open_input_stream(self, path: str):
        return self.local.open_input_stream(path)

    def open_input_file(self, path: str):
        return self.local.open_input_file(path)

    def open_output_stream(self, path: str, metadata):
        gate = next((g for match, g in self.gates if match in path), None) if path.endswith(".arrow") else None
        if gate is not None:
            with open(f"{gate}.reached", "a") as f:
                f.write(path + "\n")
            deadline = time.monotonic() + MAX_WAIT_S
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.local.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata):
        return self.local.open_append_stream(path, metadata=metadata)


def gated_filesystem(gate: str | dict[str, str], match: str = "") -> pafs.PyFileSystem:
    return pafs.PyFileSystem(GatedHandler(gate, match))


def wait_for_file(path: str, what: str, limit_s: float = 120.0) -> None:
    """Wait until ``path`` exists (a test's bound, not a timing: fails only if it never comes)."""
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{what}: {path} did not appear within {limit_s}s"
        time.sleep(0.05)
