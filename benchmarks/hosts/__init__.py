"""Benchmarks on real hosts of one machine (``testbed.ray_hosts``): a cut link, restores."""
