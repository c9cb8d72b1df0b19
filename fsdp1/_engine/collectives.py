"""The collectives fsdp1 issues; with ``groups`` (what it asks of process groups and meshes) and
``group_health`` (how it guards them), the only place fsdp1 calls ``torch.distributed``. The rest of
fsdp1 reaches all three through this module (``comm``), which re-exports the other two's names.

Every collective is issued with ``async_op=True`` and returns its ``Work``: gloo then progresses it
on its own threads and NCCL on its own stream, so the caller decides how late to wait. Waiting on
a ``Work`` also orders the current CUDA stream after the collective, which is why fsdp1 needs no
streams of its own. Backend-specific choices live here too. Every collective goes through
``group_health.issue``, and ``check_in_step`` compares the ranks' counts of them.
"""

import ctypes
import pickle
from typing import Any, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh  # noqa: F401 (re-exported: comm.DeviceMesh)

from .group_health import GuardedWork, ProcessGroupBroken, health_of, issue, issue_async  # noqa: F401 (re-exported: comm.health_of, ...)
from .groups import (  # noqa: F401 (re-exported: comm.group_rank, ...)
    ProcessGroup,
    ProcessGroups,
    Work,
    _all_gather_single,
    _reduce_scatter_single,
    communicates,
    default_group,
    device_mesh_of,
    global_rank,
    global_rank_of,
    group_rank,
    group_size,
    is_gloo,
    is_gloo_pair,
    is_initialized,
    is_process_group,
    mesh_groups,
    new_gloo_group,
    own_group,
    regrouped_mesh,
    subgroup_of_this_rank,
    timeout_of,
)


class Waitable(Protocol):
    """Something in flight that ``wait()`` finishes: a collective this module started, or what a
    communication hook returned for one."""

    def wait(self) -> object: ...


class UserAllGather(Protocol):
    """An all-gather the user supplies (torch's ``AllGather`` of ``set_custom_all_gather``): it
    allocates the output buffer, and gathers every rank's input into it."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup,
                 async_op: bool = False) -> Optional[Work]: ...


class UserReduceScatter(Protocol):
    """A reduce-scatter the user supplies (torch's ``ReduceScatter`` of ``set_custom_reduce_scatter``):
    it allocates the input and output buffers, and reduces the input into each rank's output."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup,
                 op: Any) -> Optional[Work]: ...


class Finished:
    """The work of a collective over one rank, which is a local copy or nothing: a job of one rank
    issues no collective, as under torch's FSDP2."""

    def wait(self) -> bool:
        return True


def all_gather_into(output: torch.Tensor, local_shard: torch.Tensor, group: ProcessGroup,
                    about: Optional[str] = None) -> "GuardedWork | PairwiseExchange | Finished":
    """Gather equal shards into one flat ``output`` (rank r's shard lands at ``r * shard.numel()``).
    ``about``: the path of the unit it is for, which a failure names."""
    if group_size(group) == 1:
        output.copy_(local_shard)
        return Finished()
    if is_gloo_pair(group):
        own, peer = _own_and_peer_chunks(output, local_shard.numel(), group)
        own.copy_(local_shard)
        return PairwiseExchange(peer, local_shard, group, "all-gather", about)
    return issue_async(group, "all-gather", local_shard, about,
                        lambda: _all_gather_single(output, local_shard, group=group, async_op=True))


def user_all_gather(gather: UserAllGather, local_shard: torch.Tensor, group: ProcessGroup,
                    about: Optional[str] = None) -> Tuple[torch.Tensor, "GuardedWork | Finished"]:
    """The user's all-gather of equal shards into an output it allocates: the output (rank r's
    shard at ``r * shard.numel()`` once waited for) and the work."""
    output = gather.allocate((local_shard.numel() * group_size(group),), dtype=local_shard.dtype, device=local_shard.device)
    work = issue(group, "all-gather", local_shard, about,
                  lambda: gather(output_tensor=output, input_tensor=local_shard, group=group, async_op=True))
    return output, work or Finished()


