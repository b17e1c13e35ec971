"""``rayckpt status`` beside ``ray status``: the wall time of each, a fresh process asking one local cluster."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.common.cli import parser
from benchmarks.common.harness import (
    load_sampled,
    new_report,
    rotated,
    run_line,
    summary,
    table,
    timed,
    write_report,
)
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
    report = new_report("benchmarks.observe status", argv, repeats=args.repeats, times={})
    with (
        tempfile.TemporaryDirectory(prefix="rk-observe-") as tmp,
        ray_head(os.path.join(tmp, "ray"), num_cpus=2) as head,
    ):
        env = head.env
        seeder = subprocess.Popen(
            [sys.executable, "-c", SEED, head.address, os.path.join(tmp, "ckpt")],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            if seeder.stdout.readline().strip() != "seeded":
                raise RuntimeError("the seeding driver did not save")
            times: dict[str, list[float]] = {name: [] for name in COMMANDS}
            with load_sampled(report):
                for rep in range(args.repeats):
                    for name in rotated(list(COMMANDS), rep):
                        times[name].append(
                            timed(lambda name=name: run_command(COMMANDS[name] + [head.address], env))[0]
                        )
            report["times"] = {name: summary(values) for name, values in times.items()}
        finally:
            seeder.stdin.close()
            seeder.wait(timeout=60)
    return report


def markdown(report: dict[str, Any]) -> str:
    t = report["times"]
    lines = ["# `rayckpt status` beside `ray status`", "", run_line(report), ""]
    lines += [
        f"{report['repeats']} rounds, order rotated; a fresh process each, one local cluster with a run of two "
        "committed checkpoints.",
        "",
    ]
    rows = [[f"`{name}`", f"{s['median']:.2f}", f"{s['min']:.2f}", f"{s['max']:.2f}"] for name, s in t.items()]
    lines += table(["command", "median (s)", "min (s)", "max (s)"], rows)
    ratio = t["rayckpt status"]["median"] / t["ray status"]["median"]
    return "\n".join([*lines, "", f"`rayckpt status` / `ray status`, medians: **{ratio:.2f}x**.", ""])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser(__doc__, "observe")
    p.add_argument("--repeats", type=int, default=15, help="rounds of both commands")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    report = run(args, argv)
    write_report(args.out, "status", report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
