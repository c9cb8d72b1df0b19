"""Tests the layout contract: every kind of ``ParamLayout`` (FSDP1's flat shard, aligned or not,
sharded or not; ``fully_shard``'s chunks along dim 0 or others) keeps the same promises on 2 real ranks, for parameters
of odd sizes, a zero-size dimension and a single row. Full values go into the shard and come back
through the gather; the gather fills each parameter's full value; the reduction's input, reduce-
scattered, leaves each rank its part of the summed gradient; and each parameter's dim-0 rows of
this rank (DTensor's ``Shard(0)``, or ``Shard(dim)`` where ``fully_shard`` splits another dim) come
out of the shard and go back into it. The same layouts go through every way the unit's transport
moves values: a user's all-gather (bitwise the default's), a block-quantized gather (each rank's
shard exactly as the codec gives it back) and a block-quantized reduction (each rank's own piece
plus the others' pieces as the codec gives them back)."""

import pytest
import torch
import torch.distributed as dist

from fsdp1._engine import collectives as comm
from fsdp1._engine.layout import runs_between
from fsdp1._engine.quantization import BlockCodec
from fsdp1._engine.transport import Transport
from fsdp1._fully_shard.chunk_shard_layout import ChunkShardLayout
from fsdp1._wrapper.flat_shard_layout import FlatShardLayout
from fsdp1.api import BlockQuantization

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
    Transport(layout, dist.group.WORLD).all_gather(unsharded, shard, "").wait()
    return unsharded


class _UserAllGather:
    """A user's all-gather (``set_custom_all_gather``'s contract) that allocates its own output."""

    def allocate(self, size, *, dtype, device):
        return torch.full(size, float("nan"), dtype=dtype, device=device) if dtype.is_floating_point else torch.empty(size, dtype=dtype)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


QUANTIZED = BlockQuantization(weights=torch.int8, gradients=torch.int8, block_size=4)
CODEC = BlockCodec(torch.int8, 4)


def _round_trip(values, runs):
    """``values`` (1-D, laid out as ``runs``) as the codec gives them back."""
    plan = CODEC.plan(runs, values.device)
    encoded = torch.empty(CODEC.encoded_nbytes(values.numel(), plan), dtype=torch.uint8)
    CODEC.encode_into(values, encoded, plan)
    decoded = torch.empty_like(values)
    CODEC.decode_into(encoded, decoded, plan)
    return decoded


def _through_a_user_all_gather(kind):
    layout = LAYOUTS[kind](dist.get_rank(), dist.get_world_size())
    values = _values(4)
    shard = torch.zeros(layout.shard_numel)
    layout.shard_of_values(values, shard)
    transport = Transport(layout, dist.group.WORLD)
    transport.set_custom("", all_gather=_UserAllGather())
    unsharded = layout.new_unsharded(torch.float32, torch.device("cpu"))
    if layout.is_sharded:
        transport.all_gather(unsharded, shard, "").wait()
    else:  # nothing travels
        unsharded = shard
    return [torch.equal(got, want) for got, want in zip(layout.unflatten(unsharded), layout.unflatten(_unsharded_of(layout, values)))]


