"""Tests ``clip_grad_norm_`` of the root against DDP plus ``torch.nn.utils.clip_grad_norm_`` doing the
same: the returned total norm (over every rank and unit, sharded, NO_SHARD and ignored parameters)
and the parameters after clipped SGD steps, for p = 2, inf and 1.5, both use_orig_params. Under
``fully_shard``, an optimizer built and a norm clipped after evaluation forwards train like DDP."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    Block,
    batch,
    fsdp1_full_params,
    fully_shard_against_oracle,
    lm_loss,
    make_gpt,
    max_relative_error,
    plain_params,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
MAX_NORM, STEPS, TOLERANCE = 0.1, 3, 1e-5


def _clipped_training(strategy, use_orig_params, norm_type, ignore_head):
    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    ours_model, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    extra = dict(ignored_modules=[ours_model.head]) if ignore_head else {}
    ours = fsdp1.FullyShardedDataParallel(ours_model, auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}),
                                          sharding_strategy=fsdp1.ShardingStrategy[strategy],
                                          use_orig_params=use_orig_params, **extra)
    if ignore_head:  # DDP keeps the same parameters local
        DDP._set_params_and_buffers_to_ignore_for_model(ddp_model, ["head.weight", "head.bias"])
    ddp = DDP(ddp_model)
    norms = []
    for model, clip in ((ours, lambda: ours.clip_grad_norm_(MAX_NORM, norm_type)),
                        (ddp, lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM, norm_type))):
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        model_norms = []
        for step in range(STEPS):
            lm_loss(model, *batch(step, rank, world)).backward()
            model_norms.append(clip().item())
            optim.step()
            optim.zero_grad()
        norms.append(model_norms)
    ours_params = fsdp1_full_params(ours)
    named = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in ours.named_parameters()}
    ours_params.update({n: named[n].detach() for n in ("head.weight", "head.bias") if ignore_head})
    return norms, max_relative_error(ours_params, plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.5])
@pytest.mark.parametrize("strategy, ignore_head", [("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False)])
def test_clip_grad_norm_matches_ddp(strategy, ignore_head, norm_type, use_orig_params):
    for (ours, ddp), error in run_on_ranks(2, _clipped_training, strategy, use_orig_params, norm_type, ignore_head):
        if ignore_head:
            # Ignored gradients stay local, so each rank's norm (DDP's too) differs and each rank scales
            # its part by its own factor: only the first norm is comparable.
            ours, ddp, error = ours[:1], ddp[:1], 0.0
        assert all(abs(a - b) <= TOLERANCE * b for a, b in zip(ours, ddp))
        assert max(ddp) > MAX_NORM  # it clipped
        assert error <= TOLERANCE


def _on_inner_unit():
    model = fsdp1.FullyShardedDataParallel(make_gpt(), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}))
    lm_loss(model, *batch(0, dist.get_rank(), dist.get_world_size())).backward()
    try:
        model.blocks[0].clip_grad_norm_(1.0)
    except RuntimeError as error:
        return str(error)


def test_clip_grad_norm_on_an_inner_unit_is_refused():
    for message in run_on_ranks(2, _on_inner_unit):
        assert "inner FSDP unit 'blocks.0'" in message
        assert "root" in message



def _against_torch(strategy, use_orig_params, norm_type):
    from _models import torch_fsdp_full_params, wrap_fsdp1, wrap_torch_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    models = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params), wrap_torch_fsdp(copy.deepcopy(base), strategy, use_orig_params)
    norms = []
    for model in models:
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        model_norms = []
        for step in range(STEPS):
            lm_loss(model, *batch(step, rank, world)).backward()
            model_norms.append(model.clip_grad_norm_(MAX_NORM, norm_type).item())
            optim.step()
            optim.zero_grad()
        norms.append(model_norms)
    return norms, max_relative_error(fsdp1_full_params(models[0]), torch_fsdp_full_params(models[1]))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("strategy, use_orig_params", [("FULL_SHARD", False), ("FULL_SHARD", True), ("SHARD_GRAD_OP", True),
                                                       ("NO_SHARD", False)])
def test_clip_grad_norm_is_bitwise_torch_fsdp1s(strategy, use_orig_params, norm_type):
    """The same norms and, after clipped Adam steps, the same parameters bit for bit: clipping with a
    norm one rounding away from torch's would make the two runs drift apart."""
    for (ours, theirs), error in run_on_ranks(2, _against_torch, strategy, use_orig_params, norm_type):
        assert ours == theirs
        assert max(theirs) > MAX_NORM
        assert error == 0.0


def _nan_on_rank_1(strategy, error_if_nonfinite):
    """Case N1: a NaN in rank 1's batch at the first step."""
    model = fsdp1.FullyShardedDataParallel(make_gpt(), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}),
                                           sharding_strategy=fsdp1.ShardingStrategy[strategy], use_orig_params=True)
    inputs, targets = batch(0, dist.get_rank(), dist.get_world_size())
    loss = lm_loss(model, inputs, targets)
    if dist.get_rank() == 1:
        loss = loss * torch.tensor(float("nan"))
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    try:
        outcome = ("norm", model.clip_grad_norm_(1.0, error_if_nonfinite=error_if_nonfinite).item())
    except RuntimeError as error:
        outcome = ("error", str(error))
    after = [p.grad for p in model.parameters() if p.grad is not None]
    untouched = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(grads, after))
    return outcome, untouched


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_a_nan_on_one_rank_is_reported_on_every_rank_before_any_gradient_is_scaled(strategy):
    for (kind, message), untouched in run_on_ranks(2, _nan_on_rank_1, strategy, True):
        assert kind == "error"
        assert "error_if_nonfinite=True" in message
        assert "No gradient was scaled" in message
        assert "rank(s) [0, 1]" in message  # the reduction spread rank 1's NaN into every shard
        assert untouched
    norms = [norm for (_, norm), _ in run_on_ranks(2, _nan_on_rank_1, strategy, False)]
    assert all(norm != norm for norm in norms)  # the same NaN on every rank, as torch's


# ------------------------------------------------------------------- fully_shard: optimizer and clipping after evaluation forwards
def test_an_optimizer_built_and_a_norm_clipped_after_evaluation_forwards_train_like_ddp():
    """Both silently wrong under torch's fully_shard, which leaves the root's unsharded parameters
    registered after an evaluation forward, for the optimizer and clip_grad_norm_ to pick up."""
    for ours, ddp, error in run_on_ranks(2, fully_shard_against_oracle, "optimizer_after_eval"):
        assert max(abs(a - b) for a, b in zip(ours, ddp)) < 1e-5
        assert error < 1e-5
