"""Pure arithmetic of the flat layout: where each original parameter lies in a FlatParameter and in
each rank's shard.

No tensors and no process groups here, only integers, so the handle, the state dicts and the
optimizer-state code share one definition that the pure tests check over many sizes. The layout
matches torch's FSDP1 element for element (alignment padding only with ``use_orig_params=True``,
``torch.chunk`` sharding), which keeps LOCAL checkpoints interchangeable.
"""

from dataclasses import dataclass
from typing import Sequence, Tuple

ALIGNMENT_BYTES = 16
"""With use_orig_params=True every original parameter starts on a 16-byte boundary (as torch's)."""

ALIGNMENT_PADDING_VALUE = 42.0
"""Fill value of alignment padding, the same as torch's, so flat shards compare bitwise."""


def chunk_numel(numel: int, world_size: int) -> int:
    """Elements per rank: the size of the first chunk of ``torch.chunk(numel, world_size)``."""
    return -(-numel // world_size)


def rounded_up(numel: int, multiple: int) -> int:
    """``numel`` rounded up to a multiple of ``multiple``."""
    return -(-numel // multiple) * multiple


def padded_unsharded_numel(numel: int, world_size: int) -> int:
    """Flat numel right-padded so that it splits evenly over the ranks."""
    return rounded_up(numel, world_size)


@dataclass(frozen=True)
class FlatLayout:
    """Where the original parameters lie in the unpadded flat parameter.

    Attributes:
        offsets: start element of each original parameter.
        numels: elements of each original parameter.
        numel: unpadded flat numel, alignment padding included.
    """

    offsets: Tuple[int, ...]
    numels: Tuple[int, ...]
    numel: int

    def split_sizes(self, padded_numel: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """Sizes for ``torch.split`` over the padded flat tensor, and the piece index of each parameter."""
        sizes, piece_of_param, cursor = [], [], 0
        for offset, numel in zip(self.offsets, self.numels):
            if offset > cursor:
                sizes.append(offset - cursor)
            piece_of_param.append(len(sizes))
            sizes.append(numel)
            cursor = offset + numel
        if padded_numel > cursor:
            sizes.append(padded_numel - cursor)
        return tuple(sizes), tuple(piece_of_param)


def plan_flat_layout(numels: Sequence[int], aligned_numel: int, world_size: int) -> FlatLayout:
    """Lay parameters end to end; with ``aligned_numel > 0`` pad each start to a multiple of it and
    pad the total to a multiple of ``world_size`` (torch does both only for use_orig_params=True)."""
    offsets, total = [], 0
    for numel in numels:
        if aligned_numel > 0:
            total += -total % aligned_numel
        offsets.append(total)
        total += numel
    if aligned_numel > 0:
        total += -total % world_size
    return FlatLayout(tuple(offsets), tuple(numels), total)


@dataclass(frozen=True)
class ShardSpan:
    """The unpadded elements ``[start, end)`` of the flat parameter that one rank holds.

    The rank's shard has ``chunk_numel`` elements: these, then zeros (``numel_padded``).
    """

    start: int
    end: int
    numel_padded: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def shard_span(numel: int, rank: int, world_size: int) -> ShardSpan:
    """Rank ``rank``'s part of a flat parameter of ``numel`` elements, as ``torch.chunk`` splits it."""
    chunk = chunk_numel(numel, world_size)
    start = min(rank * chunk, numel)
    end = min(start + chunk, numel)
    return ShardSpan(start, end, chunk - (end - start))


@dataclass(frozen=True)
class ParamShardInfo:
    """Which slice of one original parameter lies in this rank's shard.

    Attributes:
        offset_in_shard: where the slice starts in the local shard.
        numel_in_shard: its length (0 when the parameter lies wholly on other ranks).
        intra_param_start: the slice's first element in the flattened original parameter.
    """

    offset_in_shard: int
    numel_in_shard: int
    intra_param_start: int

    @property
    def in_shard(self) -> bool:
        return self.numel_in_shard > 0


def param_shard_infos(layout: FlatLayout, span: ShardSpan) -> Tuple[ParamShardInfo, ...]:
    """The slice of every original parameter that falls inside ``span``."""
    infos = []
    for offset, numel in zip(layout.offsets, layout.numels):
        start = max(offset, span.start)
        end = min(offset + numel, span.end)
        if end <= start:
            infos.append(ParamShardInfo(0, 0, 0))
        else:
            infos.append(ParamShardInfo(start - span.start, end - start, start - offset))
    return tuple(infos)


def gradient_divide_factors(world_size: int) -> Tuple[float, float]:
    """Pre- and post-reduction divisors whose product is ``world_size`` (mean over ranks).

    Dividing by about sqrt(world_size) on each side keeps low-precision sums from overflowing or
    underflowing; the split (a power of two before, the rest after) is torch FSDP1's, so gradients
    match it bitwise.
    """
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


def dim0_chunk_range(offset: int, shape: Sequence[int], rank: int, world_size: int) -> Tuple[int, int]:
    """The flat elements ``[start, end)`` of a parameter laid out at ``offset`` that rank ``rank``
    holds when the parameter is split along dim 0 as DTensor's ``Shard(0)`` (and ``torch.chunk``)
    split it: ``ceil(rows / world_size)`` rows a rank, the last ranks with fewer or none."""
    row_numel = 1
    for dim in shape[1:]:
        row_numel *= dim
    rows = shard_span(shape[0], rank, world_size)  # rows split as a flat parameter's elements are
    return offset + rows.start * row_numel, offset + rows.end * row_numel


def overlap(a: Tuple[int, int], b: Tuple[int, int]) -> Tuple[int, int]:
    """The intersection of two half-open ranges; empty ranges come back as ``(start, start)``."""
    start = max(a[0], b[0])
    return start, max(start, min(a[1], b[1]))