def _quantized_gather_decodes_every_shard(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    layouts = [LAYOUTS[kind](r, world) for r in range(world)]
    values = _values(5)
    shards = []
    for each in layouts:
        shards.append(torch.zeros(each.shard_numel))
        each.shard_of_values(values, shards[-1])
    layout = layouts[rank]
    unsharded = layout.new_unsharded(torch.float32, torch.device("cpu"))
    if layout.is_sharded:
        Transport(layout, dist.group.WORLD, quantization=QUANTIZED).all_gather(unsharded, shards[rank], "", quantized=True).wait()
        expected = layout.new_unsharded(torch.float32, torch.device("cpu"))
        layout.copy_out(expected, iter([(r, _round_trip(shard, layout.sent_runs(r))) for r, shard in enumerate(shards)]))
    else:  # nothing travels
        unsharded, expected = shards[rank], shards[rank]
    return [torch.equal(got, want) for got, want in zip(layout.unflatten(unsharded), layout.unflatten(expected))]


def _quantized_reduction_sums_the_decoded_pieces(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = LAYOUTS[kind](rank, world)
    grads = [layout.reduce_input(layout.flatten(_values(20 + r))) for r in range(world)]  # every rank's, known everywhere
    transport = Transport(layout, dist.group.WORLD, quantization=QUANTIZED)
    if layout.is_sharded:
        work, _, reduced, _ = transport.reduce_scatter(grads[rank].clone(), "")
        work.wait()
        pieces = [grad.view(world, -1)[rank] for grad in grads]
        expected = pieces[rank].clone()
        for r in range(world):
            if r != rank:
                expected += _round_trip(pieces[r], layout.sent_runs(rank))
    else:  # an all-reduce: a quantized reduce-scatter of equal chunks, then the sums' quantized all-gather
        reduced = grads[rank].clone()
        transport.all_reduce(reduced, "").wait()
        chunk = -(-reduced.numel() // world)
        padded = [torch.nn.functional.pad(grad, (0, world * chunk - grad.numel())).view(world, chunk) for grad in grads]
        runs = [runs_between(layout.sent_runs(rank), owner * chunk, (owner + 1) * chunk) for owner in range(world)]
        sums = []
        for owner in range(world):
            total = padded[owner][owner].clone()
            for r in range(world):
                if r != owner:
                    total += _round_trip(padded[r][owner], runs[owner])
            sums.append(_round_trip(total, runs[owner]))
        expected = torch.cat(sums)[: reduced.numel()]
    return [torch.equal(got, want) for got, want in zip(layout.local_views(reduced), layout.local_views(expected))]


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


def _runs_hold_each_parameter_apart(kind):
    """Every parameter's part of the shard lies within one run of what the rank sends, a run of its
    own that holds no fill value; the runs cover the shard end to end."""
    layout = LAYOUTS[kind](dist.get_rank(), dist.get_world_size())
    runs = layout.sent_runs(layout.rank)
    ends = torch.tensor([run.numel for run in runs]).cumsum(0).tolist()
    holders = []
    for info in layout.shard_infos:
        if not info.in_shard:
            holders.append(None)
            continue
        index = next(i for i, end in enumerate(ends) if end > info.offset_in_shard)
        start = ends[index] - runs[index].numel
        holders.append(index if start <= info.offset_in_shard and info.offset_in_shard + info.numel_in_shard <= ends[index]
                       and not runs[index].fill else "crossed")
    held = [index for index in holders if index is not None]
    return [ends[-1] == layout.shard_numel and holder != "crossed" and held.count(holder) <= 1 for holder in holders]


ALL = [True] * len(SHAPES)

PROPERTIES = {
    "full values go into the shard and come back through the gather": _full_values_round_trip,
    "the gather fills what flatten lays out": _gather_fills_flatten,
    "the reduction's input leaves each rank its part of the summed gradient": _reduction_leaves_each_rank_its_part_of_the_sum,
    "each parameter's slices come out of the shard as DTensor's Shard(dim) holds them": _rows_come_out,
    "rows loaded into an empty shard give the shard back": _rows_go_back,
    "a user's all-gather fills what the default one fills": _through_a_user_all_gather,
    "each parameter's part of the shard is a run of its own": _runs_hold_each_parameter_apart,
    "a quantized gather fills each rank's shard as the codec gives it back": _quantized_gather_decodes_every_shard,
    "a quantized reduction sums each rank's own piece and the others' decoded ones": _quantized_reduction_sums_the_decoded_pieces,
}


@pytest.mark.parametrize("promise", sorted(PROPERTIES))
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_every_layout_keeps_the_contract(kind, promise):
    for matches in run_on_ranks(2, PROPERTIES[promise], kind):
        assert matches == ALL  # one True per parameter
