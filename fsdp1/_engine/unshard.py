"""``summon_full_params``: every original parameter unsharded, outside forward and backward.

The handles do the work (``FlatParamHandle.full_params``); this module decides which units take
part, refuses what cannot work (inside forward or backward, nested), and keeps every unit's
training state truthful while they are gathered.
"""

import contextlib
from typing import Iterator, List

from torch import nn

from . import collectives as comm
from .common import TrainingState
from .traversal import is_fsdp_unit, unit_name, unit_paths
from .unit_state import UnitState, adopt_replaced_flat_params, state_of, unit_states


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Within, every unit in ``module`` (or only ``module`` itself without ``recurse``) holds its
    original parameters unsharded; with ``writeback`` each rank keeps its shard of what they hold on
    exit. Collective: every rank must enter it.

    ``rank0_only``: only global rank 0 holds them; the other ranks take part in the gathers and free
    the result at once. ``offload_to_cpu``: the full parameters are CPU copies (no copy when the
    compute device is the CPU). ``with_grads``: each one's ``.grad`` is the full averaged gradient,
    with either ``use_orig_params`` value (torch's needs it True). ``offload_to_cpu`` also works for
    NO_SHARD units, which torch's refuses.

    Misuse raises torch's exception types: ``NotImplementedError`` for ``writeback`` with
    ``rank0_only``, ``AssertionError`` inside forward or backward and when nested.
    """
    if writeback and rank0_only:
        raise NotImplementedError(
            "fsdp1: summon_full_params(writeback=True, rank0_only=True) cannot write back (writeback=True and "
            "rank0_only=True is not supported): the other ranks hold no full parameters to take their shards "
            "from. Pass writeback=False with rank0_only=True."
        )
    units = unit_states(module) if recurse else ([state_of(module)] if is_fsdp_unit(module) else [])
    _check_idle(module, units)
    if units:
        comm.check_every_rank_calls(units[0].process_group, "summon_full_params()")
    adopt_replaced_flat_params(module)
    expose = not rank0_only or comm.global_rank() == 0
    with contextlib.ExitStack() as stack:
        for unit in units:
            unit.training_state = TrainingState.SUMMON_FULL_PARAMS
            stack.callback(setattr, unit, "training_state", TrainingState.IDLE)
            if unit.handle is not None:
                stack.enter_context(unit.handle.full_params(writeback, expose, offload_to_cpu, with_grads))
        yield


def _check_idle(module: nn.Module, units: List[UnitState]) -> None:
    for unit in units:
        if unit.training_state is TrainingState.IDLE:
            continue
        path = unit.path
        where = unit_name(unit_paths(module).get(unit.owner, "?") if path is None else path)
        if unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise AssertionError(
                f"fsdp1: Cannot manually unshard parameters when already unsharding parameters: "
                f"summon_full_params() was entered again for {where}, whose parameters are already gathered "
                "by an enclosing summon_full_params(); use the outer context alone."
            )
        raise AssertionError(
            f"fsdp1: Cannot manually unshard parameters during forward/backward: summon_full_params() "
            f"cannot gather {where} now; call it between training steps (after backward() has returned)."
        )
