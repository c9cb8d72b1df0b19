"""Tests that ranks which drive fsdp1 differently get a named error instead of silently wrong
training (docs/reliability.md). H4: units run in a rank-dependent order
with equal shapes pair different units' shards in every all-gather without any collective failing;
torch's FSDP1 trains on silently (and its DETAIL check crashes with use_orig_params=True)."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp1

from _harness import run_on_ranks


class ThreeBranches(nn.Module):
    """Three units of equal shapes; rank 1 runs the last two in the other order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        order = (self.a, self.b, self.c) if dist.get_rank() == 0 else (self.a, self.c, self.b)
        for layer in order:
            x = torch.tanh(layer(x))
        return x


def _rank_dependent_order(api):
    torch.manual_seed(0)
    if api == "fully_shard":
        model = ThreeBranches()
        for layer in (model.a, model.b, model.c):
            fsdp1.fully_shard(layer)
        fsdp1.fully_shard(model)
    else:
        model = fsdp1.FullyShardedDataParallel(ThreeBranches(), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({nn.Linear}),
                                               use_orig_params=api == "use_orig_params")
    try:
        model(torch.randn(4, 8)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("api", ["flat_params", "use_orig_params", "fully_shard"])
def test_units_run_in_different_orders_are_named_on_every_rank(api):
    for message in run_on_ranks(2, _rank_dependent_order, api):
        assert message is not None
        assert "different orders in the first iteration" in message
        assert "unit #2 holding parameters: rank 0 'b', rank 1 'c'" in message


def _seeded_by_rank(sync_module_states, require_same_values=False):
    """What the construction said (the error's or warning's text) and the first parameter's sum."""
    torch.manual_seed(dist.get_rank())  # a data-parallel script's per-rank seed, set before the model
    if require_same_values:
        os.environ["FSDP1_REQUIRE_SAME_VALUES"] = "1"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = fsdp1.FullyShardedDataParallel(ThreeBranches(), sync_module_states=sync_module_states,
                                                   auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({nn.Linear}))
    except ValueError as error:
        return str(error), None
    finally:
        os.environ.pop("FSDP1_REQUIRE_SAME_VALUES", None)
    said = [str(w.message) for w in caught if "other values" in str(w.message)]
    with fsdp1.FullyShardedDataParallel.summon_full_params(model):
        return said, model.a.weight.sum().item()


def test_ranks_that_built_different_values_are_named_unless_rank_0_s_are_taken():
    """Case H7 (pytorch#75870): each rank keeps its own shard of what it built, so torch's
    FSDP1 silently trains a mix of differently seeded models. fsdp1 warns on every rank, naming the
    first parameter that differs (scripts that run under torch's FSDP1 must run); with
    FSDP1_REQUIRE_SAME_VALUES=1 it refuses before wrapping anything; with sync_module_states=True
    every rank takes rank 0's values and nothing is said."""
    expected = ("fsdp1: 'a.weight' has other values on rank 1 than on rank 0: the ranks built the model "
                "differently (other seeds?), and each keeps its own shard of what it built, so they train a mix "
                "of their models. Seed every rank alike before building the model, or pass "
                "sync_module_states=True to take the first rank's values (FSDP1_REQUIRE_SAME_VALUES=1 makes "
                "this an error).")
    for said, _ in run_on_ranks(2, _seeded_by_rank, False):
        assert said == [expected]
    for message, _ in run_on_ranks(2, _seeded_by_rank, False, True):
        assert message == expected
    synced = run_on_ranks(2, _seeded_by_rank, True)
    torch.manual_seed(0)
    assert synced[0] == synced[1] == ([], ThreeBranches().a.weight.sum().item())


def _built_other_shapes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4 + dist.get_rank()), nn.Linear(4 + dist.get_rank(), 2))
    try:
        fsdp1.FullyShardedDataParallel(model)
    except ValueError as error:
        return str(error)
    return None


def test_ranks_that_built_other_shapes_are_refused_on_every_rank():
    """No training survives parameters of other shapes on some rank: refused before wrapping, on every
    rank, naming the parameter and both shapes (without FSDP1_REQUIRE_SAME_VALUES)."""
    for message in run_on_ranks(2, _built_other_shapes):
        assert message == ("fsdp1: '0.weight' is torch.float32 of shape (5, 4) on rank 1 but torch.float32 of shape "
                           "(4, 4) on rank 0; build the same model on every rank.")
