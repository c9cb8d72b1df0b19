"""The FullyShardedDataParallel front: the module class, and what turns torch's FSDP1 arguments into
engine parts (process groups and strategies, the auto-wrap plan and each unit's parameters, the flat
layout, meta-device initialization and same-values checks, ``clip_grad_norm_``, the
optimizer-state-dict static methods). ``fsdp1.fully_sharded_data_parallel``, torch's path,
re-exports the class.

Its rule: it imports the engine, the state dicts, ``api``, ``wrap`` and the comm hooks it registers
(``fsdp1.comm_hooks``); never the ``fully_shard`` front."""
