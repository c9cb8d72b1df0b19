"""The training-time lifecycle of units: lazy root init, forward and backward hooks, and the
end-of-backward callback. The only module that registers autograd hooks.

One ``RootState`` per root is shared by every unit below it. Per iteration each unit goes
IDLE -> FORWARD_BACKWARD (pre-forward) -> IDLE (post-forward) -> FORWARD_BACKWARD (first output
gradient) -> IDLE (root's final callback). The final callback is the one place that waits for every
outstanding reduction, so after ``loss.backward()`` every ``.grad`` is in place and every unit is
resharded as its strategy asks. A root forward that finds a unit outside IDLE knows the previous
forward or backward raised, and first undoes what it left (``RootState.recover``).

The hooks run eagerly under ``torch.compile``: dynamo breaks the graph at each of them and compiles
the module bodies between (``eager_only``).

Prefetching starts a unit's all-gather one unit early, without waiting, so that it runs on the
backend's threads (gloo) or stream (NCCL) while the current unit computes. ``ExecutionOrder`` says
which unit is next: backward runs units in the reverse of the order their forwards finished, and
forward (with ``forward_prefetch``) repeats the first iteration's order.
"""

import functools
import sys
import weakref
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Tuple, TypeVar

import torch
from torch.autograd import Variable
from torch.autograd.profiler import record_function

from . import _collectives as comm
from ._common import RESHARD_AFTER_FORWARD, TrainingState
from ._device import move_to_device
from ._flat_param import FlatParamHandle, GradReduction, HandleState
from ._mixed_precision import BufferPrecision, cast_floating_tensors
from ._traversal import fsdp_units, iter_tensors, iter_unit_submodules, unit_paths
from .api import BackwardPrefetch, ShardingStrategy

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel as Unit


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def eager_only(fn: _Fn) -> _Fn:
    """Run ``fn`` outside any ``torch.compile`` graph: dynamo breaks the graph at the call and runs it
    eagerly (its collectives, storage resizes and hook registrations cannot be traced). Dynamo is
    only asked once it is loaded, so eager use never pays its import (about 2 s here)."""
    disabled: List[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch._dynamo.disable(fn, recursive=True))
        return disabled[0](*args, **kwargs)

    return call  # type: ignore[return-value]


_AT_REST = (TrainingState.IDLE, TrainingState.SUMMON_FULL_PARAMS)  # no forward or backward under way


class ExecutionOrder:
    """The order units ran forward, from which the next unit to prefetch is read.

    The post-forward order is recorded afresh every forward, so backward prefetching follows the graph
    that actually ran. The pre-forward order is fixed by the first iteration that runs a backward, as
    forward prefetching has to guess the next unit before it runs (torch makes the same assumption of a
    static graph).
    """

    def __init__(self) -> None:
        self._post_forward: List["Unit"] = []
        self._post_forward_index: Dict["Unit", int] = {}
        self._pre_forward: List["Unit"] = []
        self._pre_forward_index: Dict["Unit", int] = {}
        self._pre_forward_is_fixed = False

    def start_forward(self) -> None:
        self._post_forward.clear()
        self._post_forward_index.clear()

    def record_pre_forward(self, unit: "Unit") -> None:
        if not self._pre_forward_is_fixed and unit not in self._pre_forward_index:
            self._pre_forward_index[unit] = len(self._pre_forward)
            self._pre_forward.append(unit)

    def record_post_forward(self, unit: "Unit") -> None:
        if unit not in self._post_forward_index:
            self._post_forward_index[unit] = len(self._post_forward)
            self._post_forward.append(unit)

    def fix_pre_forward(self) -> None:
        self._pre_forward_is_fixed = True

    @property
    def is_fixed(self) -> bool:
        return self._pre_forward_is_fixed

    def check_same_on_every_rank(self, paths: Dict["Unit", str], group: Any) -> None:
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

    def next_in_backward(self, unit: "Unit") -> Optional["Unit"]:
        index = self._post_forward_index.get(unit)
        return self._post_forward[index - 1] if index else None

    def next_in_forward(self, unit: "Unit") -> Optional["Unit"]:
        index = self._pre_forward_index.get(unit)
        if index is None or index + 1 >= len(self._pre_forward):
            return None
        return self._pre_forward[index + 1]


