"""Tests ``CPUOffload(offload_params=True)`` on this CPU-only machine, where torch's FSDP1 fails in
``pin_memory()``: training equals the same run without offloading and DDP's, the sharded parameters
and their gradients stay on the CPU, and torch's config object is accepted. The CUDA path (a CPU
shard copied to the device for each gather, gradients copied back) runs where a GPU is: one rank,
where both FSDP1s fall back to NO_SHARD, against torch's FSDP1 offloading the same way. Under
``fully_shard``, ``CPUOffloadPolicy`` (pinned memory) trains as without it on this CPU host, where
torch's fails, and ``ignored_params`` stay plain tensors whose gradients are not reduced."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    Block,
    adam,
    batch,
    fsdp1_full_params,
    lm_loss,
    make_gpt,
    max_relative_error,
    relative_errors,
    shard_gpt,
    train,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _offloaded_training(strategy, use_orig_params, torch_config, mixed):
    from torch.distributed.fsdp import CPUOffload as TorchCPUOffload

    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    offload = TorchCPUOffload(offload_params=True) if torch_config else fsdp1.CPUOffload(offload_params=True)
    mp = fsdp1.MixedPrecision(param_dtype=torch.bfloat16) if mixed else None
    models = [
        fsdp1.FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}),
                                       sharding_strategy=fsdp1.ShardingStrategy[strategy], use_orig_params=use_orig_params,
                                       cpu_offload=cpu_offload, mixed_precision=mp)
        for cpu_offload in (offload, None)
    ]
    losses = [train(model, 4, world, rank) for model in models]
    ddp_losses = train(DDP(copy.deepcopy(base)), 4, world, rank) if not mixed else losses[1]
    devices = {p.device.type for p in models[0].parameters()} | {p.grad.device.type for p in models[0].parameters()
                                                                if p.grad is not None}
    offloaded = models[0].cpu_offload.offload_params
    return losses, ddp_losses, max_relative_error(fsdp1_full_params(models[0]), fsdp1_full_params(models[1])), devices, offloaded


@pytest.mark.parametrize("strategy, use_orig_params, torch_config, mixed", [
    ("FULL_SHARD", False, False, False),
    ("FULL_SHARD", True, True, False),
    ("SHARD_GRAD_OP", False, True, True),
    ("NO_SHARD", True, False, False),
])
def test_offloaded_training_equals_training_in_place(strategy, use_orig_params, torch_config, mixed):
    for (offloaded, in_place), ddp, error, devices, flag in run_on_ranks(2, _offloaded_training, strategy, use_orig_params,
                                                                            torch_config, mixed):
        assert offloaded == in_place
        assert error == 0.0
        assert relative_errors(offloaded, ddp) <= 1e-6
        assert devices == {"cpu"}
        assert flag is True


def _offloaded_on_the_gpu(use_orig_params, mixed):
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    device = torch.device("cuda", 0)
    base = make_gpt()
    results = []
    for fsdp, config, policy, precision in ((fsdp1.FullyShardedDataParallel, fsdp1.CPUOffload, fsdp1.wrap.ModuleWrapPolicy,
                                              fsdp1.MixedPrecision),
                                             (FullyShardedDataParallel, CPUOffload, ModuleWrapPolicy, MixedPrecision)):
        model = fsdp(copy.deepcopy(base), auto_wrap_policy=policy({Block}), cpu_offload=config(offload_params=True),
                     mixed_precision=precision(param_dtype=torch.bfloat16) if mixed else None,
                     use_orig_params=use_orig_params, device_id=device)
        optim = adam(model.parameters())
        losses = []
        for step in range(4):
            inputs, targets = batch(step, 0, 1)
            loss = lm_loss(model, inputs.to(device), targets.to(device))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        devices = {p.device.type for p in model.parameters()}
        with fsdp.summon_full_params(model):
            state = {name.replace("_fsdp_wrapped_module.", ""): p.detach().cpu().clone()
                     for name, p in model.named_parameters()}
        results.append((losses, devices, state))
    return results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path of offloading needs a GPU")
@pytest.mark.parametrize("use_orig_params, mixed", [(False, False), (True, False), (False, True)])
def test_offloaded_training_on_the_gpu_equals_torchs(use_orig_params, mixed):
    [((losses, devices, state), (their_losses, their_devices, their_state))] = run_on_ranks(
        1, _offloaded_on_the_gpu, use_orig_params, mixed)
    assert losses == their_losses
    assert devices == their_devices == {"cpu"}
    assert state.keys() == their_state.keys()
    assert all(torch.equal(state[k], their_state[k]) for k in state)


# ------------------------------------------------------------------- fully_shard: CPUOffloadPolicy
def _offload_and_ignored():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    offloaded = shard_gpt(make_gpt(), fsdp1.fully_shard, offload_policy=fsdp1.CPUOffloadPolicy())  # pin_memory=True
    plain = shard_gpt(make_gpt(), fsdp1.fully_shard)
    losses = [train(model, 3, world_size, rank) for model in (offloaded, plain)]
    model = make_gpt()
    ignored = {model.ln_f.weight, model.ln_f.bias}
    shard_gpt(model, fsdp1.fully_shard, ignored_params=ignored)
    kinds = [isinstance(model.ln_f.weight, DTensor), isinstance(model.head.weight, DTensor)]
    lm_loss(model, *batch(0, rank, world_size)).backward()
    return losses, kinds, model.ln_f.weight.grad.clone()


def test_cpu_offload_with_pinned_memory_works_on_a_cpu_host_and_ignored_params_stay_plain():
    results = run_on_ranks(2, _offload_and_ignored)
    for (offloaded, plain), kinds, _ in results:
        assert offloaded == plain  # torch's fails here with pin_memory=True
        assert kinds == [False, True]
    assert not torch.equal(results[0][2], results[1][2])  # an ignored parameter's gradient is not reduced
