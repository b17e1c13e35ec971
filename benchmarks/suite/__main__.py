"""``python -m benchmarks.suite [--storage local|s3] [options]``: ``benchmarks.suite.run``."""

from benchmarks.suite.run import main

if __name__ == "__main__":
    raise SystemExit(main())
