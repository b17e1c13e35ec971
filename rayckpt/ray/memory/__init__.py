"""The memory tier's node side: checkpoints held in a node's memory by its ShardWriter, each file also on a peer.

- ``store``: the files one node holds (``MemoryStore``) and its budget.
- ``replication`` and ``link``: each held file copied to the ring's next node over a socket.
- ``host``: the ShardWriter's ``mem_*`` calls on its store.

Any process reads and writes the tier through ``rayckpt.ray.memory.fs``, which
sits above the ShardWriter (it starts a node's writer for a run's first file).
"""
