"""Tests gradient accumulation without synchronising gradients, whichever API drives it: under
``fully_shard``, ``set_requires_gradient_sync(False)`` (with and without ``set_reshard_after_backward``)
trains bitwise like torch's ``fully_shard`` and within 1e-5 of DDP's ``no_sync``, also with bf16 compute and fp32 reduction (the unreduced gradients
accumulate in fp32), and a chunked loss (torchtitan's: a forward that skips the ``[norm, head]`` group, then
the head per chunk with a backward each) accumulates as torch's ``fully_shard``; under
``FullyShardedDataParallel``, inside ``no_sync()`` the original parameters show the local unsharded
gradient (every strategy, as torch's FSDP1), and SHARD_GRAD_OP keeps the unsharded flat parameter
across it and trains as torch's. (``no_sync`` against DDP for every strategy: test_parity.)"""

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    IMPLEMENTATIONS,
    VOCAB,
    LinearNet,
    TinyGPT,
    adam,
    batch,
    fsdp_strategy,
    fsdp_wrapped,
    full_grads,
    fully_shard_of,
    lm_loss,
    local_shards,
    make_gpt,
    make_trunk,
    run_both,
    same_tensors,
    same_values,
    shard_gpt,
    summoned_full_params,
    torchs_fully_shard,
)


# ------------------------------------------------------------------- fully_shard: set_requires_gradient_sync(False)
def _accumulate(reshard_after_backward):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    models = [shard_gpt(make_gpt(), shard) for shard in (fsdp1.fully_shard, torchs_fully_shard())]
    ddp = DDP(make_gpt())
    results = []
    for model in models:
        optim = adam(model.parameters())
        losses, grads_after_unsynced = [], []
        for step in range(2):
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(reshard_after_backward)
            loss = lm_loss(model, *batch(2 * step, rank, world_size))
            loss.backward()
            grads_after_unsynced.append(all(p.grad is None for p in model.parameters()))
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
            loss2 = lm_loss(model, *batch(2 * step + 1, rank, world_size))
            loss2.backward()
            optim.step()
            optim.zero_grad()
            losses.append((loss.item(), loss2.item()))
        results.append((losses, grads_after_unsynced, local_shards(model)))
    optim = adam(ddp.parameters())
    ddp_losses = []
    for step in range(2):
        with ddp.no_sync():
            loss = lm_loss(ddp, *batch(2 * step, rank, world_size))
            loss.backward()
        loss2 = lm_loss(ddp, *batch(2 * step + 1, rank, world_size))
        loss2.backward()
        optim.step()
        optim.zero_grad()
        ddp_losses.append((loss.item(), loss2.item()))
    (ours, ours_none, ours_params), (theirs, theirs_none, theirs_params) = results
    same = all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params))
    return ours, theirs, ddp_losses, ours_none, theirs_none, same


@pytest.mark.parametrize("reshard_after_backward", [True, False])
def test_gradient_accumulation_without_sync_is_torchs_and_ddps_no_sync(reshard_after_backward):
    for ours, theirs, ddp, ours_none, theirs_none, same in run_on_ranks(2, _accumulate, reshard_after_backward):
        assert ours == theirs
        assert same
        assert max(abs(a - b) for pair in zip(ours, ddp) for a, b in zip(*pair)) < 1e-5
        # After an unsynchronised backward the sharded parameters have no .grad; kept gathered, the
        # module holds the unsharded parameters, whose .grad is the unreduced sum (as torch's).
        assert ours_none == theirs_none == [reshard_after_backward] * 2


# ------------------------------------------------------------------- fully_shard: several backwards a step, bf16 compute
def _chunked_loss(impl):
    shard = fully_shard_of(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_trunk()
    shard_gpt(model, shard, head_group=True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(2):
        inputs, targets = batch(step, rank, world_size, batch_size=4)
        hidden = model(inputs)
        detached = hidden.detach().requires_grad_(True)
        for chunk, chunk_targets in zip(detached.chunk(2), targets.chunk(2)):
            loss = F.cross_entropy(model.head(chunk).reshape(-1, VOCAB), chunk_targets.reshape(-1))
            loss.backward()
            losses.append(loss.item())
        hidden.backward(detached.grad)
        grads.append(full_grads(model))
        optim.step()
        optim.zero_grad()
    return losses, grads


def test_a_chunked_loss_through_a_group_that_the_forward_skipped_trains_as_torchs():
    ours, theirs = run_both(_chunked_loss)
    assert ours[0] == theirs[0]
    assert all(same_tensors(a, b) for a, b in zip(ours[1], theirs[1]))


def _accumulate_in_reduce_dtype(impl):
    shard = fully_shard_of(impl)
    policy_class = fsdp1.MixedPrecisionPolicy if impl == "fsdp1" else torch.distributed.fsdp.MixedPrecisionPolicy
    policy = policy_class(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        shard(block, mp_policy=policy)
    shard(model, mp_policy=policy)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(2):
        for micro in range(4):
            model.set_requires_gradient_sync(micro == 3)
            inputs, targets = batch(4 * step + micro, rank, world_size)
            F.cross_entropy(model(inputs).float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
        grads.append(full_grads(model))
        optim.step()
        optim.zero_grad()
    return grads


def test_bf16_compute_with_fp32_reduction_accumulates_unreduced_gradients_in_fp32_as_torchs():
    ours, theirs = run_both(_accumulate_in_reduce_dtype)
    assert all(g.dtype == torch.float32 for g in ours[0])
    assert same_tensors(ours[0], theirs[0])
    assert same_tensors(ours[1], theirs[1])



# ------------------------------------------------------------------- FullyShardedDataParallel: no_sync()
def _grads_inside_no_sync(strategy):
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = fsdp_wrapped(name, LinearNet(), sharding_strategy=fsdp_strategy(name, strategy), use_orig_params=True)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        with model.no_sync():
            for micro_batch in range(2):
                model(torch.randn(2, 4) + dist.get_rank()).sum().backward()
                seen.append([p.grad.clone() for p in model.parameters()])
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        results[name] = seen, summoned_full_params(name, model)
    return results


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_inside_no_sync_the_original_parameters_show_the_local_unsharded_gradient(strategy):
    """Gradient logging or clipping between micro-batches reads ``p.grad``: torch's shows the local
    accumulated gradient in the parameter's full shape there; fsdp1 showed None."""
    for result in run_on_ranks(2, _grads_inside_no_sync, strategy):
        assert same_values(result["fsdp1"], result["torch"])
        assert result["fsdp1"][0][0][0].shape == (4, 4)


def _shard_grad_op_inside_no_sync():
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = fsdp_wrapped(name, LinearNet(), sharding_strategy=fsdp_strategy(name, "SHARD_GRAD_OP"))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.no_sync():
            model(torch.randn(2, 4) + dist.get_rank()).sum().backward()
        flat_numel = next(model.parameters()).numel()
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        results[name] = flat_numel, summoned_full_params(name, model)
    return results


def test_shard_grad_op_inside_no_sync_keeps_the_unsharded_flat_parameter_and_trains_as_torchs():
    """A documented difference: both keep the unsharded buffer for the next micro-batch (no gather);
    fsdp1's flat parameter keeps pointing at it, torch's points at the shard."""
    for result in run_on_ranks(2, _shard_grad_op_inside_no_sync):
        assert result["fsdp1"][0] == 36  # 4 * 4 + 4 + 4 * 3 + 3 = 35 elements, padded: both ranks' shards
        assert result["torch"][0] == 18  # this rank's shard of the padded 36
        assert same_values(result["fsdp1"][1], result["torch"][1])
