"""The training rank's side of the Ray layer: ``async_save`` (``save_async``), ``options`` (how a save runs on
Ray, and where it goes), ``save_handle`` (``SaveHandle``), ``staging`` (the rank's reusable shared-memory
buffer), ``copier`` (the copy into it, before the call returns or beside the next step) and ``loading``
(``load``)."""