class RootState:
    """Runtime shared by a root and its units: the unit list, the final callback, reductions in flight.

    At most ``MAX_REDUCTIONS_IN_FLIGHT`` gradient reductions are outstanding. Under a sharded
    strategy each one holds an unsharded gradient, so it is finished as the next unit's backward
    starts or before the next unsharded gradient is allocated (``_before_unsharded_gradient``),
    whichever comes first: the reduction overlaps the resharding and the next all-gather, and peak
    memory stays that of a synchronous reduce-scatter.
    """

    MAX_REDUCTIONS_IN_FLIGHT = 2

    def __init__(self, root: "Unit") -> None:
        self.units: List["Unit"] = fsdp_units(root)
        self.unit_paths: Dict["Unit", str] = unit_paths(root)
        self.is_final_callback_queued = False
        self.is_unchecked_after_abort = False
        self.process_group = root.process_group
        self.order = ExecutionOrder()
        self.buffers = BufferPrecision(self.units)
        self._reductions: Deque[GradReduction] = deque()

    def queue_final_callback(self) -> None:
        if not self.is_final_callback_queued:
            self.is_final_callback_queued = True
            Variable._execution_engine.queue_callback(partial(_finalize_backward, self))

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
            if unit._handle is not None:
                managed.add(id(unit._handle.flat_param))
                managed.update(id(p) for p in (unit._handle.orig_params() if unit._handle.use_orig_params else ()))
        root = next(unit for unit in self.units if unit._is_root)
        return [p for p in root.parameters() if id(p) not in managed]

    def path_of(self, unit: "Unit") -> str:
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
            failures.append(_failure_of(self._reductions.popleft().work.wait))
        failures.extend(_failure_of(partial(_reset_unit, unit)) for unit in self.units)
        self.is_final_callback_queued = False
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


