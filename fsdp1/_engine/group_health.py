"""The health of each process group fsdp1 uses: every collective is issued through ``issue``, which
counts it per group and keeps the last few (``GroupHealth``), so that a failed collective breaks the
group for fsdp1 and no rank goes on to pair its next collectives with the wrong partners.

The health belongs to the group, not to a root: units of several roots, the state-dict paths and
``fsdp1.checkpoint`` share a group, and whichever collective fails, none of them may pair its next
collective with the wrong partner. A per-collective fingerprint (one more small collective each) is
the debug option ``FSDP1_DEBUG_COLLECTIVES=1``, not the default.
"""

import atexit
import os
import time
import weakref
import zlib
from collections import deque
from typing import Callable, Deque, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from .groups import ProcessGroup, Work, _all_gather_single, communicates, group_size, is_gloo


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
        self.is_gloo = communicates(group) and is_gloo(group)

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


def issue(group: ProcessGroup, op: str, tensor: Optional[torch.Tensor], about: Optional[str],
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


def issue_async(group: ProcessGroup, op: str, tensor: Optional[torch.Tensor], about: Optional[str],
                 start: Callable[[], Optional[Work]]) -> GuardedWork:
    """``issue`` for a collective started with ``async_op=True``, which returns its ``Work``."""
    guarded = issue(group, op, tensor, about, start)
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


atexit.register(_let_gloo_workers_finish)
