"""Tests the rank pool itself: results come back per rank, and one rank's failure fails the test at
once on every rank (instead of hanging the peers in a collective) and leaves a working pool."""

import pytest
import torch
import torch.distributed as dist

from _harness import RankFailure, run_on_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _rank1_fails_before_collective():
    if dist.get_rank() == 1:
        raise ValueError("injected failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here forever without the pool's fail-fast


def test_results_come_back_per_rank():
    assert run_on_ranks(2, _sum_of_ranks) == [(0, 1.0), (1, 1.0)]


def test_one_rank_failure_fails_fast_and_pool_recovers():
    # Rank 0 is blocked in all_reduce: the test must fail with rank 1's traceback, not a timeout.
    with pytest.raises(RankFailure, match="(?s)rank 1 of 2 failed.*injected failure on rank 1"):
        run_on_ranks(2, _rank1_fails_before_collective)
    assert run_on_ranks(2, _sum_of_ranks) == [(0, 1.0), (1, 1.0)]
