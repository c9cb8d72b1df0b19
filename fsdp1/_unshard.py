"""``summon_full_params``: every original parameter unsharded, outside forward and backward.

The handles do the work (``FlatParamHandle.full_params``); this module decides which units take
part, refuses what cannot work (inside forward or backward, nested), and keeps every unit's
training state truthful while they are gathered.
"""

import contextlib
from typing import Iterator, List

from torch import nn

from ._runtime import TrainingState
from ._traversal import fsdp_units, is_fsdp_unit, unit_paths


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
    exit. Collective: every rank must enter it."""
    for name, value in (("rank0_only", rank0_only), ("offload_to_cpu", offload_to_cpu), ("with_grads", with_grads)):
        if value:
            raise NotImplementedError(
                f"fsdp1: summon_full_params({name}=True) is not supported yet; leave {name} at False."
            )
    units = fsdp_units(module) if recurse else ([module] if is_fsdp_unit(module) else [])
    _check_idle(module, units)
    with contextlib.ExitStack() as stack:
        for unit in units:
            unit.training_state = TrainingState.SUMMON_FULL_PARAMS
            stack.callback(setattr, unit, "training_state", TrainingState.IDLE)
            if unit._handle is not None:
                stack.enter_context(unit._handle.full_params(writeback))
        yield


def _check_idle(module: nn.Module, units: List[nn.Module]) -> None:
    paths = unit_paths(module)
    for unit in units:
        if unit.training_state is TrainingState.IDLE:
            continue
        where = f"unit '{paths.get(unit, '?')}'" if paths.get(unit) else "the root unit"
        if unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise RuntimeError(
                f"fsdp1: summon_full_params() was entered again for {where}, whose parameters are already "
                "gathered by an enclosing summon_full_params(); use the outer context alone."
            )
        raise RuntimeError(
            f"fsdp1: summon_full_params() cannot gather {where} during its forward or backward; call it "
            "between training steps (after backward() has returned)."
        )
