"""Incremental saves: bytes written and time to commit of ``rayckpt.save(incremental=True)`` beside a full save
and DCP, for a dense, a 70%-frozen and a LoRA-like state on 2 gloo ranks, and the load of a chained
checkpoint beside a self-contained one (``run``)."""
