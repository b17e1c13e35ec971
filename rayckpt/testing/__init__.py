"""Helpers for tests, benchmarks and the demo: N gloo processes (``multiproc``) and a toy FSDP2 model (``toy``).

Shipped so that users can test their own checkpointing the same way; the engine
never imports it. May import ``engine`` and below, and torch.
"""
