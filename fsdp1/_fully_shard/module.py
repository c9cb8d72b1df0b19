"""``FSDPModule``: what a module becomes under ``fully_shard`` (its class ``FSDP<Class>`` derives from
this and from the original class), with FSDP2's methods; ``UnshardHandle``; and the functions that
act on such modules (``register_fsdp_forward_method``, ``share_comm_ctx``). Each method changes the
unit's ``UnitState``, its schedule or its gradient's reduce settings, which the engine reads.
"""

import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Type

import torch
from torch import nn

from .._engine.common import TrainingState
from .._engine.handle import RESTING
from .._engine.hooks import inside_backward
from .._engine.root_state import ManualFinalization
from .._engine.unit_state import UnitState, gradients_unsynchronised, state_of
from .._engine.unshard import summon_full_params


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather and registers the
    unsharded parameters. A forward waits for one nobody waited for; a wait after the gather was used
    and freed (a forward and backward ran since) does nothing, as torch's."""

    def __init__(self, state: UnitState) -> None:
        self._state: Optional[UnitState] = state

    def wait(self) -> None:
        state, self._state = self._state, None
        if state is not None and state.handle is not None and state.handle.state not in RESTING:
            state.handle.wait_unshard()
            state.handle.use_resting_views()  # fully_shard's at rest while gathered: the unsharded parameters


SPLIT_BACKWARD_REFUSAL = (
    "fsdp1: a pipeline schedule that splits backward into an input pass and a weight pass "
    "(ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) computes the weight gradients on the "
    "parameters the modules hold after the forward, and {missed} compute their forwards on views they do not hold "
    "then (resharded after forward, or tensor-parallel DTensors, or all-gather extensions), so the step was refused "
    "{when}. Pass reshard_after_forward=False to fully_shard for the modules of pipeline stages (torch's fully_shard "
    "trains this case silently wrong), or use a schedule that runs whole backwards (ScheduleGPipe, Schedule1F1B, "
    "ScheduleInterleaved1F1B, ScheduleLoopedBFS)."
)


def refuse_a_missed_weight_pass(root: UnitState, units: List[UnitState]) -> None:
    """The end of a pipeline step whose weight pass missed some unit's parameters (computed on views
    the unit no longer held): refused and undone, every unit sharded, its gradient as before the step."""
    missed = [unit.path or "the stage module" for unit in units if unit.missed_parameters]
    if missed:
        root.root_state.recover()
        raise NotImplementedError(SPLIT_BACKWARD_REFUSAL.format(missed=missed, when="and undone before any gradient was reduced"))


class GradientReductionHandle:
    """What ``finalize_backward(async_op=True)`` returns. fsdp1 finishes the reductions before
    returning it (they are issued on the compute stream, so there is nothing to overlap on the CPU
    side); ``wait()`` marks it waited, which a next finalization requires, as torch's does, and
    raises after ``reset_iter_state`` dropped it."""

    def __init__(self, finalization: Optional[ManualFinalization] = None) -> None:
        self._finalization = finalization

    def wait(self) -> None:
        finalization, self._finalization = self._finalization, None
        if finalization is None:
            return
        if finalization.unwaited is not self:
            raise RuntimeError("This gradient reduction handle was invalidated. fsdp1: reset_iter_state dropped it, and "
                               "its gradients with it; run the backward again and finalize it.")  # torch's phrase
        finalization.unwaited = None


