"""The memory tier: checkpoints held in the nodes' memory by their ShardWriters, each file also on a peer node.

- ``store``: the files one node holds (``MemoryStore``) and its budget.
- ``replication`` and ``link``: each held file copied to the ring's next node over a socket.
- ``host``: the ShardWriter's ``mem_*`` calls on its store.
- ``filesystem``: the tier as a ``pyarrow`` filesystem any process opens (``memory_filesystem``).

This file imports none of them: the ShardWriter imports ``host``, and ``filesystem``
imports the ShardWriter (to start a node's writer), so importing the package must not
bring ``filesystem`` with it.
"""
