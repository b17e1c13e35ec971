"""What every benchmark group shares: ``harness`` (sampling, timing, statistics, Ray connection,
reports), ``workload`` (the FSDP2 state and its checks), ``diskio`` (page cache eviction, raw
disk anchors) and ``cli`` (the groups' entry points)."""
