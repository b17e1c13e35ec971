"""Installing rayckpt's Grafana dashboard where the head node's Grafana looks (the MetadataActor, at start)."""

from __future__ import annotations


def install_dashboard_soon() -> None:
    """Write the dashboard into the Ray session's Grafana dashboards folder, in a background thread."""
