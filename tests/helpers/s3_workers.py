"""Process bodies for the S3 tier: ``concurrent_workers``'s, run with the S3 test environment.

``concurrent_workers.start`` forks from a forkserver that may have started (with
the environment of that moment) before the S3 fixtures set the dummy AWS
credentials; each body here sets them first.
"""

from __future__ import annotations

import os
from typing import Any

from tests.helpers import concurrent_workers


def with_env(env: dict[str, str], name: str, *args: Any) -> None:
    """Set ``env``, then run ``concurrent_workers.<name>(*args)``."""
    os.environ.update(env)
    getattr(concurrent_workers, name)(*args)


def start(env: dict[str, str], name: str, *args: Any) -> Any:
    """``concurrent_workers.start`` of ``concurrent_workers.<name>(*args)`` with ``env`` set."""
    return concurrent_workers.start(with_env, env, name, *args)
