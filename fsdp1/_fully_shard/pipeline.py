"""What torch's pipeline schedules (``torch.distributed.pipelining``) reach in a stage's ``fully_shard``
module, so that they drive fsdp1's modules as they drive torch's (they recognise fsdp1's modules
through the stand-ins of ``fsdp1._torch_recognition``).

Across a step's micro-batches a schedule tells the stage module not to synchronise gradients and not
to reshard after backward (``FSDPModule``'s own setters): every unit stays gathered and adds each
micro-batch's gradient to its unreduced sum. At the end of the step it turns both back on and
reduces. Before torch 2.15 it asks ``fully_shard.state(stage_module)``: torch's stage calls
``post_backward()`` on every parameter group it finds through
``_state_ctx.all_states[i]._fsdp_param_groups``, then ``_root_post_backward_final_callback()``. Those
are torch's names; ``StageReduction`` answers to them, with the stage module's units as its one
group. From 2.15 on the stage calls the module's public ``finalize_backward(async_op=True)`` under
``set_manual_backward_finalization(True)``, which does the same (``FSDPModule``).

A schedule that splits backward runs a weight pass after later forwards, on the parameters the
modules hold: a unit resting gathered computes on resting Parameters that stay registered (see
``DTensorParamViews``), whose gradients join the unit's here. Where a unit's forwards compute on
anything else, or where the stage module holds fsdp1's modules without being one (the schedule runs
it as a plain module), the weight pass cannot reach them: such a schedule is refused before its
first action, on every rank of the pipeline at once (``refuse_split_backward_that_misses``).
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._engine import collectives as comm
from .._engine.traversal import fsdp_units
from .._engine.unit_state import state_of, unit_states
from .module import SPLIT_BACKWARD_REFUSAL, FSDPModule, refuse_a_missed_weight_pass

UNSHARDED_STAGE_REFUSAL = (
    "fsdp1: {stages} hold fsdp1 modules but are not fully_shard modules themselves, so a pipeline schedule that "
    "splits backward into an input pass and a weight pass runs them as plain modules and its weight pass finds none "
    "of their parameters; the step was refused before its first action, on every rank. Call fully_shard on each "
    "stage module too (after its blocks), or use a schedule that runs whole backwards (ScheduleGPipe, Schedule1F1B, "
    "ScheduleInterleaved1F1B, ScheduleLoopedBFS)."
)


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
        sharded, its gradient as before the step. The refusal before the first action
        (``refuse_split_backward_that_misses``) foresees the cases known from the configuration; this
        one catches the rest."""
        refuse_a_missed_weight_pass(self._root, self._units)
        for unit in self._units:
            unit.await_reduction_if_unreduced()

    def _root_post_backward_final_callback(self) -> None:
        """Reduce, reshard as the schedule now asks, and hand every unit's gradient to the optimizer."""
        self._root.root_state.finalize_backward()


def refuse_split_backward_that_misses(stages: Sequence[Tuple[int, nn.Module]], group: Optional[comm.ProcessGroup]) -> None:
    """Before the first action of a schedule that splits backward over ``stages`` (each stage's index
    and module): refuse it on every rank of its pipeline ``group`` at once if a weight pass would miss
    the parameters of a unit of any stage on any rank. Refused later, at the end of a step, some ranks
    would stop while the others wait for their messages; so the ranks agree first, in one all-reduce
    that every rank reaches before any of the schedule's messages."""
    unsharded = [f"stage {index}" for index, module in stages if not isinstance(module, FSDPModule) and fsdp_units(module)]
    missed = [f"stage {index}'s {path}" for index, module in stages if isinstance(module, FSDPModule)
              for path in _missed_by_weight_pass(module)]
    anywhere = torch.tensor([float(bool(unsharded)), float(bool(missed))])
    comm.all_reduce_with(anywhere, group if group is not None else comm.default_group(), maximum=True).wait()
    if anywhere[0].item():
        raise NotImplementedError(UNSHARDED_STAGE_REFUSAL.format(stages=unsharded or "another rank's stage modules"))
    if anywhere[1].item():
        raise NotImplementedError(SPLIT_BACKWARD_REFUSAL.format(
            missed=missed or "modules of another rank's stages", when="before its first action, on every rank"))


def _missed_by_weight_pass(stage_module: nn.Module) -> List[str]:
    """The units of ``stage_module`` (its root first) whose trainable parameters a weight pass would not find."""
    root = state_of(stage_module)
    return [repr(unit.path) if unit.path else "stage module" for unit in unit_states(stage_module)
            if not unit.forwards_on_resting_params(is_root=unit is root)]
