"""Train a small GPT with FSDP2 on Ray Train, checkpointed by rayckpt; see ``--help``."""

from rayckpt.examples.gpt_job import main

if __name__ == "__main__":
    raise SystemExit(main())
