"""Tests ``ignored_modules`` and ``ignored_states``: ignored parameters stay unflattened, unsharded and
trainable by the user, their gradients are not averaged across ranks (as torch's), and no unit below
takes them. The oracle is DDP told to ignore the same parameters, which keeps them local as well.
Ignoring the wrapped module itself warns and leaves every parameter local, as torch's FSDP1 does."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    IMPLEMENTATIONS,
    Block,
    LinearNet,
    fsdp1_full_params,
    fsdp_api,
    make_gpt,
    max_relative_error,
    plain_params,
    relative_errors,
    same_values,
    train,
)

STEPS, TOLERANCE = 4, 1e-5


def _ignore(model, case):
    """(constructor kwargs, ignored parameter names) of each case."""
    if case == "head_module":
        return dict(ignored_modules=[model.head]), ["head.weight", "head.bias"]
    if case == "params_in_and_outside_units":
        return dict(ignored_states=[model.pos, model.blocks[0].fc.weight]), ["pos", "blocks.0.fc.weight"]
    # a module the policy would have made a unit
    return dict(ignored_states=[model.blocks[1]]), [n for n, _ in model.named_parameters() if n.startswith("blocks.1.")]


def _train_with_ignored(case, strategy, use_orig_params):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    model = copy.deepcopy(base)
    kwargs, ignored_names = _ignore(model, case)
    ours = fsdp1.FullyShardedDataParallel(
        model, auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}),
        sharding_strategy=fsdp1.ShardingStrategy[strategy], use_orig_params=use_orig_params, **kwargs,
    )
    units = fsdp1._engine.traversal.unit_paths(ours)
    flattened = {f"{path}.{fqn}".lstrip(".") for unit, path in units.items() if unit._handle is not None for fqn in unit._handle.fqns}
    ddp_model = copy.deepcopy(base)
    # DDP names a parameter of its root module ".name" ("{module}.{param}" with an empty module name)
    DDP._set_params_and_buffers_to_ignore_for_model(ddp_model, [n if "." in n else f".{n}" for n in ignored_names])
    ddp = DDP(ddp_model)
    losses = [train(m, STEPS, world_size, rank) for m in (ours, ddp)]
    ours_params = fsdp1_full_params(ours)
    named = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in ours.named_parameters()}
    ignored_now = {n: named[n].detach().clone() for n in ignored_names}
    ours_params.update(ignored_now)
    differ_across_ranks = [t.tolist() for t in ignored_now.values()]
    return (sorted(units.values()), ignored_names, flattened, losses,
            max_relative_error(ours_params, plain_params(ddp)), differ_across_ranks)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("case", ["head_module", "params_in_and_outside_units", "a_module_the_policy_matches"])
def test_ignored_parameters_train_locally_like_ddp_ignoring_them(case, strategy, use_orig_params):
    results = run_on_ranks(2, _train_with_ignored, case, strategy, use_orig_params)
    for units, ignored, flattened, (ours, ddp), error, _ in results:
        assert not set(ignored) & flattened  # no unit took them
        if case == "a_module_the_policy_matches":
            assert units == ["", "blocks.0"]
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert error <= TOLERANCE
    assert results[0][-1] != results[1][-1]  # not averaged: each rank trained its own copy


# ------------------------------------------------------------------- ignoring the wrapped module itself
def _ignore_the_wrapped_module():
    results = {}
    for name in IMPLEMENTATIONS:
        api, kwargs = fsdp_api(name)
        torch.manual_seed(0)
        net = LinearNet()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = api.FullyShardedDataParallel(net, ignored_modules=[net], **kwargs)
        torch.manual_seed(dist.get_rank())  # each rank its own batch: ignored gradients stay local
        model(torch.randn(2, 4)).sum().backward()
        params = [(fqn, p.detach().clone(), p.grad.clone()) for fqn, p in model.named_parameters()]
        warned = [(w.category.__name__, "Trying to ignore the top-level module" in str(w.message)) for w in caught]
        results[name] = (warned, params, len(api.FullyShardedDataParallel.fsdp_modules(model)))
    return results


def test_ignoring_the_wrapped_module_warns_and_leaves_every_parameter_local():
    for results in run_on_ranks(2, _ignore_the_wrapped_module):
        assert same_values(results["fsdp1"], results["torch"])
        assert results["fsdp1"][0] == [("UserWarning", True)]