class FSDPModule(nn.Module):
    """The methods ``fully_shard`` gives a module (its class becomes ``FSDP<Class>``, a subclass of
    this and of the original class). Each acts on this module's group alone unless it says so.
    Never built directly: its ``nn.Module`` base only lets these methods use the module's own."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Building an instance of an ``FSDP<Class>`` (a container's slicing does, ``type(self)(...)``)
        builds the original class: a new module is not sharded."""
        original = cls.__mro__[2]
        return original(*args, **kwargs)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        raise AssertionError("FSDP does not support deepcopy")  # torch's message and type

    # ----------------------------------------------------------------------------- gathering
    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters (not its sharded submodules'); with ``async_op`` return
        a handle to wait on, else wait. Afterwards the module holds them unsharded."""
        state = _state(self)
        if state.handle is None:
            return UnshardHandle(state) if async_op else None
        state.handle.unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters (keep their storage after ``set_keep_unsharded_storage(True)``);
        the module holds the sharded DTensors again."""
        handle = _state(self).handle
        if handle is not None:
            handle.reshard()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Whether resharding keeps the unsharded parameters' storage, so that their addresses stay
        across reshard and unshard (CUDA graph capture), for the memory of one gathered copy each."""
        for state in _states(self, recurse):
            if state.handle is not None:
                state.handle.set_keeps_unsharded_storage(keep)

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True, rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False) -> Iterator[None]:
        """Within, every parameter of this module's tree is a plain full ``nn.Parameter`` (torch's
        FSDP2 offers only ``full_tensor()`` per parameter); on exit with ``writeback`` changes are
        kept. Collective."""
        with summon_full_params(self, recurse=True, writeback=writeback, rank0_only=rank0_only,
                                offload_to_cpu=offload_to_cpu, with_grads=with_grads):
            yield

    # ----------------------------------------------------------------------------- gradients
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps each rank's gradient unreduced and accumulating (DDP's ``no_sync``);
        the next backward with True reduces the sum."""
        for state in _states(self, recurse):
            state.sync_gradients = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """``set_requires_gradient_sync(False)`` for the duration, as FSDP1's and DDP's ``no_sync``."""
        with gradients_unsynchronised(_states(self, recurse=True)):
            yield

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but leaves the all-reduce over the replicas to a later backward,
        which adds the kept sums first."""
        for state in _states(self, recurse):
            if state.handle is not None:
                state.handle.grad.settings.all_reduces_replicas = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted. torch's FSDP2 skips waiting for its reductions at the end of a backward that is
        not the last; fsdp1 finishes every backward, which gives the same gradients."""

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradient by ``factor`` instead of averaging over the ranks (any
        backend); not its sharded submodules', as torch's."""
        if factor == 0:
            raise ZeroDivisionError(  # torch's type, raised at its next reduction
                "fsdp1: set_gradient_divide_factor(0) would divide every gradient by zero; pass the number of "
                "ranks to average over, or 1.0 to keep the sum."
            )
        handle = _state(self).handle
        if handle is not None:
            handle.grad.settings.divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        warnings.warn("set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: fsdp1's collectives always sum, and divide apart."""

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Optional[Any] = None) -> None:
        """``hook(reduced)`` on this module's reduced gradient shard, once per backward, after the
        all-reduce over the replicas (HSDP) or the reduce-scatter; on ``stream`` where one is given
        (not under HSDP, as torch's)."""
        handle = _state(self).handle
        if stream is not None and handle is not None and handle.replicate_group is not None:
            raise ValueError("stream cannot be set when using native HSDP")  # torch's
        if handle is not None:
            handle.grad.settings.after_reduce = hook
            handle.grad.settings.after_reduce_stream = stream

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted: fsdp1 reduces the whole group's gradient, with zeros for unused parameters."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Accepted: fsdp1 keeps at most two reductions in flight, each finished before the next
        unsharded gradient is made."""
        if not isinstance(max_input_buffers, int) or isinstance(max_input_buffers, bool):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")  # torch's
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")  # torch's

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted: a stream-level overlap; fsdp1 issues every collective on the unit's group."""

    # ----------------------------------------------------------------------------- schedule
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the parameters are freed after forward (and gathered again in backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")  # torch's
        for state in _states(self, recurse):
            state.schedule.reshard_after_forward = reshard_after_forward
            if state.handle is not None:
                state.handle.set_rows_after_forward(None)  # rows kept by an int reshard_after_forward go with it

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the parameters gathered after backward (for the next micro-batch)."""
        for state in _states(self, recurse):
            state.schedule.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Start these modules' all-gathers right after this module's, in forward."""
        _state(self).schedule.prefetch_in_forward([_state(module, "set_modules_to_forward_prefetch") for module in modules])

    def set_modules_to_backward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Start these modules' all-gathers at this module's backward, in place of the next module
        in reverse forward order."""
        _state(self).schedule.prefetch_in_backward([_state(module, "set_modules_to_backward_prefetch") for module in modules])

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted. torch's FSDP2 can skip the backward all-gather of a module whose backward does
        not read its parameters; fsdp1 gathers it, which gives the same gradients."""

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted: CUDA-stream ordering only (fsdp1 issues every collective on the compute stream)."""

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root, before backward: the caller ends each logical backward with
        ``finalize_backward``, which reduces what backwards with gradient synchronisation off left
        unreduced (with it on, each backward has reduced when autograd ended it)."""
        state = _state(self)
        if not state.is_outermost():
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")  # torch's
        finalization = state.root_state.manual_finalization
        if enabled != finalization.enabled and inside_backward():
            raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")  # torch's
        if enabled != finalization.enabled and finalization.started:
            raise RuntimeError("set_manual_backward_finalization cannot change mode after backward starts. fsdp1: call "
                               "finalize_backward() first.")  # torch's phrase
        finalization.enabled = enabled

    def finalize_backward(self, *, async_op: bool = False) -> Optional[GradientReductionHandle]:
        """After the backwards of one logical backward, on the root: reduce the gradients they left
        unreduced, as gradient synchronisation now says, and reshard; a no-op before the first
        forward. ``async_op`` returns a ``GradientReductionHandle`` to wait on before the next."""
        state = _state(self)
        if not state.has_root_state:
            return GradientReductionHandle() if async_op else None
        root = state.root_state
        finalization = root.manual_finalization
        if finalization.unwaited is not None:
            raise RuntimeError("The previous gradient reduction must be waited on before finalizing backward again")  # torch's
        if not state.is_outermost():
            raise RuntimeError("finalize_backward must be called on the root FSDP module")  # torch's
        if not (finalization.enabled or finalization.started):
            raise RuntimeError("FSDP finalize_backward requires manual backward finalization. Call "
                               "set_manual_backward_finalization(True) before forward")  # torch's
        if inside_backward() or root.is_final_callback_queued:
            raise RuntimeError("FSDP finalize_backward must be called after backward completes")  # torch's
        refuse_a_missed_weight_pass(state, root.units)  # torch 2.15's pipeline stages finalize here
        root.finalize_manually()
        if not async_op:
            return None
        handle = GradientReductionHandle(finalization)
        finalization.unwaited = handle
        return handle

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: finish the collectives in flight, drop the
        iteration's gradients and reshard (fsdp1 also does this by itself at the next forward)."""
        state = _state(self)
        if not state.is_outermost():
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")  # torch's
        if not state.root_state.is_clean():
            state.root_state.recover()
        state.root_state.manual_finalization.reset()

    # ----------------------------------------------------------------------------- the unit's collectives
    def set_custom_all_gather(self, comm: Any) -> None:
        """This module's parameters are gathered by ``comm`` (torch's ``AllGather``): it allocates the
        output and gathers each rank's flat shard into it, as under torch's FSDP2."""
        handle = _state(self).handle
        if handle is not None:
            handle.set_custom_collectives(all_gather=comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """This module's gradients are reduce-scattered by ``comm`` (torch's ``ReduceScatter``): it
        allocates the input and the output and reduces, with ``op=SUM`` (fsdp1 divides after; torch's
        passes ``AVG`` where it takes the mean in the collective)."""
        handle = _state(self).handle
        if handle is not None:
            handle.set_custom_collectives(reduce_scatter=comm)

    # ----------------------------------------------------------------------------- not supported yet
    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        raise NotImplementedError("fsdp1: set_allocate_memory_from_process_group_for_comm (NCCL buffers) is not supported yet.")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise NotImplementedError("fsdp1: set_symm_mem_for_comm (symmetric memory) is not supported yet.")

    # ----------------------------------------------------------------------------- nn.Module
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        """``.to()``, ``.double()``, ``to_empty()``: the shard is converted, and the DTensor
        parameters (the same objects) view it in its new dtype and device."""
        _state(self).convert(lambda: super(FSDPModule, self)._apply(fn, recurse))
        return self


def _state(module: Any, api: str = "") -> UnitState:
    if not isinstance(module, FSDPModule):
        raise ValueError(  # torch's phrase
            f"Expects FSDPModule but got {type(module)}: {module}. fsdp1: {api or 'this call'} takes modules that "
            "fully_shard was applied to."
        )
    return state_of(module)


def _states(module: "FSDPModule", recurse: bool) -> List[UnitState]:
    if not recurse:
        return [_state(module)]
    return [state_of(m) for m in module.modules() if isinstance(m, FSDPModule)]


_FSDP_CLASSES: Dict[Type[nn.Module], Type[nn.Module]] = {}
"""``FSDP<Class>`` per original class, made once: every sharded module of a class shares one, as
under torch's (a class per call would make ``type(a) is type(b)`` false for two blocks)."""


def _fsdp_class(cls: Type[nn.Module]) -> Type[nn.Module]:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def share_comm_ctx(modules: List[FSDPModule]) -> None:
    """Accepted: torch's FSDP2 lets several roots (pipeline stages) share one set of CUDA streams;
    fsdp1 issues every collective on the compute stream, so they share it already."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")  # torch's


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` as a forward of its unit (gathered around it), as torch's; a
    no-op on a module that is not a fully_shard module. fsdp1 already gathers around calls of the
    module and its submodules from outside (``generate()`` works without this); a method that reads
    the module's own parameters directly needs it."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")  # torch's
    method = getattr(module, method_name)
    state = state_of(module)

    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        if state.training_state is not TrainingState.IDLE:
            return method(*args, **kwargs)
        args, kwargs = state.pre_forward(module, args, kwargs)
        return state.post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, as_forward)

