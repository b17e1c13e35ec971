"""``python -m benchmarks.scale --ranks 64,256,1024,4096``: ``benchmarks.scale.run``."""

from benchmarks.scale.run import main

raise SystemExit(main())
