"""rayckpt and DCP's API on rayckpt's writer and reader against torch DCP on one FSDP2 state: saves and
reshard loads (time, read amplification, memory), on a local disk or an S3 endpoint, one code path."""
