"""``python -m benchmarks.incremental --size-mb 512 --steps 6 --repeats 3``: incremental saves against full
saves and DCP, and chained loads (``benchmarks.incremental.run``)."""

from __future__ import annotations

from benchmarks.incremental.run import main

if __name__ == "__main__":
    raise SystemExit(main())
