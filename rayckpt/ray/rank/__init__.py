"""The training rank's side of the Ray layer: ``async_save`` (``save_async``), ``save_handle`` (``SaveHandle``),
``staging`` (the rank's reusable shared-memory buffer), ``copier`` (the copy into it, before the call returns or
beside the next step) and ``loading`` (``load``)."""
