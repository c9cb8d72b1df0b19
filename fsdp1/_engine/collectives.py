"""The only place fsdp1 calls ``torch.distributed``.

Every collective is issued with ``async_op=True`` and returns its ``Work``: gloo then progresses it
on its own threads and NCCL on its own stream, so the caller decides how late to wait. Waiting on
a ``Work`` also orders the current CUDA stream after the collective, which is why fsdp1 needs no
streams of its own (see DESIGN.md §4). Version shims and backend-specific choices live here too.

Every collective goes through ``_issue``, which counts it per process group and keeps the last few
(``GroupHealth``): a failed collective breaks the group for fsdp1, so no rank goes on to pair its
next collectives with the wrong partners, and ``check_in_step`` compares the counts.
"""

import atexit
import ctypes
import os
import pickle
import time
import weakref
import zlib
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh  # noqa: F401 (re-exported: comm.DeviceMesh)

ProcessGroup = dist.ProcessGroup
Work = dist.Work


@dataclass(frozen=True)
class ProcessGroups:
    """The groups a unit communicates over: it shards over ``shard`` and, under a hybrid strategy,
    all-reduces its sharded gradient over ``replicate`` (None when there is no replica to sync)."""

    shard: ProcessGroup
    replicate: Optional[ProcessGroup]


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


# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_group() -> ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError(
            "fsdp1: torch.distributed is not initialized. Call torch.distributed.init_process_group() "
            "(e.g. under torchrun) first."
        )
    return group


def mesh_groups(mesh: DeviceMesh) -> List[ProcessGroup]:
    """The process group of each of ``mesh``'s dimensions, in dimension order."""
    return [mesh.get_group(mesh_dim=dim) for dim in range(mesh.ndim)]


_OWN_GROUPS: Dict[ProcessGroup, ProcessGroup] = {}


def own_group() -> ProcessGroup:
    """A group of this rank alone, made once per default group (collective the first time: every
    rank makes every rank's)."""
    world = default_group()
    if world not in _OWN_GROUPS:
        _OWN_GROUPS[world] = dist.new_subgroups(group_size=1)[0]
    return _OWN_GROUPS[world]


def group_rank(group: ProcessGroup) -> int:
    """This rank within ``group``; asked of the group itself, so that a group made without
    ``init_process_group`` (a stand-in for planning or tests) answers too, as under torch's FSDP1."""
    return group.rank()


def group_size(group: ProcessGroup) -> int:
    return group.size()


def is_process_group(group: Any) -> bool:
    """A torch ProcessGroup, or an object that answers ``rank()`` and ``size()`` as one does."""
    return isinstance(group, ProcessGroup) or (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None)))


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
    return _issue_async(group, "all-gather", local_shard, about,
                        lambda: _all_gather_single(output, local_shard, group=group, async_op=True))


