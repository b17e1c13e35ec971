"""The MetadataActor's process: the actor, a thin Ray shell, and the Ray-free parts it calls.

- ``actor``: ``MetadataActor`` and ``get_metadata_actor``.
- ``commit_tracker`` (with ``save_record``, ``save_history``): each save's state, the commit.
- ``plan_cache``: manifests and the load plans made from them.
- ``layout_cache``: save layouts and chunk layouts sent once and then named by digest.
- ``attempts``: worker groups started per training run.
"""
