"""rayckpt against torch DCP on the same FSDP2 state: saves (stall, durable commit, memory) and
reshard loads (time, read amplification, memory), on a local disk (also torch.save and the raw
disk) or on an S3 endpoint (requests and bytes counted by the server), through one code path."""
