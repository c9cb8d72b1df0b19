"""The FullyShardedDataParallel front: what turns torch's FSDP1 arguments into engine parts (process
groups and strategies, the auto-wrap plan and each unit's parameters, meta-device initialization and
same-values checks, ``clip_grad_norm_``, the optimizer-state-dict static methods). The module class
itself stays at ``fsdp1.fully_sharded_data_parallel``, torch's path.

Its rule: it imports the engine, the state dicts, ``api`` and ``wrap``; never the ``fully_shard`` front."""
