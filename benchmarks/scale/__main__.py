"""``python -m benchmarks.scale --ranks 64,256,1024,4096``: ``benchmarks.scale.run``."""

from benchmarks.scale.run import main

if __name__ == "__main__":
    raise SystemExit(main())