def user_reduce_scatter(reduce: UserReduceScatter, unsharded: torch.Tensor, group: ProcessGroup,
                        about: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, "GuardedWork | Finished"]:
    """The user's reduce-scatter (a sum) of ``unsharded``, copied into an input it allocates: the
    input, this rank's output (once waited for) and the work."""
    dtype, device = unsharded.dtype, unsharded.device
    reduce_input = reduce.allocate((unsharded.numel(),), dtype=dtype, device=device)
    reduce_input.copy_(unsharded)
    output = reduce.allocate((unsharded.numel() // group_size(group),), dtype=dtype, device=device)
    work = issue(group, "reduce-scatter", reduce_input, about,  # no async_op: torch's FSDP2 passes none either
                  lambda: reduce(output_tensor=output, input_tensor=reduce_input, group=group, op=dist.ReduceOp.SUM))
    return reduce_input, output, work or Finished()


def reduce_scatter_into(output: torch.Tensor, unsharded: torch.Tensor, group: ProcessGroup,
                        about: Optional[str] = None) -> "GuardedWork | PairwiseExchange | Finished":
    """Sum ``unsharded`` over the ranks and keep this rank's chunk in ``output`` (once waited for)."""
    if group_size(group) == 1:
        output.copy_(unsharded)
        return Finished()
    if is_gloo_pair(group):
        own, peer = _own_and_peer_chunks(unsharded, output.numel(), group)
        return PairwiseExchange(output, peer, group, "reduce-scatter", about, add_on_wait=own)
    return issue_async(group, "reduce-scatter", unsharded, about,
                        lambda: _reduce_scatter_single(output, unsharded, group=group, async_op=True))


def receive_peer_shard(received: torch.Tensor, shard: torch.Tensor, group: ProcessGroup,
                       about: Optional[str] = None) -> "PairwiseExchange":
    """Between two gloo ranks (``is_gloo_pair``): send ``shard`` to the peer and receive the peer's
    into ``received``, once waited for: an all-gather whose caller places the two shards itself."""
    return PairwiseExchange(received, shard, group, "all-gather", about)


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

    def __init__(self, received: torch.Tensor, send: torch.Tensor, group: ProcessGroup, op: str,
                 about: Optional[str], add_on_wait: Optional[torch.Tensor] = None) -> None:
        splits = [0, 0]
        splits[1 - group_rank(group)] = send.numel()
        self._received, self._add_on_wait = received, add_on_wait
        self._work = issue_async(group, op, send, about, lambda: dist.all_to_all_single(
            received, send, output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=True
        ))

    def wait(self) -> bool:
        self._work.wait()
        if self._add_on_wait is not None:
            self._received.add_(self._add_on_wait)
        return True


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, about: Optional[str] = None) -> "GuardedWork | Finished":
    """Sum ``tensor`` over the ranks in place."""
    if group_size(group) == 1:
        return Finished()
    return issue_async(group, "all-reduce", tensor, about, lambda: dist.all_reduce(tensor, group=group, async_op=True))


def all_reduce_with(tensor: torch.Tensor, group: ProcessGroup, maximum: bool) -> "GuardedWork":
    """Sum (or, with ``maximum``, take the largest of) ``tensor`` over the ranks in place."""
    op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
    return issue_async(group, "all-reduce", tensor, None,
                        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True))


def broadcast_from_first(tensor: torch.Tensor, group: ProcessGroup) -> "GuardedWork":
    """Overwrite ``tensor`` on every rank with the group's first rank's."""
    source = dist.get_global_rank(group, 0)
    return issue_async(group, "broadcast", tensor, None,
                        lambda: dist.broadcast(tensor, src=source, group=group, async_op=True))


def exchange_rows(received: torch.Tensor, send: torch.Tensor, group: ProcessGroup, op: str,
                  about: Optional[str] = None) -> "GuardedWork | Finished":
    """An all-to-all of equal rows that leaves this rank out: ``send``'s row ``i`` goes to the ``i``-th
    other rank (in group order) and ``received``'s row ``i`` comes from it. ``op`` names it in a failure."""
    world, rank = group_size(group), group_rank(group)
    if world == 1:
        return Finished()
    row = send.numel() // (world - 1)
    splits = [0 if peer == rank else row for peer in range(world)]
    return issue_async(group, op, send, about, lambda: dist.all_to_all_single(
        received.view(-1), send.view(-1), output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=True))


def all_to_all(output: torch.Tensor, send: torch.Tensor, output_splits: List[int], send_splits: List[int],
               group: ProcessGroup) -> None:
    """Send ``send``'s consecutive pieces (``send_splits``) to the ranks in order; rank r's piece for
    this rank lands in ``output`` after those of the ranks before it. Synchronous: only the
    state-dict paths use it, between steps."""
    issue(group, "all-to-all", send, None, lambda: dist.all_to_all_single(
        output, send, output_split_sizes=output_splits, input_split_sizes=send_splits, group=group))


