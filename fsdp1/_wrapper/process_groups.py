"""Where a unit communicates and how it shards: its process groups (the default group, a process
group, a device mesh, or for the hybrid strategies a shard and a replicate group, made per node when
none is given) and the sharding strategy that results.
"""

import os
import warnings
from typing import Any, Optional, Tuple

from .._engine import collectives as comm
from .._engine.collectives import ProcessGroups
from .._engine.schedule import UnitSchedule
from .._engine.unit_state import UnitState
from ..api import BackwardPrefetch, ShardingStrategy, coerce_enum

HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
SHARDED_STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) + HYBRID_STRATEGIES
# Strategies that free the unsharded parameters after forward; the others keep them for backward.
RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


def resolve_process_groups(process_group: Any, device_mesh: Any, strategy: ShardingStrategy) -> ProcessGroups:
    """Where a unit shards and replicates: the default group, ``process_group``, a 1-D ``device_mesh``,
    or for the hybrid strategies a 2-D mesh (dimension 0 replicates, 1 shards, as torch's) or a
    ``(shard_group, replicate_group)`` pair."""
    if process_group is None and device_mesh is None and not comm.is_initialized():
        raise RuntimeError(
            "fsdp1: torch.distributed is not initialized. Call torch.distributed.init_process_group() "
            "(e.g. under torchrun) before wrapping the model."
        )
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "fsdp1: pass process_group or device_mesh, not both: each says which ranks this unit shards "
            "over. Keep device_mesh (it also names the replicate dimension for HYBRID_SHARD)."
        )
    hybrid = strategy in HYBRID_STRATEGIES
    groups: Tuple[Any, ...]
    if device_mesh is not None:
        if not isinstance(device_mesh, comm.DeviceMesh):
            raise ValueError(f"fsdp1: device_mesh must be a torch.distributed DeviceMesh, got {type(device_mesh).__name__}.")
        wanted = 2 if hybrid else 1
        if device_mesh.ndim != wanted:
            shape = "a 2-D mesh (replicate, shard)" if hybrid else "a 1-D mesh"
            raise ValueError(
                f"fsdp1: sharding_strategy={strategy} needs {shape}, but device_mesh is {device_mesh.ndim}-D "
                f"(shape {tuple(device_mesh.shape)}). Build it with init_device_mesh(device_type, "
                f"{'(replicas, shard_size)' if hybrid else '(world_size,)'})."
            )
        groups = tuple(reversed(comm.mesh_groups(device_mesh)))  # (shard, replicate) for 2-D
    elif isinstance(process_group, tuple):
        groups = process_group
        if hybrid and len(groups) == 2 and not all(comm.is_process_group(g) for g in groups):
            raise ValueError(
                "fsdp1: process_group=(shard_group, replicate_group) must hold two torch.distributed "
                f"ProcessGroups, got ({', '.join(type(g).__name__ for g in groups)})."
            )
        if not hybrid or len(groups) != 2:
            raise ValueError(
                "fsdp1: a tuple process_group means (shard_group, replicate_group) and is only for "
                f"HYBRID_SHARD and _HYBRID_SHARD_ZERO2; got a tuple of {len(groups)} with sharding_strategy={strategy}. "
                "Pass one ProcessGroup, or set the hybrid strategy."
            )
    elif process_group is not None and not comm.is_process_group(process_group):
        raise ValueError(
            f"fsdp1: process_group must be a torch.distributed ProcessGroup, or for the hybrid strategies a "
            f"tuple (shard_group, replicate_group); got {type(process_group).__name__}."
        )
    else:
        groups = (process_group if process_group is not None else comm.default_group(),)
    if hybrid and len(groups) != 2:
        raise ValueError(
            f"fsdp1: sharding_strategy={strategy} shards inside one group of ranks and replicates across "
            "another, and needs both: pass device_mesh=init_device_mesh(device_type, (replicas, "
            "shard_size)) or process_group=(shard_group, replicate_group), or neither (one node of "
            "LOCAL_WORLD_SIZE ranks shards, nodes replicate)."
        )
    replicate = groups[1] if len(groups) == 2 and comm.group_size(groups[1]) > 1 else None
    return ProcessGroups(groups[0], replicate)


def node_local_groups() -> Tuple[comm.ProcessGroup, comm.ProcessGroup]:
    """(shard group, replicate group) for a hybrid strategy given neither ``device_mesh`` nor
    ``process_group``, as torch's builds them: shard over the ranks of this node, replicate across
    nodes. A node is ``LOCAL_WORLD_SIZE`` consecutive ranks (set by torchrun); without it the job is
    one node, which then behaves as FULL_SHARD over its ranks (torch's FSDP1 counts CUDA devices
    instead, and on a CPU-only job falls back to NO_SHARD with gradients left unsynced)."""
    world_size = comm.group_size(comm.default_group())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local < 1 or world_size % local:
        raise ValueError(
            f"fsdp1: HYBRID_SHARD without device_mesh shards within each node of LOCAL_WORLD_SIZE={local} ranks, "
            f"which does not divide the world size {world_size}. Pass device_mesh=init_device_mesh(device_type, "
            "(replicas, shard_size)) instead."
        )
    shard = comm.subgroup_of_this_rank([list(range(start, start + local)) for start in range(0, world_size, local)])
    replicate = comm.subgroup_of_this_rank([list(range(first, world_size, local)) for first in range(local)])
    return shard, replicate


def coerce_sharding_strategy(strategy: Optional[ShardingStrategy]) -> ShardingStrategy:
    return ShardingStrategy.FULL_SHARD if strategy is None else coerce_enum(strategy, ShardingStrategy, "sharding_strategy")


def resolve_sharding_strategy(strategy: ShardingStrategy, groups: ProcessGroups) -> ShardingStrategy:
    """NO_SHARD when no rank has anything to split or sync with (as torch). A hybrid strategy whose
    shard group is one rank stays hybrid: its replicas still average gradients (torch's switches to
    NO_SHARD there and stops syncing them, pytorch#154888)."""
    world_size = comm.group_size(groups.shard)
    if world_size == 1 and groups.replicate is None and strategy is not ShardingStrategy.NO_SHARD:
        warnings.warn(
            "FSDP is switching to use `NO_SHARD` instead of "
            f"{strategy} since the world size is 1.",
            stacklevel=3,
        )
        return ShardingStrategy.NO_SHARD
    if strategy is ShardingStrategy.NO_SHARD and world_size > 1:
        warnings.warn(
            "The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
            "`DistributedDataParallel` instead.",
            FutureWarning,
            stacklevel=3,
        )
    return strategy



def unit_schedule(strategy: ShardingStrategy, backward_prefetch: Optional[BackwardPrefetch],
                  forward_prefetch: bool) -> "UnitSchedule[UnitState]":
    """What FSDP1's strategy and prefetch arguments mean for when a unit reshards and prefetches:
    FULL_SHARD and HYBRID_SHARD units (but the root) reshard after forward; SHARD_GRAD_OP and
    _HYBRID_SHARD_ZERO2 keep their parameters gathered inside ``no_sync``."""
    return UnitSchedule(
        reshard_after_forward=None if strategy in RESHARD_AFTER_FORWARD else False,
        keeps_gathered_without_sync=strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2),
        backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
    )
