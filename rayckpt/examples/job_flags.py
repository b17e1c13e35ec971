"""The main job's flags: ``--help``, parsing, and what ``parse_args`` checks before anything starts.

``parse_args`` turns ``--num-workers N`` or ``MIN-MAX`` into ``args.min_workers``
and ``args.num_workers`` (the most workers), and refuses what cannot work with
one line naming the flag (``job_checks.check_flags``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from .gpt import GPTConfig
from .job_checks import JobConfigError, check_flags

__all__ = ["build_parser", "parse_args", "worker_range", "workers_asked"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in ``--help``; a flag defaulting to ``None`` says in its help what it means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The job's flags; ``--help`` shows each one's default."""
    p = argparse.ArgumentParser(
        description="Train a small GPT with FSDP2 on Ray Train, checkpointed by rayckpt.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--num-workers",
        type=worker_range,
        default="4",
        metavar="N|MIN-MAX",
        help="Ray Train workers (ranks): N, or MIN-MAX for an elastic run that goes on with fewer workers when a "
        "node dies and grows back at Ray Train's resize",
    )
    p.add_argument(
        "--max-failures",
        type=int,
        default=3,
        help="worker or node failures Ray Train recovers from by restarting the workers, which restore the "
        "newest committed checkpoint (0: stop at the first failure; -1: no limit)",
    )
    p.add_argument("--steps", type=int, default=20, help="total steps to reach (a resumed run continues to it)")
    p.add_argument(
        "--schedule-steps",
        type=int,
        default=None,
        help="length of the warmup + cosine LR schedule (default: --steps of the run's first launch; a resumed "
        "run keeps the stored one unless this is given)",
    )
    _checkpoint_flags(p)
    _cluster_flags(p)
    _model_flags(p)
    return p


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """The flags of what is saved, how often and where, and of resuming."""
    p.add_argument(
        "--checkpoint-every",
        "--persist-every",
        dest="checkpoint_every",
        type=int,
        default=5,
        help="save to storage every K steps and at the last step",
    )
    p.add_argument(
        "--memory-every",
        type=int,
        default=1,
        help="under Ray, save to the nodes' memory (each node's share also held by a peer node) every M steps "
        "between the storage saves; a restart restores the newest checkpoint, memory or storage (0: off)",
    )
    p.add_argument(
        "--full-every",
        type=int,
        default=0,
        metavar="K",
        help="storage saves write only the chunks that changed since the last one (incremental); every K-th "
        "writes everything (0: never; 1: every save self-contained)",
    )
    p.add_argument(
        "--keep",
        type=int,
        default=3,
        metavar="N",
        help="checkpoints kept per run: Ray Train removes older ones (CheckpointConfig(num_to_keep=N))",
    )
    p.add_argument(
        "--timeline",
        metavar="FILE.png",
        help="at the end, draw the run's checkpoint timeline into FILE.png (as `rayckpt status --plot`)",
    )
    p.add_argument("--storage-path", default="./checkpoints", help="run storage: a directory or a URI (s3://...)")
    p.add_argument("--run-name", default="gpt-demo", help="the run: a directory under --storage-path")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        action="store_true",
        help="continue the run's latest committed checkpoint, with any worker count; fails if it has none",
    )
    resume.add_argument(
        "--resume-if-exists",
        action="store_true",
        help="continue the run's latest committed checkpoint if there is one, else start fresh",
    )


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    """The flags of where the job runs: the cluster, GPUs, CPUs per worker."""
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join, as ray.init(address=...): HOST:PORT, 'auto' (a running cluster or fail), "
        "'local' (always a new one); default: RAY_ADDRESS, else the cluster last started on this machine with "
        "'ray start' (skipped with a warning when it does not answer), else a new local Ray; an address that "
        "does not answer within seconds is refused",
    )
    p.add_argument("--gpus", action="store_true", help="one GPU per worker with nccl (default: CPU with gloo)")
    p.add_argument(
        "--cpus-per-worker",
        type=float,
        default=None,
        help="CPUs each worker reserves (default: 1 for CPU training, less when the cluster has fewer CPUs than "
        "workers; none with --gpus)",
    )
    p.add_argument(
        "--skip-resource-check",
        action="store_true",
        help="submit even when the cluster's resources now cannot hold the workers (an autoscaling cluster)",
    )


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The model's and the optimizer's flags (defaults: ``GPTConfig``'s)."""
    defaults = GPTConfig()
    p.add_argument("--d-model", type=int, default=defaults.d_model, help="model width")
    p.add_argument("--n-layers", type=int, default=defaults.n_layers, help="transformer blocks")
    p.add_argument("--n-heads", type=int, default=defaults.n_heads, help="attention heads (must divide --d-model)")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per sample")
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size, help="vocabulary size")
    p.add_argument("--d-ff", type=int, default=None, help="MLP width (default: 4 * d-model)")
    p.add_argument(
        "--global-batch", type=int, default=12, help="samples per step over all workers; a multiple of --num-workers"
    )
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (linear warmup, cosine decay)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data")
    p.add_argument(
        "--data",
        choices=("corpus", "synthetic"),
        default="corpus",
        help="corpus: byte-level windows of Python's help text (pydoc_data), shuffled each epoch, resumed "
        "exactly under any worker count; synthetic: arithmetic sequences drawn per step",
    )
    p.add_argument(
        "--epoch-samples",
        type=int,
        default=144,
        metavar="N",
        help="with --data corpus: the first N windows of the corpus make an epoch (0: every window)",
    )
    p.add_argument(
        "--sample-log",
        metavar="DIR",
        default=None,
        help="with --data corpus: each worker appends the sample ids of each step it runs to DIR/samples-*.jsonl",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check every flag (``SystemExit`` with one line naming the flag when one is wrong)."""
    p = build_parser()
    args = p.parse_args(argv)
    args.min_workers, args.num_workers = args.num_workers
    try:
        check_flags(args)
    except JobConfigError as exc:
        p.error(str(exc))
    if "://" not in args.storage_path:
        args.storage_path = os.path.abspath(args.storage_path)
    return args


def worker_range(text: str) -> tuple[int, int]:
    """``--num-workers``: ``"4"`` -> ``(4, 4)``; ``"2-4"`` -> ``(2, 4)`` (an elastic run)."""
    low, sep, high = text.partition("-")
    try:
        counts = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count N or a range MIN-MAX, got {text!r}") from None
    return counts


def workers_asked(args: argparse.Namespace) -> int | tuple[int, int]:
    """``ScalingConfig.num_workers``: a count, or ``(min, max)`` for an elastic run."""
    return args.num_workers if args.min_workers == args.num_workers else (args.min_workers, args.num_workers)
