"""``python -m benchmarks.suite [--storage local|s3] [options]``: rayckpt against DCP, save and
reshard load, on a local disk (``benchmarks.suite.local``) or an S3 endpoint
(``benchmarks.suite.s3``). ``--help`` shows the chosen storage's options."""

from __future__ import annotations

import argparse
import sys

from benchmarks.common.cli import add_storage_arg


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    add_storage_arg(pre, "local")
    storage = pre.parse_known_args(argv)[0].storage
    if storage == "s3":
        from benchmarks.suite.s3 import main as run
    else:
        from benchmarks.suite.local import main as run
    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