def _failure_of(call: Callable[[], Any]) -> Optional[Exception]:
    """Run ``call``; what it raised, so that a recovery undoes everything before raising the first."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - raised by the caller once every unit is reset
        return error
    return None


def _reset_unit(unit: "Unit") -> None:
    """The unit sharded, IDLE and awaiting nothing, its gradients as before the aborted call; a unit
    inside ``summon_full_params`` (a forward there is refused before it starts) belongs to the
    context, which restores it on exit."""
    if unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
        return
    if unit._handle is not None:
        unit._handle.abandon_backward()
    unit.training_state = TrainingState.IDLE
    unit._awaits_pre_backward = False
    unit._awaits_reduction = False


def lazy_init(unit: "Unit") -> None:
    """Make ``unit`` the root of every unit below it, the first time it is used from the outside."""
    if unit._is_root is not None:
        return
    state = RootState(unit)
    for member in state.units:
        member._is_root = member is unit
        member._root_state = state
    state.buffers.use(full_precision=False)  # cast once, as torch's: full-precision evaluation sees them rounded


def _computes_in_full_precision(unit: "Unit") -> bool:
    """Evaluation in full precision under ``FSDP_USE_FULL_PREC_IN_EVAL=1``: decided by the unit's
    handle, or for a unit without parameters by any unit below it (as torch's)."""
    if unit._handle is not None:
        return unit._handle.forces_full_precision
    return any(u._handle.forces_full_precision for u in unit._root_state.units if u._handle is not None)


def adopt_replaced_flat_params(module: "torch.nn.Module") -> None:
    """Every unit in ``module`` takes a flat parameter a client replaced since (Accelerate's upcast)
    as its shard: before a state dict or ``summon_full_params`` reads the shards, as before a forward."""
    for unit in fsdp_units(module):
        if unit._handle is not None:
            unit._handle.write_back_orig_params()  # first, as at a forward: adopting a new shard re-points the originals
            unit._handle.adopt_replaced_flat_param()


class WeakPartial:
    """``partial(fn, *objects)`` that holds the objects weakly, for hooks kept by a tensor or an
    autograd node: the garbage collector cannot see through those, so a hook holding its unit would
    close an uncollectable cycle (unit -> flat parameter or its views -> hook -> unit) and a deleted
    model would never be freed. Once an object is gone the call does nothing."""

    def __init__(self, fn: Callable[..., Any], *objects: Any) -> None:
        self._fn = fn
        self._refs = tuple(weakref.ref(obj) for obj in objects)

    def __call__(self, *args: Any) -> Any:
        objects = [ref() for ref in self._refs]
        if any(obj is None for obj in objects):
            return None
        return self._fn(*objects, *args)


def forget_roots(module: "torch.nn.Module") -> None:
    """A new unit around units already used on their own makes them nested: decide roots afresh."""
    for member in fsdp_units(module):
        member._is_root = None
        member._root_state = None


def register_post_backward_hook(unit: "Unit") -> None:
    """Reduce the unit's gradient as soon as autograd has accumulated it into the flat parameter.
    Registered at construction, or at the first forward that needs it, so that a unit frozen at wrap
    time and unfrozen later still reduces its gradient."""
    if unit._handle is not None and not unit._has_post_backward_hook and unit._handle.flat_param.requires_grad:
        unit._handle.flat_param.register_post_accumulate_grad_hook(WeakPartial(_post_backward, unit))
        unit._has_post_backward_hook = True


def register_forward_hooks(unit: "Unit") -> None:
    """Gather and reshard around every call of the wrapped module, not only those through the
    wrapper, and around a call of any of its submodules made from outside the unit's forward:
    ``generate()`` reaches the wrapped model through attribute forwarding and calls it, or its
    encoder, directly, which torch's FSDP1 cannot serve without ``summon_full_params``. A module
    inside a nested unit that uses a tied parameter this unit holds counts as one of its submodules."""
    module = unit._fsdp_wrapped_module
    module.register_forward_pre_hook(partial(pre_forward, unit), prepend=True, with_kwargs=True)
    module.register_forward_hook(partial(post_forward, unit))
    submodules = {id(m): m for m in iter_unit_submodules(module, unit._ignored.modules)}
    if unit._handle is not None:
        submodules.update((id(m), m) for m in unit._handle.param_modules() if m is not module)
    for submodule in submodules.values():
        submodule.register_forward_pre_hook(partial(_pre_submodule_forward, unit), prepend=True, with_kwargs=True)
        submodule.register_forward_hook(partial(_post_submodule_forward, unit))


def _pre_submodule_forward(
    unit: "Unit", submodule: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """A submodule called while its unit is IDLE is called from outside the unit's forward: run it
    as a forward of the unit. Inside the unit's forward or backward this is one attribute check,
    which dynamo traces through."""
    if unit.training_state is not TrainingState.IDLE or unit._handle is None:
        return None
    unit._submodule_forward = submodule
    return pre_forward(unit, submodule, args, kwargs)


def _post_submodule_forward(unit: "Unit", submodule: torch.nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
    if unit._submodule_forward is not submodule:
        return None
    unit._submodule_forward = None
    return post_forward(unit, submodule, args, output)


@eager_only
def pre_forward(
    unit: "Unit", module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    with record_function("FSDP::pre_forward"):
        if unit.training_state is TrainingState.SUMMON_FULL_PARAMS:  # torch's raises AssertionError too
            raise AssertionError(
                "fsdp1: forward was called inside summon_full_params(), which FSDP does not support. "
                "Run the forward after leaving the context."
            )
        lazy_init(unit)
        state = unit._root_state
        if unit._is_root:
            comm.health_of(state.process_group).raise_if_broken()
            if not state.is_clean() and not _inside_backward():
                state.recover()
            if state.is_unchecked_after_abort and not _inside_backward():
                state.check_after_abort()
            state.order.start_forward()
            for member in state.units:
                if member._handle is not None:
                    _start_iteration(member)
            if unit.compute_device.type != "cpu":
                args, kwargs = move_to_device((args, kwargs), unit.compute_device)
            state.buffers.use(full_precision=_computes_in_full_precision(unit))
        args, kwargs = _cast_inputs(unit, args, kwargs)
        unit.training_state = TrainingState.FORWARD_BACKWARD
        handle = unit._handle
        if handle is not None:
            state.order.record_pre_forward(unit)
            _gather(handle)
            if unit.forward_prefetch:
                _prefetch(state.order.next_in_forward(unit))
            gradient_node = handle.use_unsharded_views()
            register_post_backward_hook(unit)
            if gradient_node is not None:
                gradient_node.register_prehook(WeakPartial(_before_unsharded_gradient, state, handle))
        return args, kwargs


def _cast_inputs(unit: "Unit", args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Floating-point inputs in param_dtype: the root's by default (``cast_root_forward_inputs``),
    any unit's with ``cast_forward_inputs``; none when evaluating in full precision."""
    precision = unit.mixed_precision
    if precision is None or precision.param_dtype is None:
        return args, kwargs
    if not (precision.cast_forward_inputs or (unit._is_root and precision.cast_root_forward_inputs)):
        return args, kwargs
    if _computes_in_full_precision(unit):
        return args, kwargs
    return cast_floating_tensors(precision.param_dtype, (args, kwargs))


def _start_iteration(unit: "Unit") -> None:
    """A unit still gathered by a forward whose backward never came (an eval forward with grad
    enabled) may hold values an optimizer step has since changed: gather it afresh. Inside
    ``no_sync`` SHARD_GRAD_OP keeps its gathered parameters on purpose, and no step comes between.
    A flat parameter a client replaced (Accelerate's upcast) becomes the shard."""
    unit._handle.write_back_orig_params()  # first: resharding puts the originals back in the module
    if unit._sync_gradients:
        unit._handle.reshard()
    unit._handle.adopt_replaced_flat_param()
    unit._handle.write_back_orig_grads()


@eager_only
def abort_forward(unit: "Unit") -> None:
    """The forward raised: undo what it left at once, so that an optimizer step or a state dict taken
    next sees every unit sharded and its gradients as they were. The root recovers every unit; a
    nested unit (called directly, or inside a forward that catches the error) recovers itself."""
    if unit._is_root is None or _inside_backward():
        return
    if unit._is_root:
        unit._root_state.recover()
    else:
        _reset_unit(unit)


def _current_graph_task() -> int:
    """The autograd graph task running now (-1 outside backward); a reentrant checkpoint's
    recomputation runs its backward as a nested task."""
    return torch._C._current_graph_task_id()


def _inside_backward() -> bool:
    """A root forward inside a backward is a recomputation (activation checkpointing around the
    root), not a new iteration."""
    return _current_graph_task() != -1


@eager_only
def post_forward(unit: "Unit", module: torch.nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
    """End the unit's forward. A forward without grad has no backward to come, so every unit, the root
    and SHARD_GRAD_OP ones included, reshards at once; otherwise FULL_SHARD units reshard and the root
    stays gathered for backward, and so does any unit that is not sharded, unless it computes on a
    low-precision copy, which a cast remakes for backward (torch's frees it too). The module always
    sees its original parameters again."""
    with record_function("FSDP::post_forward"):
        handle = unit._handle
        if handle is not None:
            unit._root_state.order.record_post_forward(unit)
            if (
                not torch.is_grad_enabled()
                or (unit.sharding_strategy in RESHARD_AFTER_FORWARD and not unit._is_root)
                or handle.computes_on_low_precision_copy
            ):
                handle.reshard()
            else:
                handle.keep_gathered_for_backward()
        if torch.is_grad_enabled():
            hook = partial(_pre_backward, unit)
            for tensor in iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(hook)
                    unit._awaits_pre_backward = True
        unit.training_state = TrainingState.IDLE
        return output


def _pre_backward(unit: "Unit", grad: torch.Tensor) -> None:
    """First gradient of this backward reaching one of the unit's outputs: gather its parameters.

    Keyed on the unit's state, not on which forward made the output, so that two forwards followed
    by two backwards work as with DDP: each backward finds the unit IDLE and gathers it again.
    """
    with record_function("FSDP::pre_backward"):
        state = unit._root_state
        state.queue_final_callback()
        if unit.training_state is TrainingState.FORWARD_BACKWARD:
            return
        unit._awaits_pre_backward = False
        unit._backward_graph_task = _current_graph_task()
        unit.training_state = TrainingState.FORWARD_BACKWARD
        handle = unit._handle
        if handle is not None:
            if handle.is_sharded:
                state.finish_reductions()
            handle.write_back_orig_params(is_gathered_for_backward=handle.holds_gathered_copy)
            _gather(handle)
            handle.use_forward_views()
            if unit.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
                _prefetch_for_backward(state.order.next_in_backward(unit))


def _gather(handle: FlatParamHandle) -> None:
    """The unit's parameters unsharded (started now, or by a prefetch), waited for."""
    handle.unshard()
    handle.wait_unshard()


def _before_unsharded_gradient(state: RootState, handle: FlatParamHandle, grad_outputs: Tuple[torch.Tensor, ...]) -> None:
    """Autograd is about to assemble a unit's unsharded gradient and accumulate it into the flat
    parameter: move the optimizer's gradient aside first, and (sharded) finish the reductions still
    reading earlier units' unsharded gradients so that no two are alive together (the root's
    gradient, for one, is assembled after every block's reduction has started)."""
    handle.prepare_gradient_for_backward()
    if handle.is_sharded:
        state.finish_reductions()


def _prefetch(unit: Optional["Unit"]) -> None:
    """Start ``unit``'s all-gather without waiting; its own pre-forward or pre-backward waits."""
    if unit is not None and unit._handle is not None:
        unit._handle.unshard()


def _prefetch_for_backward(unit: Optional["Unit"]) -> None:
    """Prefetch only a unit whose backward is still to come, so that none is gathered twice."""
    if unit is not None and unit._awaits_pre_backward:
        _prefetch(unit)


def _post_backward(unit: "Unit", flat_param: torch.Tensor) -> None:
    """The unit's gradient is complete: start its reduction and reshard.

    A reentrant activation checkpoint inside the unit recomputes part of it in a nested backward,
    whose accumulation into the flat parameter is only part of the gradient (torch's FSDP1 reduces
    and reshards there, pytorch#89781): a gradient accumulated in another graph task than the
    unit's backward began in waits, for the unit's own accumulation or the final callback.
    """
    with record_function("FSDP::post_backward"):
        state = unit._root_state
        state.queue_final_callback()
        if flat_param.grad.requires_grad:
            raise RuntimeError(
                f"fsdp1: unit '{state.path_of(unit)}' received a gradient that itself requires grad "
                "(backward with create_graph=True); FSDP does not support gradients of gradients. "
                "Call backward() without create_graph."
            )
        if _current_graph_task() != unit._backward_graph_task:
            unit._awaits_reduction = True
            return
        _reduce_and_reshard(state, unit)


def _reduce_and_reshard(state: RootState, unit: "Unit") -> None:
    unit._awaits_reduction = False
    handle = unit._handle
    if _reshards_after_backward(unit):
        handle.reshard()  # first: the unsharded parameters are freed before the reduction allocates
    if unit._sync_gradients:
        state.add_reduction(handle.reduce_grad())
    else:
        handle.keep_grad_unreduced()
    if unit.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        _prefetch_for_backward(state.order.next_in_backward(unit))


def _reshards_after_backward(unit: "Unit") -> bool:
    """Inside ``no_sync`` SHARD_GRAD_OP keeps parameters unsharded for the next micro-batch."""
    return unit._sync_gradients or unit.sharding_strategy in RESHARD_AFTER_FORWARD + (ShardingStrategy.NO_SHARD,)


def _finalize_backward(state: RootState) -> None:
    """Root's end of backward: finish reductions, reshard units whose post-backward never ran
    (unused parameters), install ``.grad`` and return every unit to IDLE."""
    with record_function("FSDP::post_backward_final_callback"):
        for unit in state.units:
            if unit._awaits_reduction:
                _reduce_and_reshard(state, unit)
        state.finish_reductions()
        for unit in state.units:
            handle = unit._handle
            if handle is not None:
                if _reshards_after_backward(unit):
                    handle.reshard()
                elif handle.state is not HandleState.SHARDED:  # kept gathered (no_sync); an unused unit never was
                    handle.use_resting_views()
                handle.prepare_gradient_for_optim()
            unit.training_state = TrainingState.IDLE
            unit._awaits_pre_backward = False
        first_iteration = not state.order.is_fixed
        state.order.fix_pre_forward()
        state.is_final_callback_queued = False
        root = state.units[0]
        if first_iteration and root.world_size > 1:
            state.order.check_same_on_every_rank(state.unit_paths, root.process_group)
