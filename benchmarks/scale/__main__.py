"""``python -m benchmarks.scale --ranks 64,256,1024,4096``: rayckpt's and DCP's metadata and
planning at thousands of ranks (``benchmarks.scale.run``; it runs each step as
``python -m benchmarks.scale --worker STEP``)."""

from __future__ import annotations

from benchmarks.scale.run import main

if __name__ == "__main__":
    raise SystemExit(main())
