"""``python -m benchmarks.phases --layers 20 --rounds 3 --cold``: save and load against DCP as a
first call and in steady state, with rayckpt's phases (``benchmarks.phases.run``)."""

from __future__ import annotations

from benchmarks.phases.run import main

if __name__ == "__main__":
    raise SystemExit(main())
