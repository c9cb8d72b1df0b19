"""``UnitState``: one unit's runtime state, whose methods are the unit's forward and backward hooks.
The only module that registers a unit's forward and autograd hooks (``group_forward`` registers a
group's on its behalf; the full-precision modules of FSDP1's mixed precision cast their own inputs
and outputs with hooks of ``_wrapper.mixed_precision_argument``).

A unit is the module that owns the state (``owner``: a ``FullyShardedDataParallel``, or any module
that holds a ``UnitState`` under ``FSDP_STATE``) and the module whose forward the hooks wrap
(``hooked``: the wrapped module, or the owner itself). The state owns the handle, the process
group, the schedule its front resolved, the sync flag, the training state and the link to the root's
``RootState``; nothing else writes them.

The hooks run eagerly under ``torch.compile``: dynamo breaks the graph at each of them and compiles
the module bodies between (``eager_only``).

The forward hooks sit on the wrapped module, not in the wrapper's ``forward``: ``generate()``
reaches a wrapped Hugging Face model through attribute forwarding (and an encoder-decoder's encoder
directly), where torch's FSDP1 computes on sharded parameters. Each submodule of the unit gets a
cheap pair too, acting only when the unit is IDLE, i.e. called from outside the unit's own forward.
Backward re-installs the last forward's views after gathering again: activation checkpointing
inside a unit recomputes part of its forward and must reach views tied to the flat parameter; a
post-backward hook firing in another graph task than the unit's backward began in only
accumulates (torch's FSDP1 reduces there and fails, pytorch#89781).
"""

import contextlib
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd.profiler import record_function

from .._torch_internals import forget_post_accumulate_grad_hooks
from ..api import MixedPrecision
from . import collectives as comm
from .common import TrainingState
from .device import move_to_device
from .group_forward import GroupForward
from .handle import RESTING, FlatParamHandle
from .hooks import WeakPartial, current_graph_task, eager_hook, eager_only, inside_backward
from .mixed_precision import cast_floating_tensors
from .root_state import RootState
from .schedule import UnitSchedule
from .traversal import FSDP_STATE, fsdp_units, iter_tensors, iter_unit_submodules
from .views import FLAT_PARAM


def state_of(module: nn.Module) -> "UnitState":
    """The ``UnitState`` of a unit module."""
    return module.__dict__[FSDP_STATE]


