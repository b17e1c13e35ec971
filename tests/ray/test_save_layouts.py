"""On a real local Ray: the MetadataActor receives a save's layout once per layout, not once per save.

Saves of one layout register with its digest only, and the ShardWriter reports the rank's chunks
without their keys, boxes and files; a changed model sends the new layouts once; a restarted
MetadataActor (a real kill, Ray restarts it) fetches the save layout again from rank 0, asks the
writer for the chunk layout, and the save commits; a layout that cannot be fetched fails the
registration, naming the save.
The cache logic alone: tests/unit/test_layout_cache.py."""

from __future__ import annotations

import pytest
import ray
import torch

import rayckpt
from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.ray.metadata.layout_cache import LayoutRef
from rayckpt.ray.rank import async_save
from rayckpt.ray.records import SaveTarget
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import SaveSpec, read_manifest
from tests.faults.test_actor_restart import restart_metadata_actor

pytestmark = pytest.mark.slow


def state(seed: int, layers: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}": {"w": torch.randn(40 + i, 8, generator=g)} for i in range(layers)}
    return {"model": model, "step": seed}


def layout_counts() -> dict[str, int]:
    stats = ray.get(get_metadata_actor().debug_stats.remote())
    names = ("layout_saves", "layouts_received", "chunk_layout_reports", "chunk_layouts_received")
    return {k: stats[k] for k in names}


def delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in layout_counts().items()}


def save(root, step: int, layers: int) -> str:
    path = str(root / f"rayckpt-step-{step:08d}")
    entry = async_save.save_async(state(step, layers), path, run="layouts", step=step).wait()
    assert entry.status == "committed" and entry.step == step
    return path


def assert_loads(path: str, step: int, layers: int) -> None:
    out = {"model": {f"layer{i}": {"w": torch.zeros(40 + i, 8)} for i in range(layers)}, "step": -1}
    rayckpt.load(out, path)
    expected = state(step, layers)
    assert out["step"] == step
    for i in range(layers):
        assert torch.equal(out["model"][f"layer{i}"]["w"], expected["model"][f"layer{i}"]["w"])


def test_the_actor_receives_each_layout_once_and_again_after_a_restart(ray_session, tmp_path):
    before = layout_counts()
    paths = [save(tmp_path, step, layers=5) for step in (1, 2, 3)]
    assert delta(before) == {
        "layout_saves": 3,
        "layouts_received": 1,
        "chunk_layout_reports": 3,
        "chunk_layouts_received": 1,
    }
    # the manifest committed from the digest alone describes the state as the first save's does
    first, last = (read_manifest(CheckpointDir.resolve(p)) for p in (paths[0], paths[2]))
    assert last.entries.keys() == first.entries.keys() and last.user_metadata == {"step": 3, "run": "layouts"}
    for key, entry in first.entries.items():
        if hasattr(entry, "dtype"):
            assert (last.entries[key].dtype, last.entries[key].shape, last.path(key)) == (
                entry.dtype,
                entry.shape,
                first.path(key),
            )
    assert_loads(paths[2], 3, layers=5)

    save(tmp_path, 4, layers=6)  # another model: its layout goes once more
    save(tmp_path, 5, layers=6)
    assert delta(before) == {
        "layout_saves": 5,
        "layouts_received": 2,
        "chunk_layout_reports": 5,
        "chunk_layouts_received": 2,
    }

    restart_metadata_actor()  # the new incarnation holds no layout: it fetches rank 0's, asks the writer's
    path = save(tmp_path, 6, layers=6)
    # the writer's report without the chunk layout was answered LAYOUT_WANTED, then sent with it
    expected = {"layout_saves": 1, "layouts_received": 1, "chunk_layout_reports": 2, "chunk_layouts_received": 1}
    assert layout_counts() == expected
    save(tmp_path, 7, layers=6)
    expected = {"layout_saves": 2, "layouts_received": 1, "chunk_layout_reports": 3, "chunk_layouts_received": 1}
    assert layout_counts() == expected
    assert_loads(path, 6, layers=6)


def test_a_layout_the_actor_cannot_fetch_fails_the_registration_naming_the_save(ray_session, tmp_path):
    spec = SaveSpec(save_id="sid-nolayout", world_size=1, block_size=64, tensors={}, values={})
    unknown = LayoutRef(b"\x07" * 16, ray.put("not a layout"))
    meta = get_metadata_actor()
    with pytest.raises(ray.exceptions.RayTaskError) as caught:
        target = SaveTarget(save_id=spec.save_id, run="nolayout", step=3, location=str(tmp_path / "n"))
        ray.get(meta.begin_save.remote(spec, target, 30.0, unknown))
    assert (
        "save sid-nolayout of run 'nolayout' (step 3): this MetadataActor does not hold its layout "
        f"{'07' * 16} and fetching it from rank 0 gave str"
    ) in str(caught.value)
