"""The GPU path on a real CUDA device: FSDP2 with nccl, loads into CUDA targets, staging from device memory,
saves whose copies run on a side stream beside the next step.

Skipped where no CUDA device is visible (CI, the CPU machines); run with
``pytest tests/gpu`` on a GPU machine. With one GPU, nccl groups have one rank
(nccl refuses two ranks on one device) and resharding is checked across device
types: saved by nccl ranks on the GPU, loaded by gloo ranks on the CPU, and back.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

import rayckpt
from rayckpt.engine import device
from rayckpt.engine.app_state import AppState
from rayckpt.engine.device import HostToDevice
from rayckpt.errors import SaveFailedError
from rayckpt.ray.rank import async_save, staging
from rayckpt.ray.rank.staging import StagingBuffer
from rayckpt.ray.writer.regions import open_region
from rayckpt.testing.multiproc import run_ranks
from rayckpt.testing.toy import full_state
from tests.helpers import gpu_workers
from tests.helpers.copy_gate import CopyGate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
BACKEND = {"cuda": "nccl", "cpu": "gloo"}


def run_on(fn, world_size: int, path: str, dev: str) -> list:
    return run_ranks(fn, world_size, path, dev, backend=BACKEND[dev])


def check_exact(loaded: list, saved: dict, dev: str, same_device: bool) -> None:
    # outputs computed on another device type round differently: a looser tolerance there
    rtol, atol = (1e-5, 1e-7) if same_device else (1e-4, 1e-5)
    for rank, result in enumerate(loaded):
        assert result["state"].keys() == saved["state"].keys()
        for key, value in result["state"].items():
            assert torch.equal(value, saved["state"][key]), f"{key} differs on rank {rank}"
        assert torch.allclose(result["output"], saved["output"], rtol=rtol, atol=atol), "outputs MATCH"
        assert result["step"] == 3 and result["devices"] == [dev]


CASES = [("cuda", 1, "cuda", 1), ("cuda", 1, "cpu", 2), ("cuda", 1, "cpu", 3), ("cpu", 3, "cuda", 1)]
if GPUS >= 2:
    CASES += [("cuda", 2, "cuda", 1), ("cuda", 1, "cuda", 2), ("cuda", 2, "cuda", 2), ("cpu", 4, "cuda", 2)]


@pytest.mark.parametrize(("save_dev", "n", "load_dev", "m"), CASES)
def test_fsdp2_on_cuda_saves_and_reshards_bit_exact(tmp_path, save_dev, n, load_dev, m):
    path = str(tmp_path / "ck")
    saved = run_on(gpu_workers.save_on, n, path, save_dev)[0]
    check_exact(run_on(gpu_workers.load_on, m, path, load_dev), saved, load_dev, save_dev == load_dev)


def cuda_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(1000, 257, generator=g).cuda(),
        "half": torch.randn(33, 7, generator=g).to(torch.bfloat16).cuda(),
        "t": torch.randn(40, 30, generator=g).cuda().t(),  # strided on the device
        "step": 5,
    }


def test_a_load_into_cuda_targets_goes_through_bounded_pinned_slots(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    state = cuda_state()
    rayckpt.save(state, path, block_size=4096)
    monkeypatch.setattr(device, "BOUNCE_BYTES", 64 * 1024)
    peaks: list[int] = []
    finish = HostToDevice.finish
    monkeypatch.setattr(HostToDevice, "finish", lambda self: peaks.append(self.peak_slot_bytes) or finish(self))
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    target["t"] = torch.zeros(40, 30, device="cuda").t()
    rayckpt.load(target, path)
    for key in ("w", "half", "t"):
        assert target[key].is_cuda and torch.equal(target[key], state[key]), key
    assert target["step"] == 5 and peaks and 0 < max(peaks) <= 64 * 1024


def test_a_save_of_cuda_tensors_loads_bit_exact_on_the_cpu(tmp_path):
    path = str(tmp_path / "ck")
    state = cuda_state()
    rayckpt.save(state, path)
    target = {"w": torch.zeros(1000, 257), "half": torch.zeros(33, 7, dtype=torch.bfloat16), "t": torch.zeros(30, 40)}
    rayckpt.load(target, path)
    for key in ("w", "half", "t"):
        assert torch.equal(target[key], state[key].cpu()), key


def test_staging_from_cuda_pins_the_buffer_and_holds_the_bytes():
    pieces = [cuda_state()["w"], cuda_state()["t"]]
    buf = StagingBuffer()  # in the staging directory (tmpfs), as every save's: Linux pins no file mapping elsewhere
    try:
        region = buf.stage(pieces, "node")
        assert buf._pinned != 0  # the mapping is page-locked: the device copies ran asynchronously
        with open_region(region) as views:
            for view, p in zip(views, pieces):
                assert bytes(view) == p.contiguous().cpu().numpy().tobytes()
        buf.stage(pieces, "node")  # reused: still the same pinned mapping
        assert buf._pinned != 0
    finally:
        buf.close()
    assert buf._pinned == 0


def test_prepare_pins_the_buffer_for_cuda_in_the_background():
    pieces = [cuda_state()["w"], cuda_state()["t"]]
    buf = StagingBuffer()
    try:
        buf.prepare(staging.staged_size(pieces), pin=pieces[0].device)
        buf.ready()
        assert buf._pinned != 0  # page-locked by the background thread, for the pieces' device
        region = buf.stage(pieces, "node")
        with open_region(region) as views:
            for view, p in zip(views, pieces):
                assert bytes(view) == p.contiguous().cpu().numpy().tobytes()
    finally:
        buf.close()
    assert buf._pinned == 0


def test_a_buffer_cuda_refuses_to_pin_warns_once_and_later_kernels_still_run(tmp_path, monkeypatch, caplog):
    """Seen on an H200: a staging file on a disk (not tmpfs) cannot be page-locked, and the refused
    ``cudaHostRegister`` left its error for the next kernel launch, which failed with ``invalid argument``."""
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if fs in ("tmpfs", "hugetlbfs"):
        pytest.skip(f"{tmp_path} is on {fs}: CUDA pins its mappings")
    tries = []
    pin = staging.pin_host_memory
    monkeypatch.setattr(staging, "pin_host_memory", lambda m, d: tries.append(d) or pin(m, d))
    pieces = [cuda_state()["w"], cuda_state()["t"]]
    buf = StagingBuffer(str(tmp_path))
    try:
        with caplog.at_level("WARNING", logger="rayckpt.engine.device"):
            for _ in range(2):
                region = buf.stage(pieces, "node")
                after = (pieces[1] * 2).contiguous()  # a kernel launch on this thread: it raised before the fix
                assert torch.equal(after.cpu(), pieces[1].cpu() * 2)
                with open_region(region) as views:
                    for view, p in zip(views, pieces):
                        assert bytes(view) == p.contiguous().cpu().numpy().tobytes()
        assert buf._pinned == 0 and buf.pin_refused and len(tries) == 1  # not tried again
        warned = [r.getMessage() for r in caplog.records if "could not be page-locked" in r.getMessage()]
        assert len(warned) == 1 and "tmpfs" in warned[0] and "RAYCKPT_SHM_DIR" in warned[0]
    finally:
        buf.close()


def test_a_prepared_first_async_save_from_cuda_stages_into_the_pinned_buffer(ray_session, tmp_path):
    state = {"w": torch.randn(2048, 2048, device="cuda"), "step": 1}
    async_save.release_staging()
    async_save.prepare_staging(state, wait=True)
    assert async_save.saver().buffer._pinned != 0
    handle = async_save.save_async(state, str(tmp_path / "p"), run="gpu-prep", step=1)
    assert handle.staging == "shm" and handle.wait().status == "committed"
    target = {"w": torch.zeros(2048, 2048, device="cuda"), "step": 0}
    rayckpt.load(target, str(tmp_path / "p"))
    assert torch.equal(target["w"], state["w"])


def test_async_save_from_cuda_stall_measured_by_cuda_events(ray_session, tmp_path):
    state = {"w": torch.randn(4096, 4096, device="cuda"), "step": 1}  # 64 MiB on the device
    path = str(tmp_path / "a")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    handle = async_save.save_async(state, path, run="gpu", step=1, staging="shm")
    end.record()
    end.synchronize()
    stall_ms = start.elapsed_time(end)
    print(f"async save of 64 MiB from CUDA: stall {stall_ms:.2f} ms (CUDA events), {handle.stall_seconds:.4f} s (host)")
    assert stall_ms >= 0 and handle.wait().status == "committed"
    target = {"w": torch.zeros(4096, 4096, device="cuda"), "step": 0}
    rayckpt.load(target, path)
    assert torch.equal(target["w"], state["w"]) and target["step"] == 1


def trained_on(dev: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP on ``dev`` with AdamW, one step in (the optimizer holds its moments)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).to(dev)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    one_step(model, optim, seed)
    return model, optim


def one_step(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).device)
    optim.zero_grad()
    model(x).pow(2).mean().backward()
    optim.step()


def test_an_overlapped_save_from_cuda_is_copied_beside_the_next_step_which_waits_for_it(
    ray_session, tmp_path, monkeypatch
):
    model, optim = trained_on("cuda", seed=0)
    ema = torch.randn(300, 7, device="cuda")  # not the optimizer's: copied before save_async returns
    gate = CopyGate(optim, patch=monkeypatch.setattr)  # the copy's wait on the side stream, held to the next step
    app = AppState(model, optim, ema=ema)  # guards the optimizer: its step waits for the copy, after the gate opens
    gate.close()
    handle = async_save.save_async({"app": app}, str(tmp_path / "ck"), run="gpu-overlap", step=1)
    expected = full_state(app)  # on the CPU, taken before the next step
    optim_bytes = sum(t.nbytes for t in model.parameters()) + sum(
        v.nbytes for s in optim.state.values() for v in s.values()
    )
    assert handle.late_bytes == optim_bytes and not handle.copied()
    ema.add_(1)  # its bytes are in the buffer already
    one_step(model, optim, seed=1)  # the forward and backward beside the copy; the step waits for it
    assert handle.copied() and handle.copy_seconds is not None
    assert handle.wait().status == "committed"
    target_model, target_optim = trained_on("cpu", seed=1)
    target = AppState(target_model, target_optim, ema=torch.zeros(300, 7))
    rayckpt.load({"app": target}, str(tmp_path / "ck"))
    loaded = full_state(target)
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    assert not torch.equal(expected["app.model.0.weight"], model[0].weight.detach().cpu())  # the step went on


def test_a_parameter_changed_in_place_before_its_copy_from_cuda_is_done_fails_the_save(
    ray_session, tmp_path, monkeypatch
):
    model, optim = trained_on("cuda", seed=0)
    gate = CopyGate(optim, patch=monkeypatch.setattr)
    app = AppState(model, optim)
    gate.close()
    handle = async_save.save_async({"app": app}, str(tmp_path / "ck"), run="gpu-torn", step=1)
    with torch.no_grad():
        model[0].weight.mul_(2)  # not by the optimizer's step: nothing waits for the copy
    gate.open.set()
    with pytest.raises(SaveFailedError, match=r"key 'app\.model\.0\.weight' was changed in place"):
        handle.wait()
    assert not (tmp_path / "ck" / "manifest.json").exists()
