"""A user's first call: ``get_state_dict`` of FSDP2 layers with AdamW, 4 ranks save and 3 load,
DCP and rayckpt alternating, in freshly spawned processes and repeated in the same ones, with
rank 0's ``SaveInfo.phases`` / ``LoadInfo.phases`` (``run``)."""
