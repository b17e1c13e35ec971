"""Installing rayckpt's Grafana dashboard where the head node's Grafana looks (the MetadataActor, at start).

The MetadataActor runs on the head node, whose Ray session directory holds the
Grafana provisioning Ray's metrics head writes (``observe.dashboard.dashboards_folder``).
The metrics head empties that folder when it starts, so a first install waits a while
for Ray's own ``default_grafana_dashboard.json`` there before writing beside it (not
found in time, as without Ray's dashboard: it writes anyway). Every failure is one
WARNING in the actor's log: the dashboard is a convenience, never a reason for the
actor to fail.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ...observe import dashboard

#: The MetadataActor's logger, which the actor lets reach its log file (``views.show_commits_in_log``).
logger = logging.getLogger(__name__.rpartition(".")[0] + ".actor")

#: The file Ray's metrics head writes first into the dashboards folder.
RAY_DEFAULT_DASHBOARD = "default_grafana_dashboard.json"
#: How long a first install waits for Ray's metrics head to have made the folder.
WAIT_FOR_RAY_S = 60.0
_POLL_S = 0.5


def session_dir() -> str:
    """This process's Ray session directory (a worker's or an actor's as well as a driver's)."""
    import ray

    node = getattr(ray._private.worker.global_worker, "node", None)
    if node is not None:
        return node.get_session_dir_path()
    # Not connected through a node object: the session every Ray on this machine links as "session_latest".
    from ray._common.utils import get_default_ray_temp_dir

    return os.path.join(get_default_ray_temp_dir(), "session_latest")


def install_dashboard(wait_s: float = 0.0) -> str | None:
    """Install the dashboard into this Ray session's Grafana dashboards folder now; its path, or None (after
    one WARNING) when it could not be written. ``wait_s``: how long to wait for Ray's own dashboards there."""
    try:
        folder = dashboard.dashboards_folder(session_dir())
        deadline = time.monotonic() + wait_s
        while not os.path.exists(os.path.join(folder, RAY_DEFAULT_DASHBOARD)) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        path = dashboard.install(folder)
    except Exception as exc:  # noqa: BLE001 - anything: the actor goes on without its dashboard
        logger.warning("rayckpt: Grafana dashboard not installed: %s: %s", type(exc).__name__, exc)
        return None
    logger.info("rayckpt: Grafana dashboard installed at %s", path)
    return path


def install_dashboard_soon() -> None:
    """Write the dashboard into the Ray session's Grafana dashboards folder, in a background thread."""
    try:
        threading.Thread(target=install_dashboard, args=(WAIT_FOR_RAY_S,), name="rayckpt-grafana", daemon=True).start()
    except Exception as exc:  # noqa: BLE001 - never fails the actor
        logger.warning("rayckpt: Grafana dashboard not installed: %s", exc)
