"""Where checkpoints live and how one becomes real: directories, the commit, the catalog.

``checkpoint_dir`` is a checkpoint directory on any ``pyarrow.fs`` filesystem
(fsync, atomic write, memory-mapped reads); ``commit`` owns a save's life on
storage, each step in one place: a new save id, the shard file names, creating
and validating the manifest, the atomic commit (manifest last) and removing a
failed save's files; ``catalog`` finds the checkpoints of a run. May import
``rayckpt.format`` and pyarrow; never torch or Ray.
"""
