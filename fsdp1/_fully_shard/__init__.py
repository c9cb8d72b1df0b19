"""The ``fully_shard`` front (torch's FSDP2 API): ``fully_shard``, ``FSDPModule`` and its methods,
``UnshardHandle``; what turns a mesh and FSDP2's arguments into engine parts.

Its rule: it imports the engine, the state dicts and ``api``; never the FullyShardedDataParallel front."""
