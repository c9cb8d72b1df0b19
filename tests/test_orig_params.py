"""Tests original parameters that scripts change under ``use_orig_params=True``, each run the same way
under torch's FSDP1 and under fsdp1: a parameter's variable or ``.data`` replaced between steps
(written back, or refused for another shape), replaced after a forward that no backward followed
(taken), or changed between forward and backward of a unit kept gathered (refused); a module's own
``__setattr__`` called for the view changes as torch's calls it (not at all under
``FSDP_USE_UNSAFE_SETATTR=1``); and a submodule registered under two names, which trains and saves
as under torch's."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _harness import run_on_ranks
from _models import (
    IMPLEMENTATIONS,
    LinearNet,
    fsdp_api,
    fsdp_strategy,
    fsdp_wrapped,
    outcome_of,
    same_values,
    summoned_full_params,
)


def _sgd_steps(model, steps=2):
    """Losses of ``steps`` SGD steps on rank-dependent inputs."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        loss = model(x).square().sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


class SharedModule(nn.Module):
    """One Linear registered under two names (``b`` is ``a``), used twice in forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.b(torch.relu(self.a(x))))


def _train_shared_module(use_orig_params):
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = fsdp_wrapped(name, SharedModule(), use_orig_params=use_orig_params)
        losses = _sgd_steps(model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        results[name] = (losses, state, summoned_full_params(name, model))
    return results


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_module_registered_under_two_names_trains_and_saves_as_torchs(use_orig_params):
    """``m.b = m.a``: torch's wraps it, and its state dict has both names; fsdp1 crashed (KeyError)."""
    for result in run_on_ranks(2, _train_shared_module, use_orig_params):
        assert list(result["fsdp1"][1]) == list(result["torch"][1]) == ["a.weight", "a.bias", "b.weight", "b.bias", "head.weight", "head.bias"]
        assert same_values(result["fsdp1"], result["torch"])


def _replace_original_parameters(which, how):
    """use_orig_params: a parameter's variable or ``.data`` replaced between steps is written back
    (same shape) or refused (another shape), as torch's does."""
    rank = dist.get_rank()
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = fsdp_wrapped(name, LinearNet(), use_orig_params=True)
        linear = model.module.a if which == "a" or which == "by rank" and rank == 0 else model.module.b
        shape = linear.weight.shape if how != "shape" else torch.Size([n + 1 for n in linear.weight.shape])
        new = nn.Parameter(torch.full(shape, 2.0 + rank))
        if how == "data":
            linear.weight.data = new
        else:
            linear.weight = new

        def summon_and_train(name=name, model=model):
            full = summoned_full_params(name, model)
            return full, _sgd_steps(model)

        raised, _ = outcome_of(summon_and_train)
        results[name] = (raised, None if raised else summon_and_train())
    return results


@pytest.mark.parametrize("which, how", [("a", "variable"), ("a", "data"), ("b", "variable"), ("b", "data"),
                                        ("by rank", "shape")])
def test_original_parameters_replaced_between_steps_are_written_back_or_refused(which, how):
    """fsdp1 kept the old values without a word; torch writes the new ones into the shard, and a new
    shape raises ``RuntimeError`` ("Cannot writeback"). Each rank replaces a weight it holds part of
    in the last case: torch's checks only those, and a rank holding none would go on alone."""
    for result in run_on_ranks(2, _replace_original_parameters, which, how):
        assert result["torch"][0] == ("RuntimeError" if how == "shape" else None)
        assert same_values(result["fsdp1"], result["torch"])


def _replace_after_a_forward_without_backward():
    """A forward with grad and no backward leaves the root gathered; a parameter replaced then is
    still taken: the next forward computes with it (as the plain model would) and it is in the
    shard afterwards, as under torch's."""
    results = {}
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = fsdp_wrapped(name, LinearNet(), use_orig_params=True)
        model(x)
        model.module.a.weight = nn.Parameter(torch.full_like(model.module.a.weight, 0.25))
        loss = model(x).sum()
        loss.backward()
        results[name] = loss.detach(), summoned_full_params(name, model)
    torch.manual_seed(0)
    plain = LinearNet()
    with torch.no_grad():
        plain.a.weight.fill_(0.25)
    results["plain"] = plain(x).sum().detach()
    return results


def test_a_parameter_replaced_after_a_forward_without_backward_is_taken():
    """fsdp1 put the old parameter back when it resharded, dropping the new one; torch's takes it
    into the shard (and computes that next forward with the old values, where fsdp1 uses the new)."""
    for result in run_on_ranks(2, _replace_after_a_forward_without_backward):
        assert same_values(result["fsdp1"][1], result["torch"][1])
        assert torch.equal(result["fsdp1"][1]["a.weight"], torch.full((4, 4), 0.25))
        assert torch.equal(result["fsdp1"][0], result["plain"])


def _change_between_forward_and_backward(how):
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = fsdp_wrapped(name, LinearNet(), sharding_strategy=fsdp_strategy(name, "SHARD_GRAD_OP"), use_orig_params=True,
                         auto_wrap_policy=fsdp_api(name)[0].wrap.ModuleWrapPolicy({nn.Linear}))
        loss = model(torch.randn(2, 4)).sum()
        if how == "data":
            model.a.weight.data = model.a.weight.clone()
        else:
            model.a.module.weight = nn.Parameter(model.a.weight.clone())
        results[name] = outcome_of(loss.backward)[0]
    return results


@pytest.mark.parametrize("how", ["data", "variable"])
def test_a_parameter_changed_between_forward_and_backward_is_refused(how):
    """SHARD_GRAD_OP keeps the unit gathered for backward, so torch's refuses the change
    (``AssertionError``); fsdp1 went on with the gathered values."""
    for result in run_on_ranks(2, _change_between_forward_and_backward, how):
        assert result == {"torch": "AssertionError", "fsdp1": "AssertionError"}


class SetattrLinear(nn.Module):
    """Counts assignments through its own ``__setattr__`` (a cache keyed on assignment would)."""

    def __init__(self):
        object.__setattr__(self, "assignments", 0)
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.weight

    def __setattr__(self, name, value):
        object.__setattr__(self, "assignments", self.assignments + 1)
        super().__setattr__(name, value)


def _setattr_calls(use_orig_params, unsafe):
    if unsafe:
        os.environ["FSDP_USE_UNSAFE_SETATTR"] = "1"
    try:
        results = {}
        for name in IMPLEMENTATIONS:
            torch.manual_seed(0)
            module = SetattrLinear()
            model = fsdp_wrapped(name, module, use_orig_params=use_orig_params)
            before = module.assignments
            output = model(torch.ones(2, 4))
            results[name] = module.assignments - before, output.detach()
        return results
    finally:
        os.environ.pop("FSDP_USE_UNSAFE_SETATTR", None)


@pytest.mark.parametrize("unsafe", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_forward_assigns_views_through_a_modules_own_setattr(use_orig_params, unsafe):
    """torch's calls the override once per forward without use_orig_params and twice with it, and
    not at all under ``FSDP_USE_UNSAFE_SETATTR=1``."""
    for result in run_on_ranks(2, _setattr_calls, use_orig_params, unsafe):
        assert result["torch"][0] == (0 if unsafe else 2 if use_orig_params else 1)
        assert same_values(result["fsdp1"], result["torch"])
