"""The first save and load of a fresh process pay only for what they use: pyarrow's numpy conversions import
pandas when it is installed (0.4 s inside the first commit), a list column's ``flatten()`` imports
pyarrow.compute (75 ms inside the first manifest read), and rayckpt avoids them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_a_fresh_process_saves_and_loads_without_importing_pandas_or_pyarrow_compute(tmp_path):
    has_pandas = subprocess.run([sys.executable, "-c", "import pandas"], capture_output=True, check=False)
    assert has_pandas.returncode == 0, "pandas is installed here (ray[train] brings it): the check means something"
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        import rayckpt

        state = {{"w": torch.arange(1000.0), "nested": {{"b": torch.ones(3)}}, "step": 4}}
        rayckpt.save(state, {str(tmp_path / "c")!r})
        target = {{"w": torch.zeros(1000), "nested": {{"b": torch.zeros(3)}}, "step": 0}}
        rayckpt.load(target, {str(tmp_path / "c")!r})
        assert torch.equal(target["w"], state["w"]) and target["step"] == 4
        rayckpt.read_manifest({str(tmp_path / "c")!r})
        print("pandas" in sys.modules, "pyarrow.compute" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False False"


def modules_after(code: str) -> set[str]:
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_importing_rayckpt_after_torch_imports_the_engine_so_the_first_call_does_not():
    loaded = modules_after("import torch\nimport rayckpt")
    assert {"rayckpt.engine.save", "rayckpt.engine.load", "pyarrow", "xxhash"} <= loaded
    assert "ray" not in loaded  # the engine only: Ray comes with the Ray layer


def test_importing_rayckpt_without_torch_stays_cheap():
    loaded = modules_after("import rayckpt")
    assert not {"torch", "pyarrow", "rayckpt.engine", "rayckpt.engine.save"} & loaded
