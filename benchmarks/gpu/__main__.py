"""``python -m benchmarks.gpu --size-gb 4``: the GPU path in one process (``benchmarks.gpu.run``);
``--device cpu`` runs the same rows on the CPU."""

from __future__ import annotations

from benchmarks.gpu.run import main

if __name__ == "__main__":
    raise SystemExit(main())
