"""What a root's units share at run time (``RootState``): the start of an iteration, the execution
order, the reductions in flight, the final callback of a backward and the recovery after an aborted
one.

One ``RootState`` per root is shared by every unit below it. Per iteration each unit goes
IDLE -> FORWARD_BACKWARD (pre-forward) -> IDLE (post-forward) -> FORWARD_BACKWARD (first output
gradient) -> IDLE (root's final callback). The final callback is the one place that waits for every
outstanding reduction, so after ``loss.backward()`` every ``.grad`` is in place and every unit is
resharded as its strategy asks. A root forward that finds a unit outside IDLE knows the previous
forward or backward raised, and first undoes what it left (``RootState.recover``).

Prefetching starts a unit's all-gather one unit early, without waiting, so that it runs on the
backend's threads (gloo) or stream (NCCL) while the current unit computes. ``ExecutionOrder`` says
which unit is next: backward runs units in the reverse of the order their forwards finished, and
forward (with ``forward_prefetch``) repeats the first iteration's order.

Prefetching reaches one unit ahead at most, so ``limit_all_gathers`` has nothing left to limit.
When reductions finish is ``RootState``'s to say; finishing them later still was within noise in
speed and cost one unsharded gradient of peak.
"""

import functools
from collections import deque
from typing import Any, Callable, Deque, Dict, Generic, List, Optional, Protocol, TypeVar

import torch
from torch.autograd.profiler import record_function

from .._torch_internals import queue_backward_callback
from . import collectives as comm
from .common import TrainingState
from .flat_grad import GradReduction
from .handle import FlatParamHandle
from .hooks import inside_backward
from .mixed_precision import BufferPrecision, UnitBuffers
from .traversal import unit_paths


class Unit(UnitBuffers, Protocol):
    """What a root's shared state needs of each of its units (``UnitState`` is the one kind)."""

    handle: Optional[FlatParamHandle]
    process_group: comm.ProcessGroup
    world_size: int
    training_state: TrainingState
    awaits_reduction: bool

    sync_gradients: bool

    def materialize_replaced(self) -> None: ...

    def take_resting_grads(self, reduce_now: bool) -> None: ...

    def await_reduction_if_unreduced(self) -> None: ...

    def reduce_and_reshard(self) -> None: ...

    def finish_backward(self) -> None: ...

    def reset(self) -> None: ...


U = TypeVar("U", bound=Unit)


class ExecutionOrder(Generic[U]):
    """The order units ran forward, from which the next unit to prefetch is read.

    The post-forward order is recorded afresh every forward, so backward prefetching follows the graph
    that actually ran. The pre-forward order is fixed by the first iteration that runs a backward, as
    forward prefetching has to guess the next unit before it runs (torch makes the same assumption of a
    static graph).
    """

    def __init__(self) -> None:
        self._post_forward: List[U] = []
        self._post_forward_index: Dict[U, int] = {}
        self._pre_forward: List[U] = []
        self._pre_forward_index: Dict[U, int] = {}
        self._pre_forward_is_fixed = False

    def start_forward(self) -> None:
        self._post_forward.clear()
        self._post_forward_index.clear()

    def record_pre_forward(self, unit: U) -> None:
        if not self._pre_forward_is_fixed and unit not in self._pre_forward_index:
            self._pre_forward_index[unit] = len(self._pre_forward)
            self._pre_forward.append(unit)

    def record_post_forward(self, unit: U) -> None:
        if unit not in self._post_forward_index:
            self._post_forward_index[unit] = len(self._post_forward)
            self._post_forward.append(unit)

    def fix_pre_forward(self) -> None:
        self._pre_forward_is_fixed = True

    @property
    def is_fixed(self) -> bool:
        return self._pre_forward_is_fixed

    def check_same_on_every_rank(self, paths: Dict[U, str], group: Any) -> None:
        """The first iteration's order, compared across the ranks once: ranks that run units in
        different orders pair different units' shards in every all-gather, which with equal shapes
        trains silently wrong; this names the first difference on every rank instead."""
        mine = [paths.get(unit, "?") for unit in self._pre_forward]
        orders = comm.all_gather_object(mine, group)
        if all(order == orders[0] for order in orders):
            return
        length = max(len(order) for order in orders)
        step = next(i for i in range(length) if len({tuple(o[i:i + 1]) for o in orders}) > 1)
        ran = ", ".join(f"rank {rank} '{order[step]}'" if step < len(order) else f"rank {rank} none"
                        for rank, order in enumerate(orders))
        raise RuntimeError(
            "fsdp1: the ranks ran their FSDP units in different orders in the first iteration, so each "
            "all-gather paired different units' shards and this iteration's results are wrong. The first "
            f"difference is the forward's unit #{step + 1} holding parameters: {ran}. Every rank must run "
            "the same units in the same order: no rank-dependent branches around FSDP units."
        )

    def next_in_backward(self, unit: U) -> Optional[U]:
        index = self._post_forward_index.get(unit)
        return self._post_forward[index - 1] if index else None

    def next_in_forward(self, unit: U) -> Optional[U]:
        index = self._pre_forward_index.get(unit)
        if index is None or index + 1 >= len(self._pre_forward):
            return None
        return self._pre_forward[index + 1]


