"""Saves beside training: ``stall`` times the save call (a bare copy, DCP's ``async_save``, rayckpt with and
without overlap) in one process and on 4 ranks; ``step`` times a training loop's steps with a save every
step and every 10 (``report``)."""
