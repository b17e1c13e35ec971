"""Ray-native orchestration: async saves through shared memory, per-node writers, the MetadataActor.

``async_save`` stages a rank's share once into shared memory (``staging``) and
hands it to the ``shard_writer`` actor on its node; ``save_handle`` is how the
rank learns the save's outcome. The ``metadata_actor`` is a thin Ray shell over
Ray-free parts (``commit_tracker``: each save's state machine; ``save_history``:
the bounded record of settled saves; ``plan_cache``: manifests and load plans)
and the storage catalog; ``load`` serves read plans from it; ``metrics``
exports ``ray_rayckpt_*``. May import ``engine`` and everything below it, and
``ray``; never ``train`` or ``tools``.
"""
