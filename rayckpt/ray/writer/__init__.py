"""The node's ShardWriter process: the actor that writes ranks' staged shares, and the staged regions it reads.

- ``actor``: ``ShardWriter``, the ``ShardWrite`` request and ``get_shard_writer``.
- ``regions``: opening a rank's staged region, and sweeping files dead processes left.
"""
