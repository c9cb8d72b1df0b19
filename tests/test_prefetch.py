"""Tests that prefetching (backward_prefetch, forward_prefetch) changes only when parameters are
gathered: training stays bitwise equal to torch's FSDP1 with the same options, the next unit is
really in flight while the current one computes, no more than one unit ahead is gathered, and a
forward order that changes between iterations still trains exactly like DDP. Under ``fully_shard``,
explicit prefetching (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``),
``reshard_after_forward=False`` and one group of two modules train bitwise like torch's."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    LAYERS,
    batch,
    fsdp1_full_params,
    fully_shard_pair_trained,
    lm_loss,
    make_gpt,
    max_relative_error,
    plain_params,
    torch_fsdp_full_params,
    train,
    wrap_fsdp1,
    wrap_torch_fsdp,
)

BACKWARD_PREFETCH = [None, "BACKWARD_PRE", "BACKWARD_POST"]


def _parity(backward_prefetch, forward_prefetch, use_orig_params):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    options = dict(use_orig_params=use_orig_params, backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch)
    base = make_gpt()
    ours, theirs = wrap_fsdp1(copy.deepcopy(base), **options), wrap_torch_fsdp(copy.deepcopy(base), **options)
    losses = (train(ours, 4, world_size, rank), train(theirs, 4, world_size, rank))
    return losses, max_relative_error(fsdp1_full_params(ours), torch_fsdp_full_params(theirs))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("forward_prefetch", [False, True])
@pytest.mark.parametrize("backward_prefetch", BACKWARD_PREFETCH)
def test_prefetch_trains_bitwise_like_torch_fsdp1(backward_prefetch, forward_prefetch, use_orig_params):
    for (ours, theirs), error in run_on_ranks(2, _parity, backward_prefetch, forward_prefetch, use_orig_params):
        assert ours == theirs
        assert error == 0.0


# ------------------------------------------------------------------------------------------ what is in flight
def _gathered_units(model):
    """Paths of the units whose parameters are unsharded or being gathered, root excluded."""
    return sorted(
        path for unit, path in model._root_state.unit_paths.items()
        if path and unit.handle.state is not fsdp1._engine.handle.HandleState.SHARDED
    )


def _observe_gathering(backward_prefetch, forward_prefetch):
    """Which units are gathered when each block starts its forward, starts its backward computation,
    and has its gradient reduced."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = wrap_fsdp1(make_gpt(), backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch)
    seen = {}

    def at_forward(name):
        def hook(module, args):
            seen[f"forward {name}"] = _gathered_units(model)
        return hook

    def at_backward(name):
        # Registered after fsdp1's own hook on the unit's output, so it runs after the pre-backward.
        def hook(unit, args, output):
            output.register_hook(lambda grad: seen.__setitem__(f"backward {name}", _gathered_units(model)))
        return hook

    def after_gradient(name):
        # Registered after fsdp1's post-backward hook on the flat parameter, so it runs after it.
        return lambda flat_param: seen.__setitem__(f"reduced {name}", _gathered_units(model))

    for i, unit in enumerate(model.blocks):
        unit.module.register_forward_pre_hook(at_forward(i))
        unit.register_forward_hook(at_backward(i))
        unit._flat_param.register_post_accumulate_grad_hook(after_gradient(i))
    for step in range(2):  # forward prefetching needs the order of a first iteration
        lm_loss(model, *batch(step, rank, world_size)).backward()
    after_backward = _gathered_units(model)
    return seen, after_backward


@pytest.mark.parametrize("forward_prefetch", [False, True])
@pytest.mark.parametrize("backward_prefetch", BACKWARD_PREFETCH)
def test_prefetch_gathers_exactly_the_next_unit(backward_prefetch, forward_prefetch):
    seen, after_backward = run_on_ranks(2, _observe_gathering, backward_prefetch, forward_prefetch)[0]
    assert after_backward == []
    for i in range(LAYERS):
        ahead = forward_prefetch and i + 1 < LAYERS
        assert seen[f"forward {i}"] == [f"blocks.{j}" for j in range(i, i + 1 + ahead)]
        behind = [f"blocks.{i - 1}"] if i > 0 and backward_prefetch is not None else []
        # BACKWARD_PRE gathers block i-1 as block i's backward starts, BACKWARD_POST once it is done.
        assert seen[f"backward {i}"] == (behind if backward_prefetch == "BACKWARD_PRE" else []) + [f"blocks.{i}"]
        assert seen[f"reduced {i}"] == behind


# ------------------------------------------------------------------------------------------ a changing order
class SkipsABlock(nn.Module):
    """Runs its blocks in an order that changes every step, and skips one of them on odd steps."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.step = 0

    def forward(self, x):
        order = [0, 1, 2, 3] if self.step % 2 == 0 else [3, 1, 0]
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return x


def _changing_order(backward_prefetch):
    torch.manual_seed(0)
    base = SkipsABlock()
    ours = wrap_fsdp1(copy.deepcopy(base), wrap_classes=[nn.Linear], backward_prefetch=backward_prefetch, forward_prefetch=True)
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    losses = []
    for model in (ours, ddp):
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            model.module.step = step
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = model(x).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    return losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp)), _gathered_units(ours)


@pytest.mark.parametrize("backward_prefetch", BACKWARD_PREFETCH)
def test_prefetch_follows_a_forward_order_that_changes(backward_prefetch):
    for losses, error, gathered_after_step in run_on_ranks(2, _changing_order, backward_prefetch):
        assert losses[:4] == losses[4:]
        assert error == 0.0
        assert gathered_after_step == []


# ------------------------------------------------------------------- fully_shard: explicit prefetching
@pytest.mark.parametrize("mode", ["prefetch", "no_reshard", "list"])
def test_explicit_prefetch_no_reshard_and_a_group_of_two_modules_train_bitwise_like_torch(mode):
    for placements, (ours, theirs), same in run_on_ranks(2, fully_shard_pair_trained, mode):
        assert placements
        assert ours == theirs
        assert same
