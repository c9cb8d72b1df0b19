"""The training-time lifecycle of units: lazy root init, forward and backward hooks, and the
end-of-backward callback. The only module that registers autograd hooks.

One ``RootState`` per root is shared by every unit below it. Per iteration each unit goes
IDLE -> FORWARD_BACKWARD (pre-forward) -> IDLE (post-forward) -> FORWARD_BACKWARD (first output
gradient) -> IDLE (root's final callback). The final callback is the one place that waits for every
outstanding reduction, so after ``loss.backward()`` every ``.grad`` is in place and every unit is
resharded as its strategy asks.

Prefetching starts a unit's all-gather one unit early, without waiting, so that it runs on the
backend's threads (gloo) or stream (NCCL) while the current unit computes. ``ExecutionOrder`` says
which unit is next: backward runs units in the reverse of the order their forwards finished, and
forward (with ``forward_prefetch``) repeats the first iteration's order.
"""

from collections import deque
from enum import Enum, auto
from functools import partial
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple

import torch
from torch.autograd import Variable
from torch.autograd.profiler import record_function

from ._device import move_to_device
from ._flat_param import FlatParamHandle, GradReduction, HandleTrainingState
from ._traversal import fsdp_units, iter_tensors, unit_paths
from .api import BackwardPrefetch, ShardingStrategy

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel as Unit


class TrainingState(Enum):
    """What a unit is doing, named as torch's ``TrainingState``."""

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


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
        self.order = ExecutionOrder()
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

    def path_of(self, unit: "Unit") -> str:
        return self.unit_paths.get(unit, "?")


def lazy_init(unit: "Unit") -> None:
    """Make ``unit`` the root of every unit below it, the first time it is used from the outside."""
    if unit._is_root is not None:
        return
    state = RootState(unit)
    for member in state.units:
        member._is_root = member is unit
        member._root_state = state


def register_post_backward_hook(unit: "Unit") -> None:
    """Reduce the unit's gradient as soon as autograd has accumulated it into the flat parameter."""
    if unit._handle is not None and unit._handle.flat_param.requires_grad:
        unit._handle.flat_param.register_post_accumulate_grad_hook(partial(_post_backward, unit))


def pre_forward(unit: "Unit", args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    with record_function("FSDP::pre_forward"):
        lazy_init(unit)
        state = unit._root_state
        if unit._is_root:
            _assert_idle(state, "forward")
            state.order.start_forward()
            for member in state.units:
                if member._handle is not None:
                    member._handle.prepare_gradient_for_backward()
            if unit.compute_device.type != "cpu":
                args, kwargs = move_to_device((args, kwargs), unit.compute_device)
        unit.training_state = TrainingState.FORWARD_BACKWARD
        if unit._handle is not None:
            state.order.record_pre_forward(unit)
            _gather(unit._handle, HandleTrainingState.FORWARD)
            if unit.forward_prefetch:
                _prefetch(state.order.next_in_forward(unit))
            gradient_node = unit._handle.use_unsharded_views()
            if gradient_node is not None and unit._handle.is_sharded:
                gradient_node.register_prehook(partial(_before_unsharded_gradient, state))
        return args, kwargs


def post_forward(unit: "Unit", output: Any) -> Any:
    with record_function("FSDP::post_forward"):
        handle = unit._handle
        if handle is not None:
            unit._root_state.order.record_post_forward(unit)
            if unit.sharding_strategy is ShardingStrategy.FULL_SHARD and not unit._is_root:
                handle.reshard()
            handle.training_state = HandleTrainingState.IDLE
        if torch.is_grad_enabled():
            hook = partial(_pre_backward, unit)
            for tensor in iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(hook)
                    unit._awaits_pre_backward = True
        unit.training_state = TrainingState.IDLE
        return output


def _pre_backward(unit: "Unit", grad: torch.Tensor) -> None:
    """First gradient reaching one of the unit's outputs: gather its parameters for backward."""
    with record_function("FSDP::pre_backward"):
        state = unit._root_state
        state.queue_final_callback()
        if not unit._awaits_pre_backward:
            return
        unit._awaits_pre_backward = False
        unit.training_state = TrainingState.FORWARD_BACKWARD
        if unit._handle is not None:
            if unit._handle.is_sharded:
                state.finish_reductions()
            _gather(unit._handle, HandleTrainingState.BACKWARD_PRE)
            if unit.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
                _prefetch_for_backward(state.order.next_in_backward(unit))


def _gather(handle: FlatParamHandle, training_state: HandleTrainingState) -> None:
    """Enter ``training_state`` with the unit's parameters unsharded."""
    handle.training_state = training_state
    handle.unshard()
    handle.wait_unshard()


def _before_unsharded_gradient(state: RootState, grad_outputs: Tuple[torch.Tensor, ...]) -> None:
    """Autograd is about to allocate a unit's unsharded gradient: finish the reductions still reading
    earlier units' unsharded gradients and free those first, so that no two are alive together (the
    root's gradient, for one, is assembled after every block's reduction has started)."""
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
    """The unit's gradient is complete: start its reduction and reshard."""
    with record_function("FSDP::post_backward"):
        state = unit._root_state
        state.queue_final_callback()
        if flat_param.grad.requires_grad:
            raise RuntimeError(
                f"fsdp1: unit '{state.path_of(unit)}' received a gradient that itself requires grad "
                "(backward with create_graph=True); FSDP does not support gradients of gradients. "
                "Call backward() without create_graph."
            )
        handle = unit._handle
        handle.training_state = HandleTrainingState.BACKWARD_POST
        if unit._sync_gradients:
            state.add_reduction(handle.reduce_grad())
        else:
            handle.keep_grad_unreduced()
        if _reshards_after_backward(unit):
            handle.reshard()
        if unit.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            _prefetch_for_backward(state.order.next_in_backward(unit))


def _reshards_after_backward(unit: "Unit") -> bool:
    """Inside ``no_sync`` SHARD_GRAD_OP keeps parameters unsharded for the next micro-batch."""
    return unit._sync_gradients or unit.sharding_strategy is not ShardingStrategy.SHARD_GRAD_OP


def _finalize_backward(state: RootState) -> None:
    """Root's end of backward: finish reductions, reshard units whose post-backward never ran
    (unused parameters), install ``.grad`` and return every unit to IDLE."""
    with record_function("FSDP::post_backward_final_callback"):
        state.finish_reductions()
        for unit in state.units:
            handle = unit._handle
            if handle is not None:
                if _reshards_after_backward(unit):
                    handle.reshard()
                handle.prepare_gradient_for_optim()
                handle.training_state = HandleTrainingState.IDLE
            unit.training_state = TrainingState.IDLE
            unit._awaits_pre_backward = False
        state.order.fix_pre_forward()
        state.is_final_callback_queued = False


def _assert_idle(state: RootState, action: str) -> None:
    for unit in state.units:
        if unit.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                f"fsdp1: cannot start {action}: unit '{state.path_of(unit)}' is in state "
                f"{unit.training_state.name}, expected IDLE. A previous forward or backward did not finish "
                "(an exception inside it?); rebuild the model or restart the step from a clean state."
            )
