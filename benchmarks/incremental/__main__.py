"""``python -m benchmarks.incremental --size-mb 512 --steps 6 --repeats 3``: ``benchmarks.incremental.run``."""

from benchmarks.incremental.run import main

raise SystemExit(main())