def user_all_gather(gather: UserAllGather, local_shard: torch.Tensor, group: ProcessGroup,
                    about: Optional[str] = None) -> Tuple[torch.Tensor, "GuardedWork | Finished"]:
    """The user's all-gather of equal shards into an output it allocates: the output (rank r's
    shard at ``r * shard.numel()`` once waited for) and the work."""
    output = gather.allocate((local_shard.numel() * group_size(group),), dtype=local_shard.dtype, device=local_shard.device)
    work = _issue(group, "all-gather", local_shard, about,
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
    work = _issue(group, "reduce-scatter", reduce_input, about,  # no async_op: torch's FSDP2 passes none either
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
    return _issue_async(group, "reduce-scatter", unsharded, about,
                        lambda: _reduce_scatter_single(output, unsharded, group=group, async_op=True))


def receive_peer_shard(received: torch.Tensor, shard: torch.Tensor, group: ProcessGroup,
                       about: Optional[str] = None) -> "PairwiseExchange":
    """Between two gloo ranks (``is_gloo_pair``): send ``shard`` to the peer and receive the peer's
    into ``received``, once waited for: an all-gather whose caller places the two shards itself."""
    return PairwiseExchange(received, shard, group, "all-gather", about)


def is_gloo_pair(group: ProcessGroup) -> bool:
    """Two gloo ranks, where an exchange of chunks beats gloo's own collectives (``PairwiseExchange``)."""
    return group_size(group) == 2 and _is_gloo(group)


def communicates(group: Any) -> bool:
    """A group whose collectives move data: not a fake one (the memory estimator's), nor a stand-in
    that only answers ``rank()`` and ``size()`` (a planning or test object, never initialised)."""
    return isinstance(group, ProcessGroup) and not is_fake(group)


def is_fake(group: ProcessGroup) -> bool:
    """A fake group (the memory estimator's): its collectives move no data."""
    return dist.get_backend(group) == "fake"


def _is_gloo(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


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
        self._work = _issue_async(group, op, send, about, lambda: dist.all_to_all_single(
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
    return _issue_async(group, "all-reduce", tensor, about, lambda: dist.all_reduce(tensor, group=group, async_op=True))


def all_reduce_with(tensor: torch.Tensor, group: ProcessGroup, maximum: bool) -> "GuardedWork":
    """Sum (or, with ``maximum``, take the largest of) ``tensor`` over the ranks in place."""
    op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
    return _issue_async(group, "all-reduce", tensor, None,
                        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True))


def broadcast_from_first(tensor: torch.Tensor, group: ProcessGroup) -> "GuardedWork":
    """Overwrite ``tensor`` on every rank with the group's first rank's."""
    source = dist.get_global_rank(group, 0)
    return _issue_async(group, "broadcast", tensor, None,
                        lambda: dist.broadcast(tensor, src=source, group=group, async_op=True))


def all_to_all(output: torch.Tensor, send: torch.Tensor, output_splits: List[int], send_splits: List[int],
               group: ProcessGroup) -> None:
    """Send ``send``'s consecutive pieces (``send_splits``) to the ranks in order; rank r's piece for
    this rank lands in ``output`` after those of the ranks before it. Synchronous: only the
    state-dict paths use it, between steps."""
    _issue(group, "all-to-all", send, None, lambda: dist.all_to_all_single(
        output, send, output_split_sizes=output_splits, input_split_sizes=send_splits, group=group))


def device_mesh_of(group: ProcessGroup, device_type: str) -> DeviceMesh:
    """A 1-D mesh over ``group``'s ranks that reuses the group (no new group is created), for DTensors."""
    return DeviceMesh.from_group(group, device_type)


def regrouped_mesh(mesh: DeviceMesh, group_size: int) -> DeviceMesh:
    """A 2-D mesh over a 1-D ``mesh``'s ranks whose second dimension groups consecutive runs of
    ``group_size`` of them. Collective: every rank of ``mesh`` creates its groups."""
    return DeviceMesh(mesh.device_type, mesh.mesh.view(-1, group_size))


def scatter_from_first(output: torch.Tensor, full: Optional[torch.Tensor], group: ProcessGroup) -> None:
    """Rank r of ``group`` receives the r-th equal chunk of the first rank's ``full`` (None elsewhere)."""
    chunks = list(full.chunk(group_size(group))) if full is not None else None
    source = dist.get_global_rank(group, 0)
    _issue(group, "scatter", output, None, lambda: dist.scatter(output, chunks, src=source, group=group))


def broadcast_object_from_first(obj: Any, group: ProcessGroup) -> Any:
    """The first rank's ``obj`` on every rank (small metadata only: it is pickled)."""
    device = _object_device(group)
    data = _pickled(obj, device)
    size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    source = dist.get_global_rank(group, 0)
    _issue(group, "broadcast of an object's size", size, None, lambda: dist.broadcast(size, src=source, group=group))
    if group_rank(group) != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _issue(group, "broadcast of an object", data, None, lambda: dist.broadcast(data, src=source, group=group))
    return _unpickled(data)


def subgroup_of_this_rank(rank_lists: List[List[int]]) -> ProcessGroup:
    """Make one group per list of global ranks (collective: every rank makes all of them, in the
    same order) and return the one this rank is in."""
    group, _ = dist.new_subgroups_by_enumeration(rank_lists)
    return group


def new_gloo_group() -> ProcessGroup:
    """A gloo group over every rank, for collectives run beside training's (a background save).
    Collective: every rank of the default group creates it."""
    return dist.new_group(backend="gloo")


def global_rank_of(group: ProcessGroup, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def global_rank() -> int:
    return dist.get_rank()


def all_gather_object(obj: Any, group: ProcessGroup) -> List[Any]:
    """Every rank's ``obj``, in group-rank order (small metadata only: it is pickled)."""
    device = _object_device(group)
    data = _pickled(obj, device)
    world = group_size(group)
    sizes = torch.empty(world, dtype=torch.long, device=device)
    mine = torch.tensor([data.numel()], dtype=torch.long, device=device)
    _issue(group, "all-gather of object sizes", mine, None, lambda: _all_gather_single(sizes, mine, group=group))
    longest = int(sizes.max().item())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    every = torch.empty(world * longest, dtype=torch.uint8, device=device)
    _issue(group, "all-gather of an object", padded, None, lambda: _all_gather_single(every, padded, group=group))
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


# ---------------------------------------------------------------------------------------------- health
class ProcessGroupBroken(RuntimeError):
    """A collective fsdp1 issued failed, or the ranks were found out of step (a rank abandoned a
    forward or backward the others finished, or only some ranks called a collective API). The ranks
    may now wait in collectives that pair with the wrong partners, so every further fsdp1 call on
    the process group raises this error too. A ``RuntimeError``, as torch's own collective failures,
    so code that caught those still catches it."""


class _Record(NamedTuple):
    number: int
    op: str
    numel: int
    dtype: Optional[torch.dtype]
    about: Optional[str]

    def __str__(self) -> str:
        what = f" of {self.numel} {str(self.dtype).replace('torch.', '')} elements" if self.dtype is not None else ""
        unit = "" if self.about is None else f" for unit '{self.about}'" if self.about else " for the root unit"
        return f"collective #{self.number}, {self.op}{what}{unit}"


class GroupHealth:
    """What fsdp1 knows of one process group: how many collectives it issued on it (ranks that run in
    step issue equally many), the last ``RECENT`` of them (a flight recorder, quoted by the error),
    and the first failure, after which nothing more is issued. Torch owns the group object, so the
    health lives beside it in a weak map (``health_of``), shared by every unit on that group."""

    RECENT = 8

    def __init__(self, group: ProcessGroup) -> None:
        self._group = weakref.ref(group)
        self.issued = 0
        self.recent: Deque[_Record] = deque(maxlen=self.RECENT)
        self.failure: Optional[str] = None
        self.compares_every_collective = os.environ.get("FSDP1_DEBUG_COLLECTIVES") == "1"
        self.is_gloo = communicates(group) and _is_gloo(group)

    @property
    def ranks(self) -> List[int]:
        """The group's global ranks (asked when needed: a group made without ``init_process_group``
        has none to tell, and never fails a collective)."""
        group = self._group()
        return dist.get_process_group_ranks(group) if group is not None else []

    def issue(self, op: str, tensor: Optional[torch.Tensor], about: Optional[str]) -> _Record:
        self.raise_if_broken()
        self.issued += 1
        numel, dtype = (tensor.numel(), tensor.dtype) if tensor is not None else (0, None)
        record = _Record(self.issued, op, numel, dtype, about)
        self.recent.append(record)
        return record

    def raise_if_broken(self) -> None:
        if self.failure is not None:
            raise ProcessGroupBroken(
                f"fsdp1: this process group broke earlier, so nothing more runs on it. {self.failure}")

    def fail(self, what: str, error: BaseException, names_the_late: bool = True) -> ProcessGroupBroken:
        """Mark the group broken by ``what`` and return the error to raise (chained to ``error``).
        ``names_the_late``: a timeout means the other ranks did not take part (not so where this rank
        is the one that left the others behind, as after an abandoned iteration)."""
        recent = "; ".join(str(record) for record in self.recent) or "none"
        rank, ranks = dist.get_rank(), self.ranks
        others = [other for other in ranks if other != rank]
        timed_out = names_the_late and "timed out" in str(error).lower()
        missing = f"; rank(s) {others} did not take part in time" if timed_out else ""
        self.failure = (
            f"{what} failed on rank {rank} (process group of ranks {ranks}{missing}): "
            f"{type(error).__name__}: {str(error).strip()[:600]}\nThe ranks are no longer in step, so every "
            "further fsdp1 call on this process group raises this error. The usual causes: a rank died or "
            "stopped; a rank caught an exception in forward or backward and went on (skip a batch on every "
            "rank or on none); a collective API (state_dict, summon_full_params, ...) called on some ranks "
            "only. Find the rank "
            "that failed first (run under torchrun with @record for its traceback), then restart from the last "
            f"complete checkpoint (fsdp1.checkpoint.latest). The last collectives this rank issued here: {recent}."
        )
        return ProcessGroupBroken(f"fsdp1: {self.failure}")


_health: "weakref.WeakKeyDictionary[ProcessGroup, GroupHealth]" = weakref.WeakKeyDictionary()

EXIT_GRACE_S = 0.1
"""How long a process that used a gloo group leaves gloo's worker threads at exit (measured: the
fully_shard example aborted at exit in 15 of 35 runs without it, 0 of 24 with it)."""


def _let_gloo_workers_finish() -> None:
    """At exit (``atexit`` runs before the interpreter starts finalizing), give gloo's worker threads a
    moment when a gloo group fsdp1 used is still alive.

    A gloo worker wakes the waiter of a collective first and drops its own reference to the ``Work``,
    and so to the collective's tensors, afterwards; dropping a tensor that has a Python object takes the
    GIL. ``destroy_process_group`` does not end those threads while anything still holds the group
    (fsdp1's units do, and torch's DTensor caches keep every ``DeviceMesh``, hence its groups, for the
    life of the process). A worker that asks for the GIL once the interpreter is finalizing is ended in
    the middle of a destructor that must not throw: "terminate called without an active exception",
    SIGABRT and a non-zero exit after the script's last line ran, when its last collective (a loss
    all-reduce) came right before the end. torch's own FSDP2 has the same race, less often. The
    wait makes it unlikely, not impossible: a worker starved of the CPU for longer still loses."""
    if any(health.is_gloo for health in list(_health.values())):
        time.sleep(EXIT_GRACE_S)


atexit.register(_let_gloo_workers_finish)


def health_of(group: ProcessGroup) -> GroupHealth:
    health = _health.get(group)
    if health is None:
        health = _health[group] = GroupHealth(group)
    return health


class GuardedWork:
    """A collective's ``Work`` whose failure marks its group broken and raises ``ProcessGroupBroken``."""

    def __init__(self, work: Work, health: GroupHealth, record: _Record) -> None:
        self._work, self._health, self._record = work, health, record

    def wait(self) -> bool:
        try:
            self._work.wait()
        except Exception as error:
            raise self._health.fail(f"The {self._record}", error) from error
        return True


def _issue(group: ProcessGroup, op: str, tensor: Optional[torch.Tensor], about: Optional[str],
           start: Callable[[], Optional[Work]]) -> Optional[GuardedWork]:
    """Issue one collective on a healthy group: an asynchronous one comes back guarded; a failure at
    issue (or of a synchronous one) breaks the group at once."""
    health = health_of(group)
    record = health.issue(op, tensor, about)
    if health.compares_every_collective:
        _compare_fingerprints(group, health, record)
    try:
        work = start()
    except Exception as error:
        raise health.fail(f"The {record}", error) from error
    return GuardedWork(work, health, record) if work is not None else None


def _issue_async(group: ProcessGroup, op: str, tensor: Optional[torch.Tensor], about: Optional[str],
                 start: Callable[[], Optional[Work]]) -> GuardedWork:
    """``_issue`` for a collective started with ``async_op=True``, which returns its ``Work``."""
    guarded = _issue(group, op, tensor, about, start)
    assert guarded is not None, f"the asynchronous {op} returned no Work"
    return guarded


def _compare_fingerprints(group: ProcessGroup, health: GroupHealth, record: _Record) -> None:
    """FSDP1_DEBUG_COLLECTIVES=1 (read when fsdp1 first uses the group): before each collective the
    ranks compare what they are about to issue, so a mismatch of op, size, dtype or unit is named at
    once, where gloo would pair it silently (equal sizes), abort the process (unequal) or wait for
    the timeout. One small all-gather more per collective."""
    dtype = str(record.dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    mine = torch.tensor([zlib.crc32(record.op.encode()), record.numel, zlib.crc32(dtype.encode()),
                         zlib.crc32(str(record.about).encode())], dtype=torch.int64, device=device)
    every = mine.new_empty(group_size(group) * mine.numel())
    try:
        _all_gather_single(every, mine, group=group)
    except Exception as error:
        raise health.fail(f"Comparing the {record} across ranks", error) from error
    rows = every.view(group_size(group), -1)
    differing = [rank for rank in range(len(rows)) if not torch.equal(rows[rank], mine)]
    if differing:
        raise health.fail(
            f"The {record} is not what every rank issues (FSDP1_DEBUG_COLLECTIVES)",
            RuntimeError(f"rank(s) {[health.ranks[r] for r in differing]} issue another op, size, dtype or unit "
                         f"as their collective #{record.number}; their traceback shows which"),
        )


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
    if _is_gloo(group):
        try:
            group.monitored_barrier(_timeout_of(group), wait_all_ranks=True)  # type: ignore[attr-defined]  # not in the stubs
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


def _timeout_of(group: ProcessGroup) -> timedelta:
    """The group's own timeout (init_process_group(timeout=...)); torch keeps it on the backend's options."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d.default_pg_timeout
