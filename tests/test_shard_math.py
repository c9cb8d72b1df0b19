"""Tests the pure layout arithmetic (no process group): shard spans agree with torch.chunk, the
aligned layout agrees with torch FSDP1's rule, per-parameter shard slices tile every parameter
exactly once, and the wrap planner visits children before parents."""

import pytest
import torch
from torch import nn

from fsdp1._engine.shard_math import (
    chunk_numel,
    dim0_chunk_range,
    gradient_divide_factors,
    overlap,
    padded_unsharded_numel,
    param_shard_infos,
    plan_flat_layout,
    shard_span,
)
from fsdp1.wrap import ModuleWrapPolicy, plan_auto_wrap


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8])
def test_shard_spans_are_torch_chunks(world_size):
    for numel in range(1, 60):
        chunks = torch.arange(numel).chunk(world_size)
        for rank in range(world_size):
            span = shard_span(numel, rank, world_size)
            expected = chunks[rank].tolist() if rank < len(chunks) else []
            assert list(range(span.start, span.end)) == expected
            assert span.numel + span.numel_padded == chunk_numel(numel, world_size)
        assert padded_unsharded_numel(numel, world_size) % world_size == 0


def test_aligned_layout_starts_each_param_on_16_bytes_and_pads_to_world_size():
    layout = plan_flat_layout([15, 5, 3, 8], aligned_numel=4, world_size=3)
    assert layout.offsets == (0, 16, 24, 28)
    assert layout.numel == 36
    assert plan_flat_layout([15, 5], aligned_numel=0, world_size=3) == plan_flat_layout([15, 5], 0, 1)
    assert plan_flat_layout([15, 5], aligned_numel=0, world_size=3).numel == 20


def test_split_sizes_cover_the_padded_flat_tensor():
    layout = plan_flat_layout([15, 5, 3], aligned_numel=4, world_size=2)
    sizes, piece_of_param = layout.split_sizes(padded_numel=30)
    assert sizes == (15, 1, 5, 3, 3, 3)
    assert piece_of_param == (0, 2, 4)
    assert sum(sizes) == 30


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_param_slices_tile_every_parameter_exactly_once(world_size):
    numels = [7, 1, 12, 5, 30]
    layout = plan_flat_layout(numels, aligned_numel=4, world_size=world_size)
    covered = {i: [] for i in range(len(numels))}
    for rank in range(world_size):
        span = shard_span(layout.numel, rank, world_size)
        for i, info in enumerate(param_shard_infos(layout, span)):
            if info.in_shard:
                assert 0 <= info.offset_in_shard
                assert info.offset_in_shard + info.numel_in_shard <= span.numel
                covered[i].extend(range(info.intra_param_start, info.intra_param_start + info.numel_in_shard))
    assert {i: sorted(c) for i, c in covered.items()} == {i: list(range(n)) for i, n in enumerate(numels)}


def test_gradient_divide_factors_multiply_to_world_size_as_torch_splits_them():
    assert [gradient_divide_factors(n) for n in (1, 2, 4, 8, 16, 6)] == [
        (1.0, 1.0), (2.0, 1.0), (2.0, 2.0), (4.0, 2.0), (4.0, 4.0), (4.0, 1.5)
    ]


def test_planner_wraps_children_before_parents_and_never_the_root():
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    root = nn.Sequential(inner, nn.Linear(2, 2), nn.ReLU())
    planned = plan_auto_wrap(root, ModuleWrapPolicy({nn.Sequential, nn.Linear}), set(), {"x": 1})
    assert list(planned) == [inner[0], inner[1], inner, root[1]]
    assert all(kwargs == {"x": 1} for kwargs in planned.values())


def test_planner_runs_legacy_callable_policies_with_the_remaining_numel():
    seen = []

    def min_six_params(module, recurse, nonwrapped_numel):
        if not recurse:
            seen.append((type(module).__name__, nonwrapped_numel))
        return recurse or nonwrapped_numel >= 6

    root = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(1, 1), nn.Linear(2, 1)))
    planned = plan_auto_wrap(root, min_six_params, set(), {})
    assert list(planned) == [root[0]]  # 6 params; the inner Sequential's 2 + 3 = 5 stay with the root
    assert seen == [("Linear", 6), ("Linear", 2), ("Linear", 3), ("Sequential", 5)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 7, 9, 10])
def test_dim0_chunks_split_rows_as_torch_chunk_and_dtensor_do(rows, world_size):
    offset, shape = 13, (rows, 3)
    sizes = [c.shape[0] for c in torch.empty(shape).chunk(world_size)] if rows else []
    sizes += [0] * (world_size - len(sizes))  # DTensor's Shard(0): ranks past the last chunk hold nothing
    ranges = [dim0_chunk_range(offset, shape, rank, world_size) for rank in range(world_size)]
    assert [(end - start) // 3 for start, end in ranges] == sizes
    assert ranges[0][0] == offset
    assert ranges[-1][1] == offset + rows * 3
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert overlap((0, 5), (3, 9)) == (3, 5)
    assert overlap((0, 2), (4, 9)) == (4, 4)
