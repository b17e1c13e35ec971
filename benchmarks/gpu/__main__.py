"""``python -m benchmarks.gpu --size-gb 4``: ``benchmarks.gpu.run``."""

from benchmarks.gpu.run import main

raise SystemExit(main())
