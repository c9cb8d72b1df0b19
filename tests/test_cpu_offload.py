"""Tests ``CPUOffload(offload_params=True)`` on this CPU-only machine, where torch's FSDP1 fails in
``pin_memory()``: training equals the same run without offloading and DDP's, the sharded parameters
and their gradients stay on the CPU, and torch's config object is accepted. (The CUDA path, a CPU
shard gathered through the device, is not exercised here: see the README.)"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1
from _harness import run_on_ranks
from _models import Block, fsdp1_full_params, make_gpt, max_relative_error, relative_errors, train

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
        assert offloaded == in_place and error == 0.0
        assert relative_errors(offloaded, ddp) <= 1e-6
        assert devices == {"cpu"} and flag is True
