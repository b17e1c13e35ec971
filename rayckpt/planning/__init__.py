"""Pure planning: what each rank writes (save plans) and reads (load plans, N -> M).

``save_plan`` dedups replicated boxes, balances writers and splits chunks too
large for Arrow; ``load_plan`` intersects requested boxes with saved chunks and
returns block-aligned, coalesced byte ranges sorted by offset; ``chunk_table``
and ``bulk`` plan every FSDP2 (dim-0) target rank at once on numpy columns;
``rank_slice`` cuts that plan into each rank's columns (a load without Ray).
Frozen dataclasses in and out, no I/O. May import ``rayckpt.format`` and numpy;
never torch, Ray or storage.
"""