def scatter_from_first(output: torch.Tensor, full: Optional[torch.Tensor], group: ProcessGroup) -> None:
    """Rank r of ``group`` receives the r-th equal chunk of the first rank's ``full`` (None elsewhere)."""
    chunks = list(full.chunk(group_size(group))) if full is not None else None
    source = dist.get_global_rank(group, 0)
    issue(group, "scatter", output, None, lambda: dist.scatter(output, chunks, src=source, group=group))


def broadcast_object_from_first(obj: Any, group: ProcessGroup) -> Any:
    """The first rank's ``obj`` on every rank (small metadata only: it is pickled)."""
    device = _object_device(group)
    data = _pickled(obj, device)
    size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    source = dist.get_global_rank(group, 0)
    issue(group, "broadcast of an object's size", size, None, lambda: dist.broadcast(size, src=source, group=group))
    if group_rank(group) != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    issue(group, "broadcast of an object", data, None, lambda: dist.broadcast(data, src=source, group=group))
    return _unpickled(data)


def all_gather_object(obj: Any, group: ProcessGroup) -> List[Any]:
    """Every rank's ``obj``, in group-rank order (small metadata only: it is pickled)."""
    device = _object_device(group)
    data = _pickled(obj, device)
    world = group_size(group)
    sizes = torch.empty(world, dtype=torch.long, device=device)
    mine = torch.tensor([data.numel()], dtype=torch.long, device=device)
    issue(group, "all-gather of object sizes", mine, None, lambda: _all_gather_single(sizes, mine, group=group))
    longest = int(sizes.max().item())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    every = torch.empty(world * longest, dtype=torch.uint8, device=device)
    issue(group, "all-gather of an object", padded, None, lambda: _all_gather_single(every, padded, group=group))
    return [_unpickled(every[rank * longest:rank * longest + int(size)]) for rank, size in enumerate(sizes.tolist())]


def _object_device(group: ProcessGroup) -> torch.device:
    """Where an object's bytes travel: NCCL moves only CUDA tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _pickled(obj: Any, device: torch.device) -> torch.Tensor:
    """``obj`` pickled into a uint8 tensor. torch's own object collectives go through numpy, which
    torch does not install: these need torch alone."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _unpickled(data: torch.Tensor) -> Any:
    data = data.cpu().contiguous()
    return pickle.loads(ctypes.string_at(data.data_ptr(), data.numel()))




def check_in_step(group: ProcessGroup, reached: str, remedy: str) -> None:
    """Every rank of ``group`` reached ``reached`` having issued as many fsdp1 collectives on it, or
    ``ProcessGroupBroken`` on each rank that got here. On gloo a monitored barrier comes first: it
    pairs with nothing but itself, so a rank that is elsewhere, waiting in another collective or not
    calling at all, is named after the group's timeout instead of silently pairing with whatever
    this rank issues next. (Other backends have no such barrier; there the counts are compared
    directly.)"""
    health = health_of(group)
    health.raise_if_broken()
    if group_size(group) == 1:
        return
    issued = health.issued
    if is_gloo(group):
        try:
            group.monitored_barrier(timeout_of(group), wait_all_ranks=True)  # type: ignore[attr-defined]  # not in the stubs
        except Exception as error:  # gloo names the ranks that did not come (to rank 0)
            raise health.fail(f"Not every rank reached {reached} ({remedy});", error, names_the_late=False) from error
    counts = all_gather_object(issued, group)
    if len(set(counts)) > 1:
        by_rank = ", ".join(f"rank {rank}: {count}" for rank, count in zip(health.ranks, counts))
        raise health.fail(
            f"The ranks reached {reached} out of step ({remedy});",
            RuntimeError(f"they had issued different numbers of fsdp1 collectives on this group ({by_rank})"),
        )


def check_every_rank_calls(group: ProcessGroup, api: str) -> None:
    """Before the collectives of ``api`` (a state dict, ``summon_full_params``): a call on some ranks
    only, such as ``state_dict()`` under ``if rank == 0``, becomes ``ProcessGroupBroken`` naming the
    ranks that did not come, instead of a hang or a crash deep in a collective."""
    check_in_step(group, f"{api}", f"{api} is a collective: call it on every rank, and keep its result "
                  "on rank 0 only if only rank 0 needs it")


