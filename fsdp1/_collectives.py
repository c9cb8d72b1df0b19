"""The only place fsdp1 calls ``torch.distributed``.

Every collective is issued with ``async_op=True`` and returns its ``Work``: gloo then progresses it
on its own threads and NCCL on its own stream, so the caller decides how late to wait. Waiting on
a ``Work`` also orders the current CUDA stream after the collective, which is why fsdp1 needs no
streams of its own (see DESIGN.md §4). Version shims and backend-specific choices live here too.
"""

from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh  # noqa: F401 (re-exported for _init)

ProcessGroup = dist.ProcessGroup
Work = dist.Work

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_group() -> ProcessGroup:
    return dist.group.WORLD


def mesh_groups(mesh: DeviceMesh) -> List[ProcessGroup]:
    """The process group of each of ``mesh``'s dimensions, in dimension order."""
    return [mesh.get_group(mesh_dim=dim) for dim in range(mesh.ndim)]


def group_rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)


def group_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def all_gather_into(output: torch.Tensor, local_shard: torch.Tensor, group: ProcessGroup) -> Union[Work, "PairwiseExchange"]:
    """Gather equal shards into one flat ``output`` (rank r's shard lands at ``r * shard.numel()``)."""
    if _is_gloo_pair(group):
        own, peer = _own_and_peer_chunks(output, local_shard.numel(), group)
        own.copy_(local_shard)
        return PairwiseExchange(peer, local_shard, group)
    return _all_gather_single(output, local_shard, group=group, async_op=True)


def reduce_scatter_into(output: torch.Tensor, unsharded: torch.Tensor, group: ProcessGroup) -> Union[Work, "PairwiseExchange"]:
    """Sum ``unsharded`` over the ranks and keep this rank's chunk in ``output`` (once waited for)."""
    if _is_gloo_pair(group):
        own, peer = _own_and_peer_chunks(unsharded, output.numel(), group)
        return PairwiseExchange(output, peer, group, add_on_wait=own)
    return _reduce_scatter_single(output, unsharded, group=group, async_op=True)


def _is_gloo_pair(group: ProcessGroup) -> bool:
    return group_size(group) == 2 and dist.get_backend(group) == dist.Backend.GLOO


def _own_and_peer_chunks(flat: torch.Tensor, chunk: int, group: ProcessGroup) -> Tuple[torch.Tensor, torch.Tensor]:
    rank = group_rank(group)
    return flat[rank * chunk : (rank + 1) * chunk], flat[(1 - rank) * chunk : (2 - rank) * chunk]


class PairwiseExchange:
    """All-gather and reduce-scatter between two gloo ranks as what they are: each rank sends its peer
    one chunk. Gloo's own collectives took about twice as long for the same bytes (2 CPU ranks,
    median of 25: a 3 MiB all-gather 2.5 vs 1.1 ms, a 3 MiB reduce-scatter 6.9 vs 3.4 ms).

    ``send`` goes to the peer and the peer's chunk lands in ``received``. All-gather: ``send`` is the
    local shard and ``received`` the peer's slot of the output (the caller copies the own slot).
    Reduce-scatter: ``send`` is the peer's chunk of the unsharded gradient, ``received`` the output,
    and ``add_on_wait`` the own chunk. Two-term float addition commutes exactly, so the sum is
    bitwise the reduce-scatter's.
    """

    def __init__(self, received: torch.Tensor, send: torch.Tensor, group: ProcessGroup,
                 add_on_wait: Optional[torch.Tensor] = None) -> None:
        splits = [0, 0]
        splits[1 - group_rank(group)] = send.numel()
        self._received, self._add_on_wait = received, add_on_wait
        self._work = dist.all_to_all_single(
            received, send, output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=True
        )

    def wait(self) -> bool:
        self._work.wait()
        if self._add_on_wait is not None:
            self._received.add_(self._add_on_wait)
        return True


def all_reduce(tensor: torch.Tensor, group: ProcessGroup) -> Work:
    """Sum ``tensor`` over the ranks in place."""
    return dist.all_reduce(tensor, group=group, async_op=True)


def all_reduce_with(tensor: torch.Tensor, group: ProcessGroup, maximum: bool) -> Work:
    """Sum (or, with ``maximum``, take the largest of) ``tensor`` over the ranks in place."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM, group=group, async_op=True)


def broadcast_from_first(tensor: torch.Tensor, group: ProcessGroup) -> Work:
    """Overwrite ``tensor`` on every rank with the group's first rank's."""
    return dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group, async_op=True)


def all_to_all(output: torch.Tensor, send: torch.Tensor, output_splits: List[int], send_splits: List[int],
               group: ProcessGroup) -> None:
    """Send ``send``'s consecutive pieces (``send_splits``) to the ranks in order; rank r's piece for
    this rank lands in ``output`` after those of the ranks before it. Synchronous: only the
    state-dict paths use it, between steps."""
    dist.all_to_all_single(output, send, output_split_sizes=output_splits, input_split_sizes=send_splits, group=group)


def device_mesh_of(group: ProcessGroup, device_type: str) -> DeviceMesh:
    """A 1-D mesh over ``group``'s ranks that reuses the group (no new group is created), for DTensors."""
    return DeviceMesh.from_group(group, device_type)


def scatter_from_first(output: torch.Tensor, full: Optional[torch.Tensor], group: ProcessGroup) -> None:
    """Rank r of ``group`` receives the r-th equal chunk of the first rank's ``full`` (None elsewhere)."""
    chunks = list(full.chunk(group_size(group))) if full is not None else None
    dist.scatter(output, chunks, src=dist.get_global_rank(group, 0), group=group)


def broadcast_object_from_first(obj: Any, group: ProcessGroup) -> Any:
    """The first rank's ``obj`` on every rank (small metadata only: it is pickled)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0]


def global_rank_of(group: ProcessGroup, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def global_rank() -> int:
    return dist.get_rank()


def all_gather_object(obj: Any, group: ProcessGroup) -> List[Any]:
    """Every rank's ``obj``, in group-rank order (small metadata only: it is pickled)."""
    gathered: List[Any] = [None] * group_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
