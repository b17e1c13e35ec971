"""Benchmarks on real hosts of one machine (``testbed.ray_hosts``): replicas, a cut link, restores."""
