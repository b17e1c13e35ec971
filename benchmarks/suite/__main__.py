"""``python -m benchmarks.suite [--storage local|s3] [options]``: rayckpt against DCP, save and
reshard load, on a local disk or an S3 endpoint (``benchmarks.suite.run``)."""

from __future__ import annotations

from benchmarks.suite.run import main

if __name__ == "__main__":
    raise SystemExit(main())
