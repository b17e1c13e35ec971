"""Benchmarks on real hosts of one machine (``rayckpt.testing.ray_hosts``): replicas, a cut link, restores."""
