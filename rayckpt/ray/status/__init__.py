"""What ``rayckpt status`` shows, in one place: ``published`` (the JSON snapshots the actors publish every
second in Ray's key-value store), ``report`` (the MetadataActor's part, made from what it holds; Ray-free) and
``reader`` (the operator's process: joins the cluster, reads the snapshots, leaves)."""
