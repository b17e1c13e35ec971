"""rayckpt against torch DCP on the same FSDP2 state: saves (stall, durable commit, memory) and
reshard loads (time, read amplification, memory), on a local disk (``local``: also torch.save
and the raw disk) or on an S3 endpoint (``s3``: requests and bytes counted by the server)."""
