"""Save a sharded FSDP2 model with 4 processes, load it with 3, print whether outputs match (``--help``)."""

from rayckpt.examples.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
