"""Tests ``fsdp1.sharded_grad_scaler.ShardedGradScaler`` in fp16 training: the steps it skips, its
scale and the parameters equal torch's ShardedGradScaler driving torch's FSDP1; an overflow that
only one rank's shard sees makes every rank skip (a plain GradScaler would let the others step);
on CPU, with CPU offload, and with fp16 gradients (``keep_low_precision_grads``). ``use_as_torch_fsdp``
puts fsdp1's ShardedGradScaler at torch's import paths, and puts torch's back."""

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp1
from fsdp1.sharded_grad_scaler import ShardedGradScaler

from _harness import run_on_ranks
from _models import Block, batch, fsdp1_full_params, lm_loss, make_gpt, max_relative_error, torch_fsdp_full_params

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _scaled_training(keep_low, offload):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    mp = dict(param_dtype=torch.float16, keep_low_precision_grads=keep_low)
    ours = fsdp1.FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}),
                                          mixed_precision=fsdp1.MixedPrecision(**mp),
                                          cpu_offload=fsdp1.CPUOffload(offload_params=offload))
    theirs = TorchFSDP(copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({Block}),
                       mixed_precision=TorchMixedPrecision(**mp), device_id=torch.device("cpu"))
    runs = []
    # 2**16 times the loss overflows fp16: the first steps are skipped and the scale backs off, then grows.
    for model, scaler in ((ours, ShardedGradScaler("cpu", growth_interval=2)),
                          (theirs, TorchShardedGradScaler("cpu", growth_interval=2))):
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        scales, losses = [], []
        for step in range(8):
            loss = lm_loss(model, *batch(step, rank, world))
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
            scales.append(scaler.get_scale())
            losses.append(loss.item())
        runs.append((scales, losses))
    return runs, max_relative_error(fsdp1_full_params(ours), torch_fsdp_full_params(theirs))


@pytest.mark.parametrize("keep_low, offload", [(False, False), (True, False), (False, True)])
def test_skips_the_steps_torchs_skips(keep_low, offload):
    for ((scales, losses), (their_scales, their_losses)), error in run_on_ranks(2, _scaled_training, keep_low, offload):
        assert scales == their_scales
        assert losses == their_losses
        assert error == 0.0
        assert scales[0] < 2.0**16  # backed off
        assert any(b > a for a, b in zip(scales, scales[1:]))  # then grew


def _overflow_on_one_rank(scaler_class):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = fsdp1.FullyShardedDataParallel(make_gpt(), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}),
                                           mixed_precision=fsdp1.MixedPrecision(param_dtype=torch.float16))
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = scaler_class("cpu", init_scale=4.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(lm_loss(model, *batch(0, rank, world))).backward()
    if rank == 0:  # an overflow in an element only rank 0's shard holds
        next(model.parameters()).grad[0] = float("inf")
    scaler.step(optim)
    scaler.update()
    stepped = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    return stepped, scaler.get_scale()


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    assert run_on_ranks(2, _overflow_on_one_rank, ShardedGradScaler) == [(False, 2.0), (False, 2.0)]
    # The plain GradScaler decides per rank: rank 1 steps while rank 0 skips (what this scaler prevents).
    assert run_on_ranks(2, _overflow_on_one_rank, torch.amp.GradScaler) == [(False, 2.0), (True, 4.0)]


# ------------------------------------------------------------------- use_as_torch_fsdp
def test_use_as_torch_fsdp_puts_fsdp1s_sharded_grad_scaler_at_torchs_paths_and_back():
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.sharded_grad_scaler as torch_scaler_module

    original = torch_scaler_module.ShardedGradScaler
    exported = hasattr(torch_fsdp, "ShardedGradScaler")
    with fsdp1.use_as_torch_fsdp():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        assert ShardedGradScaler is fsdp1.sharded_grad_scaler.ShardedGradScaler
        assert not exported or torch_fsdp.ShardedGradScaler is ShardedGradScaler
    assert torch_scaler_module.ShardedGradScaler is original
    assert hasattr(torch_fsdp, "ShardedGradScaler") == exported
