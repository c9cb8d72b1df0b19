"""Tests the ``process_group`` argument given a process group object on a process that never called
``init_process_group`` (a stand-in group, as torch's own wrap-policy tests use): the same units,
rank, world size and shards as torch's FSDP1, and on one rank the same outputs and gradients.
(Process groups and meshes for hybrid sharding: test_hybrid_shard.)"""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _models import IMPLEMENTATIONS, fsdp_api, same_values


@pytest.mark.parametrize("size", [1, 2])
def test_a_process_group_object_without_init_process_group_is_taken_as_torchs(size):
    """A stand-in group (torch's own wrap-policy tests use one) on a process that never called
    ``init_process_group``: the same units, rank, world size and shards as torch's, and on one rank
    the same outputs (a stand-in of two ranks cannot gather: it only plans)."""
    from torch.testing._internal.common_fsdp import DummyProcessGroup

    assert not dist.is_initialized()
    seen = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        fsdp, cpu = fsdp_api(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the world size of 1 switches to NO_SHARD, with a warning
            model = fsdp.FullyShardedDataParallel(
                nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), process_group=DummyProcessGroup(rank=0, size=size),
                auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Linear}), **cpu)
        units = [(m.rank, m.world_size) for m in model.modules() if isinstance(m, fsdp.FullyShardedDataParallel)]
        shards = [p.detach().clone() for p in model.parameters()]
        if size == 1:
            output = model(torch.ones(3, 4))
            output.sum().backward()
            seen[name] = units, shards, output, [p.grad for p in model.parameters()]
        else:
            seen[name] = units, shards
    assert same_values(seen["fsdp1"], seen["torch"])
