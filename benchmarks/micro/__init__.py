"""Focused A/B runs of one piece each: the engine against DCP in process (``engine``), the Ray save
path (``ray_save``), load planning at scale (``plan``, ``root_plan``), save planning
(``save_plan``) and manifest validation (``validate``)."""
