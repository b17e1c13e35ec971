"""``python -m benchmarks.suite [--storage local|s3] [options]``: ``benchmarks.suite.run``."""

from benchmarks.suite.run import main

raise SystemExit(main())
