"""``rayckpt status`` beside ``ray status``: the wall time of each, a fresh process asking one local cluster
that holds a run of two committed checkpoints, rounds in rotated order; seconds: median (min-max)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.common import cli
from benchmarks.common.harness import document, load_sampled, new_report, rotated, summary, table, timed, write_report
from testbed.ray_head import BIN, ray_head

COMMANDS = {
    "rayckpt status": [f"{BIN}/rayckpt", "status", "--address"],
    "ray status": [f"{BIN}/ray", "status", "--address"],
}

SEED = """
import sys, ray, torch
from rayckpt.ray import save_async
ray.init(address=sys.argv[1], namespace="rayckpt-bench", log_to_driver=False)
for step in (1, 2):
    save_async({"w": torch.randn(1024, 256)}, f"{sys.argv[2]}/rayckpt-step-{step:08d}", run="bench", step=step).wait()
print("seeded", flush=True)
sys.stdin.readline()  # held until the benchmark ends: the driver's job stays alive
"""


def run_command(cmd: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    report = new_report("benchmarks.observe status", argv, __doc__, config={"repeats": args.repeats}, times={})
    with (
        tempfile.TemporaryDirectory(prefix="rk-observe-") as tmp,
        ray_head(os.path.join(tmp, "ray"), num_cpus=2) as head,
    ):
        env, seed = head.env, [sys.executable, "-c", SEED, head.address, os.path.join(tmp, "ckpt")]
        seeder = subprocess.Popen(seed, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            if seeder.stdout.readline().strip() != "seeded":
                raise RuntimeError("the seeding driver did not save")
            times: dict[str, list[float]] = {name: [] for name in COMMANDS}
            with load_sampled(report):
                for rep in range(args.repeats):
                    for name in rotated(list(COMMANDS), rep):
                        command = [*COMMANDS[name], head.address]
                        times[name].append(timed(lambda command=command: run_command(command, env))[0])
            report["times"] = {name: summary(values) for name, values in times.items()}
        finally:
            seeder.stdin.close()
            seeder.wait(timeout=60)
    return report


def markdown(report: dict[str, Any]) -> str:
    t = report["times"]
    ratio = t["rayckpt status"]["median"] / t["ray status"]["median"]
    rows = [{"command": f"`{name}`", "seconds": s} for name, s in t.items()]
    ratio_line = f"`rayckpt status` / `ray status`, medians: **{ratio:.2f}x**."
    return document("`rayckpt status` beside `ray status`", report, table(rows), ratio_line)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = cli.parser(__doc__, "observe")
    p.add_argument("--repeats", type=int, default=15, help="rounds of both commands")
    args = cli.parse(p, argv)
    report = run(args, argv)
    return write_report(args, "status", report, markdown(report))