_AT_REST = (TrainingState.IDLE, TrainingState.SUMMON_FULL_PARAMS)  # no forward or backward under way


class ManualFinalization:
    """``set_manual_backward_finalization``: the caller ends each logical backward (several backwards
    that keep their gradients unreduced, say) with ``finalize_backward``, which reduces what they left.
    fsdp1 still finishes each backward's reductions when autograd ends it, as it does without: the
    gradients are the same, and no reduction waits across backwards. What this owns is torch's
    rules of the mode: when it may change, and one asynchronous finalization awaited at a time."""

    def __init__(self) -> None:
        self.enabled = False
        self.started = False  # a backward ran under the mode since the last finalization
        self.unwaited: Optional[object] = None  # the handle of an asynchronous finalization not waited on

    def reset(self) -> None:
        """``reset_iter_state``: the iteration's finalization is dropped, and its handle with it."""
        self.started = False
        self.unwaited = None


class RootState(Generic[U]):
    """Runtime shared by a root and its units: the unit list, the final callback, reductions in flight.

    At most ``MAX_REDUCTIONS_IN_FLIGHT`` gradient reductions are outstanding. Under a sharded
    strategy each one holds an unsharded gradient, so it is finished as the next unit's backward
    starts or before the next unsharded gradient is allocated, whichever comes first: the reduction
    overlaps the resharding and the next all-gather, and peak memory stays that of a synchronous
    reduce-scatter.
    """

    MAX_REDUCTIONS_IN_FLIGHT = 2

    def __init__(self, root: U, state_of: Callable[[torch.nn.Module], U]) -> None:
        self.unit_paths: Dict[U, str] = {state_of(module): path for module, path in unit_paths(root.owner).items()}
        self.units: List[U] = list(self.unit_paths)  # the root first, in ``modules()`` order
        self.root = root
        self.is_final_callback_queued = False
        self.is_unchecked_after_abort = False
        self.process_group = root.process_group
        self.order: ExecutionOrder[U] = ExecutionOrder()
        self.buffers = BufferPrecision(self.units)
        self._reductions: Deque[GradReduction] = deque()
        self.manual_finalization = ManualFinalization()

    def start_iteration(self) -> None:
        """The root's forward: recover from an aborted iteration, then bring every unit up to date. A
        unit still gathered by a forward whose backward never came (an eval forward, which fully_shard
        units do not reshard after) may hold values an optimizer step has since changed: gather it
        afresh, unless the shard provably did not change since it was gathered (a pipeline
        schedule's forwards before its first backward). Between the backwards of one accumulation
        (``no_sync``) a unit kept gathered keeps its parameters on purpose, and no step comes
        between. A flat parameter a client replaced (Accelerate's upcast) becomes the shard."""
        comm.health_of(self.process_group).raise_if_broken()
        if self.manual_finalization.unwaited is not None:
            raise RuntimeError("The previous gradient reduction must be waited on before forward. fsdp1: call wait() on "
                               "the handle finalize_backward(async_op=True) returned.")  # torch's phrase
        if not self.is_clean() and not inside_backward():
            self.recover()
        if self.is_unchecked_after_abort and not inside_backward():
            self.check_after_abort()
        self.order.start_forward()
        for member in self.units:
            handle = member.handle
            if handle is None:
                continue
            member.materialize_replaced()
            handle.write_back_orig_params()  # first: resharding puts the originals back in the module
            on_meta = handle.views.still_on_meta()
            if on_meta and comm.communicates(member.process_group):  # the memory estimator's dry run is on meta
                raise RuntimeError(  # torch's phrase
                    "FSDP parameters should be materialized from meta device before training, but the following were "
                    f"still on meta device: {on_meta}\nFor example, call module.to_empty(device) to materialize to "
                    "device and call module.reset_parameters() on each module to initialize values."
                )
            keeps_for_accumulation = not member.sync_gradients and handle.grad.is_unreduced
            if not keeps_for_accumulation and not handle.holds_current_gathered_copy:
                handle.reshard()
            handle.adopt_replaced_flat_param()
            handle.grad.take_user_changes()

    def queue_final_callback(self) -> None:
        self.manual_finalization.started |= self.manual_finalization.enabled
        if not self.is_final_callback_queued:
            self.is_final_callback_queued = True
            queue_backward_callback(self.finalize_backward)

    def add_reduction(self, reduction: GradReduction) -> None:
        self._reductions.append(reduction)
        while len(self._reductions) > self.MAX_REDUCTIONS_IN_FLIGHT:
            self._reductions.popleft().finish()

    def finish_reductions(self) -> None:
        while self._reductions:
            self._reductions.popleft().finish()

    @functools.cached_property
    def params_outside_units(self) -> List[torch.nn.Parameter]:
        """The root's parameters no unit flattened (ignored ones, a plain submodule's), found once."""
        managed = set()
        for unit in self.units:
            if unit.handle is not None:
                managed.add(id(unit.handle.flat_param))
                managed.update(id(p) for p in (unit.handle.views.orig_params() if unit.handle.use_orig_params else ()))
        return [p for p in self.root.owner.parameters() if id(p) not in managed]

    def path_of(self, unit: U) -> str:
        return self.unit_paths.get(unit, "?")

    def is_clean(self) -> bool:
        """True unless a forward or backward raised part-way: then some unit is not IDLE, or the
        backward queued its final callback and never ran it."""
        return not self.is_final_callback_queued and all(u.training_state in _AT_REST for u in self.units)

    def recover(self) -> None:
        """Undo what an aborted forward or backward left, so that the next iteration trains as if it
        had never started: reductions in flight are finished and dropped, gradients are
        those from before it, every unit is sharded and IDLE. A failed *collective* is not this case.

        The next forward first checks that the ranks are in step (``check_after_abort``)."""
        failures = []
        while self._reductions:
            work = self._reductions.popleft().work
            if work is not None:
                failures.append(_failure_of(work.wait))
        failures.extend(_failure_of(unit.reset) for unit in self.units)
        self.is_final_callback_queued = False
        self.manual_finalization.reset()
        failure = next((f for f in failures if f is not None), None)
        if failure is not None:
            raise failure
        self.is_unchecked_after_abort = True

    def check_after_abort(self) -> None:
        """Before the first collective after an aborted iteration, check that every rank aborted it at
        the same point: an exception on one rank only leaves the others waiting in a
        collective this rank would pair with its next iteration's (silently, when the shapes agree),
        so that case becomes ``ProcessGroupBroken`` on every rank, after the group's timeout at most.
        Not at the abort itself: an exception nobody catches ends the process at once, as it should."""
        self.is_unchecked_after_abort = False
        comm.check_in_step(
            self.process_group, "fsdp1's check after an exception escaped a forward or backward",
            "an exception on some ranks only leaves the others in collectives this rank abandoned: skip a "
            "batch on every rank or on none",
        )

    def finalize_manually(self) -> None:
        """``finalize_backward``: every unit that synchronises now reduces the gradient its backwards
        left unreduced, at the root's end of backward."""
        for unit in self.units:
            if unit.sync_gradients:
                unit.await_reduction_if_unreduced()
        self.finalize_backward()
        self.manual_finalization.started = False

    def finalize_backward(self) -> None:
        """The root's end of backward: finish reductions, reshard units whose post-backward never ran
        (unused parameters), install ``.grad`` and return every unit to IDLE. On the first iteration
        the ranks' unit orders are compared."""
        with record_function("FSDP::post_backward_final_callback"):
            for unit in self.units:
                unit.take_resting_grads(reduce_now=unit.sync_gradients)
                if unit.awaits_reduction:
                    unit.reduce_and_reshard()
            self.finish_reductions()
            for unit in self.units:
                unit.finish_backward()
            first_iteration = not self.order.is_fixed
            self.order.fix_pre_forward()
            self.is_final_callback_queued = False
            if first_iteration and self.root.world_size > 1:
                self.order.check_same_on_every_rank(self.unit_paths, self.process_group)


def _failure_of(call: Callable[[], Any]) -> Optional[Exception]:
    """Run ``call``; what it raised, so that a recovery undoes everything before raising the first."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - raised by the caller once every unit is reset
        return error
    return None
