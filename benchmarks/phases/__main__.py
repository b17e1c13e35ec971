"""``python -m benchmarks.phases --layers 20 --rounds 3 --cold``: ``benchmarks.phases.run``."""

from benchmarks.phases.run import main

raise SystemExit(main())