class UnitState:
    """The runtime state of one unit, and the hooks that move it through an iteration."""

    def __init__(self, owner: nn.Module, hooked: nn.Module, handle: Optional[FlatParamHandle],
                 process_group: comm.ProcessGroup, schedule: "UnitSchedule[UnitState]",
                 mixed_precision: Optional[MixedPrecision], compute_device: torch.device,
                 ignored_modules: Collection[nn.Module], also_hooked: Sequence[nn.Module] = (),
                 output_dtype: Optional[torch.dtype] = None) -> None:
        self.owner = owner
        self.hooked = hooked
        self.also_hooked = tuple(also_hooked)  # more modules of a unit made of several (fully_shard([norm, head]))
        self.handle = handle
        self.process_group = process_group
        self.world_size = comm.group_size(process_group)
        self.schedule = schedule
        self.mixed_precision = mixed_precision
        self.output_dtype = output_dtype  # fully_shard's MixedPrecisionPolicy casts outputs to it
        self.compute_device = compute_device
        self.ignored_modules = ignored_modules
        self.training_state = TrainingState.IDLE
        self.is_root: Optional[bool] = None  # decided lazily, at the first forward
        self.nested_path: Optional[str] = None  # set when a unit is built around this one: the path from it
        self._root_state: Optional[RootState[UnitState]] = None
        self.sync_gradients = True
        self.awaits_pre_backward = False  # an output of this forward will call _pre_backward
        self._backward_graph_task = -1  # autograd graph task this unit's backward began in
        self.awaits_reduction = False  # a nested backward accumulated a partial gradient
        self.forwards_awaiting_gradient = 0  # forwards since the last backward whose split no gradient reached yet
        self.missed_parameters = False  # since the last reduction, an unsynchronised backward reached the outputs but not the parameters
        self._has_post_backward_hook = False
        self._submodule_forward: Optional[nn.Module] = None  # a submodule called from outside, running
        self._group_forward: Optional[GroupForward] = None  # a unit of several modules: its forward hooks
        for module in (owner, *self.also_hooked):
            module.__dict__[FSDP_STATE] = self
        self.register_post_backward_hook()
        self._register_forward_hooks()

    @property
    def root_state(self) -> "RootState[UnitState]":
        """The root's shared state (the first forward, or ``lazy_init``, decides the root)."""
        if self._root_state is None:
            self.lazy_init()
        assert self._root_state is not None, "lazy_init sets the root state of every unit below the root"
        return self._root_state

    @property
    def has_root_state(self) -> bool:
        return self._root_state is not None

    @property
    def path(self) -> Optional[str]:
        """The unit's clean path from its root, once the root is known (before that, from the unit
        built around it, if any)."""
        return self._root_state.path_of(self) if self._root_state is not None else self.nested_path

    def is_outermost(self) -> bool:
        """Whether this unit is a root: no unit was built around it (then its root state is made now,
        if no forward made it yet). A root-only API called on an inner unit before the first forward
        is refused as after it, instead of making the inner unit a root of its own."""
        if self.nested_path is None:
            self.lazy_init()
        return bool(self.is_root)

    def lazy_init(self) -> None:
        """Make this unit the root of every unit below it, the first time it is used from the outside."""
        if self.is_root is not None:
            return
        state = RootState(self, state_of)
        for member in state.units:
            member.is_root = member is self
            member._root_state = state
        state.buffers.use(full_precision=False)  # cast once, as torch's: full-precision evaluation sees them rounded

    def nest(self, path: str) -> None:
        """A unit was built around this one, which reaches it as ``path``: its root is decided afresh
        (a unit used on its own before becomes nested), and messages name it by that path."""
        self.is_root = None
        self._root_state = None
        self.nested_path = path
        if self.handle is not None:
            self.handle.set_path(path)

    def reset(self) -> None:
        """Sharded, IDLE and awaiting nothing, the gradients as before an aborted call; a unit inside
        ``summon_full_params`` (a forward there is refused before it starts) belongs to the context,
        which restores it on exit."""
        if self.training_state is TrainingState.SUMMON_FULL_PARAMS:
            return
        if self.handle is not None:
            self.handle.abandon_backward()
        self.training_state = TrainingState.IDLE
        self.awaits_pre_backward = False
        self.awaits_reduction = False
        self.forwards_awaiting_gradient = 0
        if self._group_forward is not None:
            self._group_forward.clear()

    @property
    def computes_in_full_precision(self) -> bool:
        """Evaluation in full precision under ``FSDP_USE_FULL_PREC_IN_EVAL=1``: decided by the unit's
        handle, or for a unit without parameters by any unit below it (as torch's)."""
        if self.handle is not None:
            return self.handle.forces_full_precision
        return any(u.handle.forces_full_precision for u in self.root_state.units if u.handle is not None)

    def convert(self, apply: Callable[[], object]) -> None:
        """Run ``nn.Module._apply`` (``apply``: ``.to()``, ``.double()``, ...) on the unit's module with
        the flat parameter registered in place of the originals, so that it converts the one tensor
        that owns the storage; the handle then rebuilds every buffer and view from it. A shard still
        on the meta device whose parameters were replaced by real ones takes them first."""
        self.materialize_replaced()
        self._convert(apply)

    def _convert(self, apply: Callable[[], object]) -> None:
        handle = self.handle
        if handle is None:
            apply()
            return
        flat_param = handle.flat_param
        with handle.converting():
            apply()
        self.compute_device = handle.compute_device  # with offloading the shard stays on the CPU
        # A new object needs the hook, and so does the same one swapped (torch.__future__'s
        # swap_module_params_on_conversion): the hook stayed with the tensor it was swapped with,
        # though its dict of hooks came along, which would keep a new registration from taking.
        for each in (flat_param, handle.flat_param):
            forget_post_accumulate_grad_hooks(each)
        self._has_post_backward_hook = False
        self.register_post_backward_hook()

    def materialize_replaced(self) -> None:
        """A unit sharded on the meta device some of whose parameters were since replaced by real
        tensors (a loader filling the model, ``load_state_dict(assign=True)``): its shard gets
        (uninitialised) storage where they live, in their dtype, so that taking them copies their values in; the
        parameters nobody replaced stay named as still on meta until they get values."""
        handle = self.handle
        like = handle.views.replacement() if handle is not None and handle.local_shard.is_meta else None
        if handle is None or like is None:
            return
        replaced = handle.views.registered()
        flat_param = handle.flat_param

        def onto_device() -> None:
            self.owner._parameters[FLAT_PARAM] = nn.Parameter(torch.empty_like(flat_param, device=like.device, dtype=like.dtype),
                                                              requires_grad=flat_param.requires_grad)

        self._convert(onto_device)
        handle.views.register(replaced)

    # ----------------------------------------------------------------------------- hook registration
    def register_post_backward_hook(self) -> None:
        """Reduce the unit's gradient as soon as autograd has accumulated it into the flat parameter.
        Registered at construction, or at the first forward that needs it, so that a unit frozen at
        wrap time and unfrozen later still reduces its gradient."""
        if self.handle is not None and not self._has_post_backward_hook and self.handle.flat_param.requires_grad:
            self.handle.flat_param.register_post_accumulate_grad_hook(WeakPartial(UnitState._post_backward, self))
            self._has_post_backward_hook = True

    def _register_forward_hooks(self) -> None:
        """Gather and reshard around every call of the hooked module, not only those through the
        wrapper, and around a call of any of its submodules made from outside the unit's forward:
        ``generate()`` reaches the wrapped model through attribute forwarding and calls it, or its
        encoder, directly, which torch's FSDP1 cannot serve without ``summon_full_params``. A module
        inside a nested unit that uses a tied parameter this unit holds counts as one of its submodules."""
        modules = (self.hooked, *self.also_hooked)
        if self.also_hooked:
            self._group_forward = GroupForward(self, modules)
        else:
            self.hooked.register_forward_pre_hook(eager_hook(self.pre_forward), prepend=True, with_kwargs=True)
            self.hooked.register_forward_hook(eager_hook(self.post_forward))
        submodules = {id(m): m for module in modules for m in iter_unit_submodules(module, self.ignored_modules)}
        if self.handle is not None:
            submodules.update((id(m), m) for m in self.handle.views.param_modules() if all(m is not module for module in modules))
        for submodule in submodules.values():
            submodule.register_forward_pre_hook(self._pre_submodule_forward, prepend=True, with_kwargs=True)
            submodule.register_forward_hook(self._post_submodule_forward)

    def _pre_submodule_forward(self, submodule: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                               ) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        """A submodule called while its unit is IDLE is called from outside the unit's forward: run it
        as a forward of the unit. Inside the unit's forward or backward this is one attribute check,
        which dynamo traces through. Inside a backward that is not the unit's (activation
        checkpointing recomputing part of the unit in a pipeline's weight pass, after the unit's
        input pass ended) it computes on what the unit shows: a forward of the unit there would
        never end, a recomputation stopping as soon as it has what it saves."""
        if self.training_state is not TrainingState.IDLE or self.handle is None or inside_backward():
            return None
        self._submodule_forward = submodule
        return self.pre_forward(submodule, args, kwargs)

    def _post_submodule_forward(self, submodule: nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
        if self._submodule_forward is not submodule:
            return None
        self._submodule_forward = None
        return self.post_forward(submodule, args, output)

    # ----------------------------------------------------------------------------- forward
    @eager_only
    def pre_forward(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                    ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        with record_function("FSDP::pre_forward"):
            if self.training_state is TrainingState.SUMMON_FULL_PARAMS:  # torch's raises AssertionError too
                raise AssertionError(
                    "fsdp1: forward was called inside summon_full_params(), which FSDP does not support. "
                    "Run the forward after leaving the context."
                )
            if self._recomputing():
                return self.cast_inputs(args, kwargs)
            state = self.root_state
            if self.is_root:
                state.start_iteration()
                if self.compute_device.type != "cpu":
                    args, kwargs = move_to_device((args, kwargs), self.compute_device)
                state.buffers.use(full_precision=self.computes_in_full_precision)
            args, kwargs = self.cast_inputs(args, kwargs)
            self.training_state = TrainingState.FORWARD_BACKWARD
            handle = self.handle
            if handle is not None:
                state.order.record_pre_forward(self)
                _gather(handle)
                for unit in self.schedule.forward_prefetches(self, state.order):
                    _prefetch(unit)
                gradient_node = handle.use_unsharded_views(on_resting_params=not self._reshards_after_forward())
                self.register_post_backward_hook()
                if gradient_node is not None:
                    self.forwards_awaiting_gradient += 1
                    gradient_node.register_prehook(WeakPartial(_before_unsharded_gradient, state, self))
            return args, kwargs

    def cast_inputs(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """Floating-point inputs in param_dtype: the root's by default (``cast_root_forward_inputs``),
        any unit's with ``cast_forward_inputs``; none when evaluating in full precision."""
        precision = self.mixed_precision
        if precision is None or precision.param_dtype is None:
            return args, kwargs
        if not (precision.cast_forward_inputs or (self.is_root and precision.cast_root_forward_inputs)):
            return args, kwargs
        if self.computes_in_full_precision:
            return args, kwargs
        return cast_floating_tensors(precision.param_dtype, (args, kwargs))

    @eager_only
    def abort_forward(self) -> None:
        """The forward raised: undo what it left at once, so that an optimizer step or a state dict
        taken next sees every unit sharded and its gradients as they were. The root recovers every
        unit; a nested unit (called directly, or inside a forward that catches the error) recovers itself."""
        if self.is_root is None or inside_backward():
            return
        if self.is_root:
            self.root_state.recover()
        else:
            self.reset()

    @eager_only
    def post_forward(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
        """End the unit's forward: reshard or stay gathered for backward as the schedule says (FSDP1:
        FULL_SHARD units reshard, the root and SHARD_GRAD_OP ones stay, and after a forward without
        grad, which no backward follows, every unit reshards). A unit that is not sharded but
        computes on a low-precision copy reshards too: a cast remakes the copy for backward (torch's
        frees it too)."""
        with record_function("FSDP::post_forward"):
            if self._recomputing():
                return self.cast_output(output)
            handle = self.handle
            if handle is not None:
                self.root_state.order.record_post_forward(self)
                if self._reshards_after_forward():
                    handle.reshard_after_forward()
                elif handle.computes_on_low_precision_copy:
                    handle.reshard()
                else:
                    handle.keep_gathered_for_backward()
            output = self.cast_output(output)
            if torch.is_grad_enabled():
                for tensor in iter_tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._pre_backward)
                        self.awaits_pre_backward = True
            self.training_state = TrainingState.IDLE
            if self.is_root and not inside_backward():
                for unit in reversed(self.root_state.units):
                    output = unit.finish_incomplete_forward(output)
            return output

    def finish_incomplete_forward(self, output: Any) -> Any:
        """A unit of several modules some of which the forward skipped ends its forward with the root's."""
        group = self._group_forward
        return group.finish(output) if group is not None and group.is_incomplete else output

    def cast_output(self, output: Any) -> Any:
        """fully_shard's ``MixedPrecisionPolicy.output_dtype``."""
        return output if self.output_dtype is None else cast_floating_tensors(self.output_dtype, output)

    def _recomputing(self) -> bool:
        """A forward of the unit inside the backward that gathered it: activation checkpointing of the
        hooked module (``apply_activation_checkpointing`` after wrapping, or ``checkpoint`` around a
        ``fully_shard`` block) recomputing it. It computes on what that backward gathered and the
        views the forward made, and leaves the unit as it is: a forward counted there would wait for a
        gradient that never comes (the recomputed graph is not differentiated), holding every unit's
        unsharded parameters and gradient until the end of backward. torch's FSDP1 hooks the wrapper,
        which such a checkpoint never calls; fsdp1 hooks the module, so that direct calls gather."""
        return self.training_state is TrainingState.FORWARD_BACKWARD and self._backward_graph_task == current_graph_task() != -1

    def _reshards_after_forward(self) -> bool:
        return not torch.is_grad_enabled() or self.schedule.reshards_after_forward(bool(self.is_root))

    def forwards_on_resting_params(self, is_root: bool) -> bool:
        """Whether this unit's training forwards compute on the Parameters it holds while it rests
        gathered, which a pipeline's weight pass finds: not where it reshards after forward, nor where
        its views compute on tensor-parallel DTensors or what an all-gather extension made; a unit
        with nothing to train misses nothing."""
        handle = self.handle
        if handle is None or not handle.flat_param.requires_grad:
            return True
        return not self.schedule.reshards_after_forward(is_root) and handle.views.computes_on_resting_params()

    # ----------------------------------------------------------------------------- backward
    def _pre_backward(self, grad: torch.Tensor) -> None:
        """First gradient of this backward reaching one of the unit's outputs: gather its parameters.

        Keyed on the unit's state, not on which forward made the output, so that two forwards followed
        by two backwards work as with DDP: each backward finds the unit IDLE and gathers it again.
        """
        with record_function("FSDP::pre_backward"):
            state = self.root_state
            state.queue_final_callback()
            if self.training_state is TrainingState.FORWARD_BACKWARD:
                return
            self.awaits_pre_backward = False
            self._backward_graph_task = current_graph_task()
            self.training_state = TrainingState.FORWARD_BACKWARD
            handle = self.handle
            if handle is not None:
                if handle.is_sharded:
                    state.finish_reductions()
                handle.write_back_orig_params(is_gathered_for_backward=handle.holds_gathered_copy)
                _gather(handle)
                handle.use_forward_views()
                for unit in self.schedule.backward_prefetches_before(self, state.order):
                    _prefetch_for_backward(unit)

    def _post_backward(self, flat_param: torch.Tensor) -> None:
        """The unit's gradient is complete: start its reduction and reshard.

        A reentrant activation checkpoint inside the unit recomputes part of it in a nested backward,
        whose accumulation into the flat parameter is only part of the gradient (torch's FSDP1 reduces
        and reshards there, pytorch#89781): a gradient accumulated in another graph task than the
        unit's backward began in waits, for the unit's own accumulation or the final callback.
        """
        with record_function("FSDP::post_backward"):
            state = self.root_state
            state.queue_final_callback()
            if flat_param.grad is not None and flat_param.grad.requires_grad:
                raise RuntimeError(
                    f"fsdp1: unit '{state.path_of(self)}' received a gradient that itself requires grad "
                    "(backward with create_graph=True); FSDP does not support gradients of gradients. "
                    "Call backward() without create_graph."
                )
            # In low precision each forward's views feed an accumulator of their own (a .data of
            # another dtype resets the flat parameter's), so the hook fires once per forward: the
            # unit is reduced once every forward's gradient has arrived, or at the final callback.
            if current_graph_task() != self._backward_graph_task or self.forwards_awaiting_gradient > 0:
                self.awaits_reduction = True
                return
            self.reduce_and_reshard()

    def reduce_and_reshard(self) -> None:
        self.awaits_reduction = False
        handle = self.handle
        assert handle is not None, "only a unit with parameters has a gradient to reduce"
        state = self.root_state
        if self._reshards_after_backward:
            handle.reshard()  # first: the unsharded parameters are freed before the reduction allocates
        if self.sync_gradients:
            state.add_reduction(handle.grad.reduce())
            self.missed_parameters = False
        else:
            handle.grad.keep_unreduced()
        for unit in self.schedule.backward_prefetches_after(self, state.order):
            _prefetch_for_backward(unit)

    def take_resting_grads(self, reduce_now: bool) -> None:
        """Gradients left on the resting Parameters a forward computed on join the unit's gradient
        (see ``FlatParamHandle.take_resting_grads``), which then awaits its reduction."""
        reached = self.training_state is TrainingState.FORWARD_BACKWARD
        if self.handle is not None and self.handle.take_resting_grads(reduce_now, reached):
            self.awaits_reduction = True

    def await_reduction_if_unreduced(self) -> None:
        """The end of a logical backward that the caller marks (a pipeline stage's step, a manual
        ``finalize_backward``): the gradient this unit's backwards left unreduced, resting ones
        included, is reduced at the root's end of backward."""
        self.take_resting_grads(reduce_now=True)
        if self.handle is not None and self.handle.grad.is_unreduced:
            self.handle.grad.begin_backward()
            self.awaits_reduction = True

    @property
    def _reshards_after_backward(self) -> bool:
        return self.schedule.reshards_after_backward(self.sync_gradients)

    def finish_backward(self) -> None:
        """The root's final callback reached this unit: it is resharded as its strategy asks, its
        gradient handed to the optimizer, and it is IDLE."""
        handle = self.handle
        if handle is not None:
            if (not self.sync_gradients and self.training_state is TrainingState.FORWARD_BACKWARD
                    and handle.flat_param.requires_grad and not handle.grad.arrived_this_backward
                    and not handle.forward_on_resting_params):
                self.missed_parameters = True  # a pipeline schedule's input pass (autograd.grad over the inputs)
            if self._reshards_after_backward:
                handle.reshard()
            elif handle.state not in RESTING:  # kept gathered (no_sync); an unused unit never was
                handle.use_resting_views()
            handle.grad.finish_backward()
        self.training_state = TrainingState.IDLE
        self.awaits_pre_backward = False
        self.forwards_awaiting_gradient = 0
        if self._group_forward is not None:
            self._group_forward.clear()


def _gather(handle: FlatParamHandle) -> None:
    """The unit's parameters unsharded (started now, or by a prefetch), waited for."""
    handle.unshard()
    handle.wait_unshard()


def _before_unsharded_gradient(state: "RootState[UnitState]", unit: UnitState, grad_outputs: Tuple[torch.Tensor, ...]) -> None:
    """Autograd is about to assemble a unit's unsharded gradient and accumulate it into the flat
    parameter: move the optimizer's gradient aside first, and (sharded) finish the reductions still
    reading earlier units' unsharded gradients so that no two are alive together (the root's
    gradient, for one, is assembled after every block's reduction has started)."""
    unit.forwards_awaiting_gradient = max(0, unit.forwards_awaiting_gradient - 1)
    handle = unit.handle
    assert handle is not None, "only a unit with parameters has views to split"
    handle.grad.begin_backward()
    handle.grad.note_arrivals(grad_outputs)
    if handle.is_sharded:
        state.finish_reductions()


def _prefetch(unit: UnitState) -> None:
    """Start ``unit``'s all-gather without waiting; its own pre-forward or pre-backward waits."""
    if unit.handle is not None:
        unit.handle.unshard()


def _prefetch_for_backward(unit: UnitState) -> None:
    """Prefetch only a unit whose backward is still to come, so that none is gathered twice."""
    if unit.awaits_pre_backward:
        _prefetch(unit)


def unit_states(module: nn.Module) -> List[UnitState]:
    """The state of every unit in ``module``'s tree, in ``module.modules()`` order."""
    return [state_of(unit) for unit in fsdp_units(module)]


@contextlib.contextmanager
def gradients_unsynchronised(units: Sequence[UnitState]) -> Iterator[None]:
    """``no_sync`` of both fronts: within, every one of ``units`` keeps its gradient unreduced and
    accumulating; on exit each syncs as it did before."""
    previous = [unit.sync_gradients for unit in units]
    for unit in units:
        unit.sync_gradients = False
    try:
        yield
    finally:
        for unit, sync in zip(units, previous):
            unit.sync_gradients = sync


def adopt_replaced_flat_params(module: nn.Module) -> None:
    """Every unit in ``module`` takes a flat parameter a client replaced since (Accelerate's upcast)
    as its shard: before a state dict or ``summon_full_params`` reads the shards, as before a forward."""
    for unit in unit_states(module):
        if unit.handle is not None:
            unit.materialize_replaced()
            unit.handle.write_back_orig_params()  # first, as at a forward: adopting a new shard re-points the originals
            unit.handle.adopt_replaced_flat_param()
