"""Tests of the runtime's objects: any module that holds a ``UnitState`` is a unit, not only the
``FullyShardedDataParallel`` wrapper (a plain model whose blocks and root each own a state, as a
``fully_shard``-style module would, trains exactly as torch's FSDP1 does with the same units), and a
unit's gradient moves only along its phase table."""

import torch
import torch.distributed as dist
from torch import nn

from fsdp1._engine.collectives import ProcessGroups
from fsdp1._engine.handle import FlatParamHandle
from fsdp1._engine.mixed_precision import HandlePrecision
from fsdp1._engine.orig_views import OrigParamViews
from fsdp1._engine.schedule import UnitSchedule
from fsdp1._engine.traversal import iter_param_slots
from fsdp1._engine.unit_state import UnitState
from fsdp1._wrapper.flat_shard_layout import FlatShardLayout

from _harness import run_on_ranks
from _models import batch, lm_loss, make_gpt, train, wrap_torch_fsdp


def _own_unit_state(module: nn.Module) -> None:
    """``module`` becomes a unit in place: its parameters (minus nested units') flattened and sharded,
    its forward hooked, with no wrapper module around it."""
    group = dist.group.WORLD
    views = OrigParamViews(list(iter_param_slots(module)), module)
    layout = FlatShardLayout(views.shapes, views.aligned_numel(torch.float32), dist.get_rank(), dist.get_world_size(), is_sharded=True)
    handle = FlatParamHandle(views, layout, ProcessGroups(group, None), HandlePrecision.of(None, torch.float32))
    UnitState(module, module, handle, group, UnitSchedule(reshard_after_forward=None), None, torch.device("cpu"), ())


def _train_with_unit_states_and_torch_fsdp1():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ours = make_gpt()
    for block in ours.blocks:
        _own_unit_state(block)
    _own_unit_state(ours)
    torch_fsdp1 = wrap_torch_fsdp(make_gpt(), "FULL_SHARD", use_orig_params=True)
    return train(ours, 3, world_size, rank), train(torch_fsdp1, 3, world_size, rank), type(ours).__name__


def test_a_plain_module_holding_unit_states_trains_as_torch_fsdp1():
    for ours, oracle, class_name in run_on_ranks(2, _train_with_unit_states_and_torch_fsdp1):
        assert ours == oracle  # bitwise: the same losses over three Adam steps
        assert class_name == "TinyGPT"  # the model kept its own class: no wrapper module


def _gradient_phases():
    from fsdp1 import FullyShardedDataParallel as FSDP
    from fsdp1._engine.flat_grad import GradPhase

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = FSDP(make_gpt())
    grad = model._handle.grad
    phases = [grad.phase]
    with model.no_sync():
        lm_loss(model, *batch(0, rank, world_size)).backward()
    phases.append(grad.phase)
    lm_loss(model, *batch(1, rank, world_size)).backward()
    phases.append(grad.phase)
    try:
        grad.keep_unreduced()  # only a backward under way can keep its gradient unreduced
        refused = "no error"
    except RuntimeError as error:
        refused = str(error)
    return [phase is expected for phase, expected in zip(phases, [GradPhase.SHARDED, GradPhase.LOCAL, GradPhase.SHARDED])], refused


def test_the_gradient_moves_through_its_phases_and_refuses_any_other_move():
    for matches, refused in run_on_ranks(2, _gradient_phases):
        assert matches == [True, True, True]  # at rest, after a no_sync backward, after the synchronising one
        assert refused == "fsdp1 internal error: unit '' moved its gradient from SHARDED to LOCAL_BACKWARD"
