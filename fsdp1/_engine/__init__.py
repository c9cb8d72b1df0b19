"""The engine: flat parameters and their shards, gathering and resharding, gradient reduction, the
unit's forward and backward hooks. It knows neither API: the FullyShardedDataParallel front
(``fsdp1._wrapper``) and the ``fully_shard`` front (``fsdp1._fully_shard``) build its parts (the
layout, the views, the groups, the precision, the schedule) and hand them in.

Its rule: nothing here imports a front, the state dicts, or a public module of fsdp1 but ``api``'s
configuration data."""
