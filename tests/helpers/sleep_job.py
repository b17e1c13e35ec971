"""A stand-in cluster job for ``tests/unit/test_cluster_jobs.py``: ``python -m tests.helpers.sleep_job OUT
SECONDS CODE`` sleeps, writes ``OUT/result.json`` (its arguments and ``RAY_ADDRESS``) and exits with CODE."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    out, seconds, code = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    print(f"sleeping {seconds} s")
    time.sleep(seconds)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"seconds": seconds, "ray_address": os.environ.get("RAY_ADDRESS"), "extra": os.environ.get("X")}, f)
    print("failing on purpose" if code else "done", file=sys.stderr)
    sys.exit(code)
