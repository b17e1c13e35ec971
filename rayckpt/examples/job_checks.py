"""Up-front checks of the training job's request: the flags, the run to resume, the resources asked for.

They run before any training or submission work and fail with a ``JobConfigError``
whose message is one line: what was asked, what is there, which flag to change.
Ray-free: the resource check takes the cluster's resource dict
(``ray.cluster_resources()``), so tests feed it fake ones. ``check_storage``
asks an object store once whether the ``--storage-path`` bucket is there.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import pyarrow.fs as pafs

from ..errors import RayckptError
from ..redaction import redact_text
from ..storage.catalog import latest_committed, scan_run
from ..storage.checkpoint_dir import CheckpointDir

__all__ = [
    "JobConfigError",
    "check_flags",
    "check_resources",
    "check_resume",
    "check_shared_storage",
    "check_storage",
    "describe_runs",
    "worker_resources",
]

#: Flags that count something (``None``: left to a default).
_AT_LEAST_ONE = (
    "num_workers",
    "steps",
    "schedule_steps",
    "checkpoint_every",
    "keep",
    "global_batch",
    "d_model",
    "n_layers",
    "n_heads",
    "d_ff",
    "seq_len",
    "vocab_size",
)


class JobConfigError(ValueError):
    """The job's flags ask for something that cannot work; the message says which flag to change."""


