"""The memory tier under TorchTrainer on a real local Ray (one node): saves to the ShardWriter's memory between
storage saves, restores that prefer them, a flipped byte passed over, a budget that sends saves to storage
(warned once); the room of the node's shared memory, less its object store's."""

from __future__ import annotations

import os
import posixpath
import shutil

import numpy as np
import pytest
import ray
import torch

import rayckpt
from rayckpt.data import DataPosition
from rayckpt.ray.memory.fs import memory_filesystem
from rayckpt.ray.shm import SHM_DIR, shm_room
from rayckpt.ray.writer.actor import get_shard_writer
from rayckpt.storage.checkpoint_dir import CheckpointDir
from tests.helpers.ray_train import fit, memory_steps
from tests.helpers.ray_workers import DATA_LEN
from tests.helpers.sample_log import check_exactly_once, read_steps

pytestmark = pytest.mark.slow


def step_dirs(storage, run: str) -> list[str]:
    return sorted(n for n in os.listdir(storage / run) if n.startswith("rayckpt-step-"))


def flip_a_byte(path: str, offset: int) -> None:
    """Flip the byte at ``offset`` of the held copy of the memory-tier file ``path``."""
    writer = get_shard_writer()
    size = ray.get(writer.mem_stat.remote([path]))[path]
    data = bytearray(ray.get(writer.mem_read.remote(path, 0, size)))
    data[offset] ^= 0xFF
    ray.get(writer.mem_put.remote(path, np.frombuffer(bytes(data), dtype=np.uint8)))


def test_memory_saves_restore_first_and_a_flipped_byte_falls_back_to_the_one_before(ray_session, tmp_path):
    storage, first, second = tmp_path / "storage", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    # steps 1-5 on 2 workers: storage at 3, memory at every other step, the newest 2 kept
    fit(storage, first, 2, 5, {3}, name="mem", memory_every=1, dump_saves=True)
    assert step_dirs(storage, "mem") == ["rayckpt-step-00000003"]
    assert memory_steps("mem") == [4, 5]
    assert not any("-mem-" in n for n in os.listdir("/dev/shm"))  # held unlinked: nothing to leak by name

    step5 = "mem/mem/rayckpt-step-00000005"
    manifest = rayckpt.read_manifest(CheckpointDir(memory_filesystem(), step5, step5))
    chunk = next(e for e in manifest.entries.values() if hasattr(e, "chunks")).chunks[0]  # data a restore reads
    shard = chunk.file
    flip_a_byte(posixpath.join(step5, shard), chunk.byte_offset + chunk.byte_length // 2)

    fit(storage, second, 2, 6, {6}, name="mem", memory_every=1)
    restored = torch.load(second / "restored-2.pt", weights_only=False)
    # step 5 in memory fails its checksum: step 4, in memory too, not step 3 in storage
    assert restored["step"] == 4 and restored["restored_from"]["tier"] == "memory"
    assert restored["restored_from"]["peer_bytes"] == 0  # one node: every byte from its own memory
    (fallback,) = restored["fallbacks"]
    assert fallback["step"] == 5 and fallback["next_step"] == 4 and "checksum" in fallback["reason"]
    assert shard in fallback["reason"]
    expected = torch.load(first / "state-4.pt", weights_only=False)["state"]
    for key, value in expected.items():
        assert torch.equal(restored["state"][key], value), key
    # the data went on from the memory checkpoint's position (step 4), not step 3's: every sample once
    for log in first.glob("samples-*"):
        shutil.copy(log, second)
    final = rayckpt.read_manifest(CheckpointDir.resolve(str(storage / "mem" / "rayckpt-step-00000006")))
    steps = read_steps(second)
    assert steps[5].attempt != steps[4].attempt  # step 5 as the restored run ran it
    check_exactly_once(steps, DATA_LEN, DataPosition.from_json(final.data_position, "step 6"))


def test_a_save_the_memory_budget_cannot_hold_goes_to_storage_with_a_warning(ray_session, tmp_path, capfd):
    storage, out = tmp_path / "storage", tmp_path / "out"
    out.mkdir()
    writer = get_shard_writer()
    budget = ray.get(writer.mem_budget.remote())
    ray.get(writer.mem_budget.remote(1))
    try:
        fit(storage, out, 2, 3, {3}, name="tight", memory_every=1)
    finally:
        ray.get(writer.mem_budget.remote(budget))
    # steps 1 and 2 went to storage instead (Ray Train's num_to_keep=2 has removed step 1 since)
    assert step_dirs(storage, "tight") == [f"rayckpt-step-{s:08d}" for s in (2, 3)]
    assert memory_steps("tight") == []
    seen = ""
    for _ in range(60):
        out_text, err_text = capfd.readouterr()
        seen += out_text + err_text
        if "rayckpt: tight committed step 3" in seen:  # rank 0's last line: its lines before it came too
            break
        ray.get(writer.mem_room.remote())  # a pause that lets Ray forward the workers' logs
    # Once for the shortage, not once per step: step 2 went to storage without another warning.
    assert seen.count("goes to storage, not memory") == 1, seen[-3000:]
    assert "rayckpt: run tight: step 1 goes to storage, not memory: node " in seen, seen[-3000:]
    assert "bytes of its memory budget left and needs" in seen


def test_shared_memory_room_leaves_the_node_s_object_store_its_room_on_its_filesystem_only(ray_session, tmp_path):
    node = ray.get_runtime_context().get_node_id()
    store = next(int(n["Resources"]["object_store_memory"]) for n in ray.nodes() if n["NodeID"] == node)
    for directory, reserved in ((SHM_DIR, store), (str(tmp_path), 0)):
        if reserved == 0 and os.stat(directory).st_dev == os.stat(SHM_DIR).st_dev:
            continue  # tmp_path on the same tmpfs: nothing to tell apart
        # Other processes may write to the filesystem meanwhile: the room lies between the free space before
        # and after, less the reserve.
        before, room, after = free_bytes(directory), shm_room(directory), free_bytes(directory)
        assert min(before, after) - reserved <= room <= max(before, after) - reserved, (directory, room, store)


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
