"""Tests HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on 4 ranks: sharded inside one group, replicated across
the other, from a 2-D device mesh (replicas × shard size: 2×2, 1×4, 4×1) or a (shard, replicate)
group pair, or from neither (nodes of ``LOCAL_WORLD_SIZE`` ranks shard, as torch's builds them),
against DDP. With a shard group of one rank the replicas must still average their
gradients (torch's FSDP1 switches to NO_SHARD there and stops syncing them, pytorch#154888). And
``fully_shard`` on a 2-D (replicate, shard) mesh, trained bitwise like torch's ``fully_shard``."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    Block,
    fsdp1_full_params,
    fully_shard_pair_trained,
    make_gpt,
    max_relative_error,
    plain_params,
    relative_errors,
    train,
)

STEPS, TOLERANCE = 4, 1e-5


def _group_pair(replicas, shard_size):
    """(shard group, replicate group) of this rank, laid out as a (replicas, shard_size) mesh."""
    rank = dist.get_rank()
    shard = replicate = None
    for r in range(replicas):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(r * shard_size, (r + 1) * shard_size)))
        shard = group if rank // shard_size == r else shard
    for s in range(shard_size):
        group = dist.new_group(list(range(s, replicas * shard_size, shard_size)))
        replicate = group if rank % shard_size == s else replicate
    return shard, replicate


def _train_hybrid(shape, groups_from, strategy, use_orig_params):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if groups_from == "mesh":
        where = dict(device_mesh=init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")))
    elif groups_from == "nodes":  # neither: nodes of LOCAL_WORLD_SIZE ranks (torchrun sets it) shard
        os.environ["LOCAL_WORLD_SIZE"], where = str(shape[1]), {}
    else:
        where = dict(process_group=_group_pair(*shape))
    base = make_gpt()
    ours = fsdp1.FullyShardedDataParallel(
        copy.deepcopy(base), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}),
        sharding_strategy=fsdp1.ShardingStrategy[strategy], use_orig_params=use_orig_params, **where,
    )
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    ddp = DDP(copy.deepcopy(base))
    losses = [train(m, STEPS, world_size, rank) for m in (ours, ddp)]
    full = fsdp1_full_params(ours)
    replicas_agree = [torch.cat([p.reshape(-1) for p in full.values()]).tolist()]
    strategies = {unit.sharding_strategy.name for unit in ours.fsdp_modules(ours)}
    return losses, max_relative_error(full, plain_params(ddp)), replicas_agree, strategies


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
@pytest.mark.parametrize("shape, groups_from", [((2, 2), "mesh"), ((1, 4), "mesh"), ((4, 1), "mesh"), ((2, 2), "pair"),
                                                ((2, 2), "nodes"), ((1, 4), "nodes")])
def test_hybrid_sharding_trains_like_ddp_and_keeps_replicas_in_sync(shape, groups_from, strategy, use_orig_params):
    results = run_on_ranks(4, _train_hybrid, shape, groups_from, strategy, use_orig_params)
    for (ours, ddp), error, _, strategies in results:
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert error <= TOLERANCE
        assert strategies == {strategy}  # a shard group of one rank stays hybrid: replicas keep syncing
    assert all(r[2] == results[0][2] for r in results)  # every rank holds the same parameters


# ------------------------------------------------------------------- fully_shard on a 2-D mesh
def test_hsdp_on_a_2d_mesh_trains_bitwise_like_torch():
    for placements, (ours, theirs), same in run_on_ranks(4, fully_shard_pair_trained, "hybrid"):
        assert placements  # (Replicate(), Shard(0)) on a 2x2 mesh
        assert ours == theirs
        assert same
