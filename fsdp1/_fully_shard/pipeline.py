"""What torch's pipeline schedules (``torch.distributed.pipelining``) reach in a stage's ``fully_shard``
module, so that they drive fsdp1's modules as they drive torch's (under ``use_as_torch_fsdp``, which
points the schedules' names at fsdp1's).

Across a step's micro-batches a schedule tells the stage module not to synchronise gradients and not
to reshard after backward (``FSDPModule``'s own setters): every unit stays gathered and adds each
micro-batch's gradient to its unreduced sum. At the end of the step it turns both back on and asks
``fully_shard.state(stage_module)`` to reduce: torch's stage calls ``post_backward()`` on every
parameter group it finds through ``_state_ctx.all_states[i]._fsdp_param_groups``, then
``_root_post_backward_final_callback()``. Those are torch's names; ``StageReduction`` answers to
them, with the stage module's units as its one group.

A schedule that splits backward runs a weight pass after later forwards, on the parameters the
modules hold: a unit resting gathered computes on resting Parameters that stay registered (see
``DTensorParamViews``), whose gradients join the unit's here.
"""

import sys
import warnings
from typing import Any, Tuple

from torch import nn

from .._engine.unit_state import state_of, unit_states
from .module import FSDPModule


class StageReduction:
    """``fully_shard.state(module)``: the end-of-step reduction of a pipeline stage's units."""

    def __init__(self, module: nn.Module) -> None:
        self._root = state_of(module)
        self._units = unit_states(module)

    @property
    def _state_ctx(self) -> "StageReduction":
        return self

    @property
    def all_states(self) -> Tuple["StageReduction"]:
        return (self,)

    @property
    def _fsdp_param_groups(self) -> Tuple["StageReduction"]:
        return (self,)

    def post_backward(self) -> None:
        """Every unit whose micro-batches left their gradient unreduced reduces it at the final
        callback, as a backward that synchronises would; a unit no micro-batch reached keeps its
        gradient as it was.

        A schedule that splits backward into an input pass and a weight pass (the zero-bubble and
        DualPipeV schedules) computes the weight gradients on the parameters the modules hold after
        the forward. A unit that rests gathered computes on resting Parameters that stay registered,
        which that pass reaches; one resharded after forward (or computing on tensor-parallel
        DTensors, or on what an all-gather extension made) computed on views it no longer holds. That
        step is refused here, before any gradient is handed to an optimizer, and undone: every unit
        sharded, its gradient as before the step."""
        missed = [unit.path or "the stage module" for unit in self._units if unit.missed_parameters]
        if missed:
            self._root.root_state.recover()  # every unit sharded, its gradient as before the step
            raise NotImplementedError(
                f"fsdp1: the pipeline schedule's backward reached the outputs of {missed} but not their parameters: "
                "a schedule that splits backward into an input pass and a weight pass (ScheduleInterleavedZeroBubble, "
                "ScheduleZBVZeroBubble, ScheduleDualPipeV) computes the weight gradients on the parameters the modules "
                "hold after the forward, and these were resharded after it (or compute on tensor-parallel DTensors or "
                "all-gather extensions), so the step was undone before any gradient was reduced. Pass "
                "reshard_after_forward=False to fully_shard for the modules of pipeline stages (torch's fully_shard "
                "trains this case silently wrong), or use a schedule that runs whole backwards (ScheduleGPipe, "
                "Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS)."
            )
        for unit in self._units:
            unit.take_resting_grads(reduce_now=True)  # what the micro-batches left on the resting Parameters
            if unit.handle is not None and unit.handle.grad.is_unreduced:
                unit.handle.grad.begin_backward()
                unit.awaits_reduction = True

    def _root_post_backward_final_callback(self) -> None:
        """Reduce, reshard as the schedule now asks, and hand every unit's gradient to the optimizer."""
        self._root.root_state.finalize_backward()


def watch_for_unrecognising_stage(module: nn.Module) -> None:
    """Warn at ``module``'s first forward if a pipeline stage that does not recognise fsdp1's modules runs it."""
    if _pipelining_would_not_recognise():
        _UnrecognisedPipelineCheck(module)


def _pipelining_would_not_recognise() -> bool:
    """torch's pipeline stages are imported and bound torch's ``FSDPModule``, not fsdp1's."""
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    return stage is not None and getattr(stage, "FSDPModule", FSDPModule) is not FSDPModule


class _UnrecognisedPipelineCheck:
    """A one-shot forward pre-hook: torch's pipeline stages recognise a stage module by the
    ``FSDPModule`` they imported, and a stage that does not recognise fsdp1's runs it as a plain
    module: gathered and reduced once per micro-batch, and under a schedule that splits backward with
    no weight gradient at all. The first forward under such a stage says so. Registered only where
    the stages are imported and would not recognise fsdp1's modules."""

    def __init__(self, module: nn.Module) -> None:
        self._handle = module.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: Any) -> None:
        self._handle.remove()
        if not _pipelining_would_not_recognise():
            return
        stage_file = sys.modules["torch.distributed.pipelining.stage"].__file__
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename != stage_file:
            frame = frame.f_back  # type: ignore[assignment]  # None ends the walk
        if frame is not None:
            warnings.warn(
                "fsdp1: a torch.distributed.pipelining stage runs this fully_shard module without recognising it: "
                "it is gathered and reduced once per micro-batch, and a schedule that splits backward (zero-bubble, "
                "DualPipeV) computes no weight gradient for it. Call fsdp1.use_as_torch_fsdp() before building the "
                "pipeline stages.",
                stacklevel=2,
            )
