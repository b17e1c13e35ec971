"""Thousands of ranks, metadata only, rayckpt beside DCP: manifest and ``.metadata`` size, write
and read, save plans (uncached and cached) and load plans, peak memory and growth in N, each
step in a fresh process. ``layout`` builds the layout and calls rayckpt, ``dcp`` builds DCP's
metadata, ``report`` and ``plot`` report."""
