"""Tests the layout contract: every kind of ``ParamLayout`` (FSDP1's flat shard, aligned or not,
sharded or not; ``fully_shard``'s chunks along dim 0 or others) keeps the same promises on 2 real ranks, for parameters
of odd sizes, a zero-size dimension and a single row. Full values go into the shard and come back
through the gather; the gather fills each parameter's full value; the reduction's input, reduce-
scattered, leaves each rank its part of the summed gradient; and each parameter's dim-0 rows of
this rank (DTensor's ``Shard(0)``, or ``Shard(dim)`` where ``fully_shard`` splits another dim) come
out of the shard and go back into it."""

import pytest
import torch
import torch.distributed as dist

from fsdp1._engine import collectives as comm
from fsdp1._fully_shard.chunk_shard_layout import ChunkShardLayout
from fsdp1._wrapper.flat_shard_layout import FlatShardLayout

from _harness import run_on_ranks

SHAPES = [torch.Size(s) for s in [(7, 3), (5,), (4, 0, 8), (1, 4), (10,), (3, 3, 2)]]

LAYOUTS = {
    "flat": lambda rank, world: FlatShardLayout(SHAPES, 0, rank, world, is_sharded=True),
    "flat_aligned": lambda rank, world: FlatShardLayout(SHAPES, 4, rank, world, is_sharded=True),
    "flat_unsharded": lambda rank, world: FlatShardLayout(SHAPES, 0, rank, world, is_sharded=False),
    "chunks": lambda rank, world: ChunkShardLayout(SHAPES, rank, world),
    "chunks_other_dims": lambda rank, world: ChunkShardLayout(SHAPES, rank, world, shard_dims=(0, 0, 2, 1, 0, 2)),
}


def _values(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _unsharded_of(layout, values):
    """The whole unsharded buffer from this rank's shard of ``values``, through the layout's gather."""
    shard = torch.zeros(layout.shard_numel)
    layout.shard_of_values(values, shard)
    if not layout.is_sharded:
        return shard
    unsharded = layout.new_unsharded(torch.float32, torch.device("cpu"))
    layout.all_gather(unsharded, shard, dist.group.WORLD, "").wait()
    return unsharded


def _full_values_round_trip(kind):
    layout = LAYOUTS[kind](dist.get_rank(), dist.get_world_size())
    values = _values(0)
    return [torch.equal(got, want) for got, want in zip(layout.unflatten(_unsharded_of(layout, values)), values)]


def _gather_fills_flatten(kind):
    layout = LAYOUTS[kind](dist.get_rank(), dist.get_world_size())
    values = _values(1)
    flattened = layout.flatten(values)
    return [torch.equal(got, want) for got, want in zip(layout.unflatten(_unsharded_of(layout, values)),
                                                         layout.unflatten(flattened))]


def _reduction_leaves_each_rank_its_part_of_the_sum(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = LAYOUTS[kind](rank, world)
    grads = [_values(10 + r) for r in range(world)]  # every rank's gradient, known everywhere
    unsharded_grad = layout.flatten(grads[rank])
    summed = [sum(grad[i] for grad in grads) for i in range(len(SHAPES))]
    expected = torch.zeros(layout.shard_numel)
    layout.shard_of_values(summed, expected)
    reduce_input = layout.reduce_input(unsharded_grad)
    if layout.is_sharded:
        reduced = reduce_input.new_empty(layout.shard_numel)
        comm.reduce_scatter_into(reduced, reduce_input, dist.group.WORLD, "").wait()
    else:
        reduced = reduce_input
        comm.all_reduce(reduced, dist.group.WORLD, "").wait()
    return [torch.allclose(got, want, atol=1e-6) for got, want in zip(layout.local_views(reduced), layout.local_views(expected))]


def _rows_come_out(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = LAYOUTS[kind](rank, world)
    values = _values(2)
    shard = torch.zeros(layout.shard_numel)
    layout.shard_of_values(values, shard)
    row_world, row_rank = (world, rank) if layout.is_sharded else (1, 0)
    expected = [_chunk(value, dim, row_rank, row_world) for value, dim in zip(values, layout.shard_dims)]
    return [torch.equal(got, want) for got, want in zip(layout.held_slices_of(shard, dist.group.WORLD), expected)]


def _rows_go_back(kind):
    layout = LAYOUTS[kind](dist.get_rank(), dist.get_world_size())
    shard = torch.zeros(layout.shard_numel)
    layout.shard_of_values(_values(3), shard)
    loaded = torch.zeros(layout.shard_numel)
    layout.load_held_slices(layout.held_slices_of(shard, dist.group.WORLD), loaded, dist.group.WORLD)
    return [torch.equal(got, want) for got, want in zip(layout.local_views(loaded), layout.local_views(shard))]


def _chunk(value, dim, rank, world):
    """This rank's slices along ``dim`` as DTensor's ``Shard(dim)`` holds them (``torch.chunk``'s,
    empty past the end)."""
    size = value.shape[dim]
    per_rank = -(-size // world) if size else 0
    start = min(rank * per_rank, size)
    return value.narrow(dim, start, min(start + per_rank, size) - start)


ALL = [True] * len(SHAPES)

PROPERTIES = {
    "full values go into the shard and come back through the gather": _full_values_round_trip,
    "the gather fills what flatten lays out": _gather_fills_flatten,
    "the reduction's input leaves each rank its part of the summed gradient": _reduction_leaves_each_rank_its_part_of_the_sum,
    "each parameter's slices come out of the shard as DTensor's Shard(dim) holds them": _rows_come_out,
    "rows loaded into an empty shard give the shard back": _rows_go_back,
}


@pytest.mark.parametrize("promise", sorted(PROPERTIES))
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_every_layout_keeps_the_contract(kind, promise):
    for matches in run_on_ranks(2, PROPERTIES[promise], kind):
        assert matches == ALL  # one True per parameter
