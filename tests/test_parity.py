"""Tests that fsdp1 trains exactly like DDP and torch's own FSDP1 (per-step losses and final parameters
after 5 Adam steps) and like one process over the global batch (5 SGD steps: Adam would amplify the
last-bit differences of another summation order), for every strategy x use_orig_params, on 2 and 4
ranks, on a transformer whose flat parameters all need padding."""

import pytest
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _harness import run_on_ranks
from _models import (
    build,
    fsdp1_full_params,
    make_gpt,
    max_relative_error,
    plain_params,
    relative_errors,
    sgd,
    torch_fsdp_full_params,
    train,
    train_single_process,
    wrap_fsdp1,
    wrap_torch_fsdp,
)

STEPS = 5
TOLERANCE = 1e-5


def _train_all(strategy: str, use_orig_params: bool):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    ours = build(base, lambda m: wrap_fsdp1(m, strategy, use_orig_params))
    theirs = build(base, lambda m: wrap_torch_fsdp(m, strategy, use_orig_params))
    ddp = build(base, DDP)
    losses = {
        "fsdp1": train(ours, STEPS, world_size, rank),
        "torch_fsdp1": train(theirs, STEPS, world_size, rank),
        "ddp": train(ddp, STEPS, world_size, rank),
    }
    ours_params = fsdp1_full_params(ours)
    errors = {
        "torch_fsdp1": max_relative_error(ours_params, torch_fsdp_full_params(theirs)),
        "ddp": max_relative_error(ours_params, plain_params(ddp)),
    }
    return losses, errors


def _train_sgd_against_single_process(strategy: str, use_orig_params: bool):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    ours = build(base, lambda m: wrap_fsdp1(m, strategy, use_orig_params))
    single = build(base, lambda m: m)
    losses = train(ours, STEPS, world_size, rank, sgd)
    global_losses = train_single_process(single, STEPS, world_size, sgd)
    return losses, global_losses, max_relative_error(fsdp1_full_params(ours), plain_params(single))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_five_adam_steps_match_ddp_and_torch_fsdp1(strategy, use_orig_params, world_size):
    results = run_on_ranks(world_size, _train_all, strategy, use_orig_params)
    for rank, (losses, param_errors) in enumerate(results):
        for oracle in ("ddp", "torch_fsdp1"):
            assert relative_errors(losses["fsdp1"], losses[oracle]) <= TOLERANCE, (rank, oracle, losses)
            error = param_errors[oracle]
            assert error <= TOLERANCE, f"rank {rank}: final parameters differ from {oracle} by {error:.2e}"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_five_sgd_steps_match_one_process_over_the_global_batch(strategy, use_orig_params, world_size):
    results = run_on_ranks(world_size, _train_sgd_against_single_process, strategy, use_orig_params)
    global_losses = results[0][1]
    # The mean of the equal-sized per-rank mean losses is the loss over the global batch.
    mean_losses = [sum(r[0][step] for r in results) / world_size for step in range(STEPS)]
    assert relative_errors(mean_losses, global_losses) <= TOLERANCE
    for rank, (_, _, error) in enumerate(results):
        assert error <= TOLERANCE, f"rank {rank}: final parameters differ from one process by {error:.2e}"
