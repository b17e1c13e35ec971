"""``python -m rayckpt``: the ``rayckpt`` command."""

from .cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
