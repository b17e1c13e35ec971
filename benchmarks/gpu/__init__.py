"""The GPU path in one process: the pinned-copy limit, DCP's save and async_save stagers,
rayckpt's save and save_async (first and later saves, with and without ``prepare_staging``),
cold and warm loads into the device (``run``)."""
