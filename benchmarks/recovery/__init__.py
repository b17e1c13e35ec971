"""Recovery under Ray Train: ``restart`` times each phase from a worker kill or a node removal to
the first step after the restore (``loop``, ``report``); ``memory_cost`` times
what a memory checkpoint every step costs the loop and a restore from each tier."""