def check_flags(args: argparse.Namespace) -> None:
    """Refuse every flag value and combination that cannot work (``parse_args`` calls it)."""
    for flag in _AT_LEAST_ONE:
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise JobConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    low = getattr(args, "min_workers", args.num_workers)
    if low < 1:
        raise JobConfigError(f"--num-workers must be at least 1, got {low}-{args.num_workers}")
    if low > args.num_workers:
        raise JobConfigError(f"--num-workers {low}-{args.num_workers}: MIN is larger than MAX")
    if getattr(args, "memory_every", 0) < 0:
        raise JobConfigError(f"--memory-every must be 0 (off) or at least 1, got {args.memory_every}")
    if getattr(args, "max_failures", 0) < -1:
        raise JobConfigError(f"--max-failures must be -1 (no limit) or at least 0, got {args.max_failures}")
    for flag in ("lr", "cpus_per_worker"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise JobConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    uneven = [n for n in range(low, args.num_workers + 1) if args.global_batch % n]
    if uneven and low == args.num_workers:
        raise JobConfigError(
            f"--global-batch {args.global_batch} is not divisible by --num-workers {args.num_workers}: "
            "every worker needs the same number of samples"
        )
    if uneven:
        raise JobConfigError(
            f"--global-batch {args.global_batch} is not divisible by {', '.join(map(str, uneven))} workers, which "
            f"the elastic --num-workers {low}-{args.num_workers} may run with: every worker needs the same number "
            "of samples (choose a batch divisible by every count in the range)"
        )
    if args.d_model % args.n_heads:
        raise JobConfigError(f"--n-heads {args.n_heads} does not divide --d-model {args.d_model}")
    if getattr(args, "data", "synthetic") == "corpus":
        from .corpus import BYTE_VOCAB

        if args.vocab_size < BYTE_VOCAB:
            raise JobConfigError(
                f"--data corpus reads bytes (ids 0-{BYTE_VOCAB - 1}): --vocab-size must be at least {BYTE_VOCAB}, "
                f"got {args.vocab_size}"
            )
        if args.epoch_samples < 0:
            raise JobConfigError(f"--epoch-samples must be 0 (every window) or more, got {args.epoch_samples}")


def check_storage(storage_path: str) -> None:
    """Refuse a ``--storage-path`` URI that cannot work, before Ray is touched (Ray Train would fail deep inside).

    A URI pyarrow cannot parse (a mistyped query parameter), an object store that
    does not answer (endpoint, credentials) or a bucket that is not there: one line
    naming the URI. Local paths are left to Ray Train, which creates them.
    """
    if "://" not in storage_path:
        return
    try:
        base = CheckpointDir.resolve(storage_path)
    except RayckptError as exc:
        raise JobConfigError(f"--storage-path: {exc}") from None
    if not base.is_object_store:
        return
    bucket = base.fs_path.strip("/").split("/", 1)[0]
    try:
        found = base.fs.get_file_info(bucket).type == pafs.FileType.Directory
    except OSError as exc:
        reason = redact_text(" ".join(str(exc).split()))
        raise JobConfigError(
            f"--storage-path {base.location}: cannot reach bucket {bucket!r}: {reason}; check the endpoint "
            "(endpoint_override in the URI, or AWS_ENDPOINT_URL) and the credentials (the AWS variables)"
        ) from None
    if not found:
        raise JobConfigError(
            f"--storage-path {base.location}: bucket {bucket!r} does not exist (or these credentials cannot see "
            "it): create it, or fix the bucket name"
        )


def check_shared_storage(storage_path: str, node_addresses: Sequence[str], local_is_shared: bool) -> None:
    """Refuse a local ``--storage-path`` on a cluster of several machines, before any training.

    Every node writes there (each rank's ShardWriter, the MetadataActor the manifest),
    so a path private to one machine cannot hold a checkpoint; the first save would
    refuse it after training started (``save_async``), and Ray Train would retry the
    failing group. Nodes on one machine (one address) share its disk.

    Args:
        storage_path: ``--storage-path``.
        node_addresses: The address of each alive node (``ray.nodes()``'s ``NodeManagerAddress``).
        local_is_shared: The path is storage every node mounts (``RAYCKPT_LOCAL_IS_SHARED=1``).
    """
    if ("://" in storage_path and not storage_path.startswith("file://")) or local_is_shared:
        return
    machines = sorted(set(node_addresses))
    if len(machines) > 1:
        raise JobConfigError(
            f"--storage-path {storage_path} is a local path, but the Ray cluster's nodes run on {len(machines)} "
            f"machines ({', '.join(machines)}) and every node must reach the same files: use s3://... or gs://..., "
            "or an NFS path mounted on every node with RAYCKPT_LOCAL_IS_SHARED=1"
        )


def describe_runs(storage_path: str | os.PathLike[str]) -> str:
    """The runs under ``storage_path`` with what they hold, e.g. ``'a' (2 committed, latest step 10)``."""
    base = CheckpointDir.resolve(storage_path)
    parts = []
    for name in base.list_dirs():
        entries = scan_run(base.child(name), name)
        committed = [e for e in entries if e.status == "committed"]
        latest = latest_committed(entries)
        if latest is None:
            parts.append(f"{name!r} (no committed checkpoint)")
        else:
            parts.append(f"{name!r} ({len(committed)} committed, latest step {latest.step})")
    return ", ".join(parts) if parts else "none"


def check_resume(storage_path: str, run_name: str, *, resume: bool, resume_if_exists: bool) -> bool:
    """Whether the job restores a checkpoint; raises when the flags and the run directory disagree.

    - neither flag: the run directory must not exist or be empty (Ray Train would
      silently pick its checkpoints up);
    - ``--resume``: the run must hold a committed checkpoint (a mistyped
      ``--run-name`` must not start a fresh run);
    - ``--resume-if-exists``: continue the latest committed checkpoint if there is
      one, start fresh otherwise.
    """
    if resume_if_exists:
        return True
    base = CheckpointDir.resolve(storage_path)
    run_dir = base.child(run_name)
    if resume:
        if latest_committed(scan_run(run_dir, run_name)) is None:
            raise JobConfigError(
                f"--resume: run {run_name!r} has no committed checkpoint under {base.location}"
                f"; runs there: {describe_runs(storage_path)}. Check --run-name and --storage-path, or pass "
                "--resume-if-exists to start fresh when there is nothing to resume"
            )
        return True
    if run_dir.list_files() or run_dir.list_dirs():
        raise JobConfigError(
            f"run {run_name!r} already exists at {run_dir.location}: pass --resume (or --resume-if-exists) to "
            "continue it, or choose another --run-name"
        )
    return False


def worker_resources(args: argparse.Namespace, cluster_cpus: float) -> dict[str, float] | None:
    """``ScalingConfig.resources_per_worker``: ``None`` keeps Ray's default (1 CPU, or 1 GPU with ``--gpus``).

    CPU training with more workers than the cluster has CPUs (4 workers on a
    2-core laptop) shares the CPUs instead of waiting forever for more.
    """
    if args.cpus_per_worker is not None:
        return {"CPU": args.cpus_per_worker}
    if not args.gpus and 0 < cluster_cpus < args.num_workers:
        return {"CPU": cluster_cpus / args.num_workers}
    return None


def check_resources(args: argparse.Namespace, cluster: dict[str, float]) -> dict[str, float] | None:
    """Refuse a request the cluster can never satisfy; return ``resources_per_worker`` for ``ScalingConfig``.

    ``cluster`` is ``ray.cluster_resources()``: the nodes up now. Ray Train would
    otherwise wait for the missing resources and retry ``fit()`` forever. An
    autoscaling cluster may grow past it: ``--skip-resource-check`` skips this.
    """
    per_worker = worker_resources(args, cluster.get("CPU", 0.0))
    # What Ray Train reserves per worker (ScalingConfig's rule): the given resources, else 1 CPU;
    # with use_gpu, 1 GPU unless given and no CPU unless given.
    need = dict(per_worker) if per_worker else ({} if args.gpus else {"CPU": 1.0})
    if args.gpus:
        need.setdefault("GPU", 1.0)
    n = getattr(args, "min_workers", args.num_workers)  # an elastic run starts with as few as its MIN
    for resource, amount in need.items():
        total, have = amount * n, cluster.get(resource, 0.0)
        if total <= have + 1e-9:
            continue
        if resource == "GPU" and have == 0:
            raise JobConfigError(
                f"--gpus: no CUDA device is visible: the Ray cluster has 0 GPUs and --num-workers {n} needs "
                f"{total:g}; drop --gpus to train on CPUs with gloo, or on an autoscaling cluster that will add "
                "GPU nodes pass --skip-resource-check"
            )
        if resource == "GPU":
            fix = "lower --num-workers, or drop --gpus to train on CPUs"
            asked = f"--gpus with --num-workers {n} needs {total:g} GPUs"
        else:
            fix = "lower --num-workers or --cpus-per-worker (unset, it shares the CPUs there are)"
            asked = f"--num-workers {n} x {amount:g} CPUs per worker needs {total:g} CPUs"
        raise JobConfigError(
            f"{asked}, but the Ray cluster has {have:g}: {fix}; on an autoscaling cluster that will grow, "
            "pass --skip-resource-check"
        )
    return per_worker
