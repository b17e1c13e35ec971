"""One piece of rayckpt at a time: load planning and the manifest codec at scale (``plan``)."""
