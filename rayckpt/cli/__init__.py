"""The ``rayckpt`` command: ``commands`` (parsing, and the commands that read storage only), ``status``
(the one that joins a running cluster), ``dashboard`` (the Grafana dashboard and alert rules as files) and
``text`` (how the command shows and reads things)."""

from .commands import main

__all__ = ["main"]
