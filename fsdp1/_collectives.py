"""The only place fsdp1 calls ``torch.distributed``.

Every collective is issued with ``async_op=True`` and returns its ``Work``: gloo then progresses it
on its own threads and NCCL on its own stream, so the caller decides how late to wait. Waiting on
a ``Work`` also orders the current CUDA stream after the collective, which is why fsdp1 needs no
streams of its own (see DESIGN.md §4). Version shims live here too.
"""

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup
Work = dist.Work

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_group() -> ProcessGroup:
    return dist.group.WORLD


def group_rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)


def group_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def all_gather_into(output: torch.Tensor, local_shard: torch.Tensor, group: ProcessGroup) -> Work:
    """Gather equal shards into one flat ``output`` (rank r's shard lands at ``r * shard.numel()``)."""
    return _all_gather_single(output, local_shard, group=group, async_op=True)


def reduce_scatter_into(output: torch.Tensor, unsharded: torch.Tensor, group: ProcessGroup) -> Work:
    """Sum ``unsharded`` over the ranks and keep this rank's chunk in ``output``."""
    return _reduce_scatter_single(output, unsharded, group=group, async_op=True)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup) -> Work:
    """Sum ``tensor`` over the ranks in place."""
    return dist.all_reduce(tensor, group=group, async_op=True)
