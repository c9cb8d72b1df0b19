"""FSDP1's layout of a unit's parameters: the flat concatenation split into equal runs, one a rank."""

from typing import FrozenSet, Iterator, List, Optional, Sequence, Tuple

import torch

from .._engine import collectives as comm
from .._engine.layout import ParamLayout, Run, alloc_storage, runs_between
from .._engine.shard_math import (
    ALIGNMENT_PADDING_VALUE,
    FlatLayout,
    ShardSpan,
    padded_unsharded_numel,
    param_shard_infos,
    plan_flat_layout,
    shard_span,
)
from .redistribute import RowRedistribution


class FlatShardLayout(ParamLayout):
    """FSDP1's layout: the parameters end to end (with ``aligned_numel``, each starting on a multiple
    of it and the total padded to a multiple of the group size, as torch's does for use_orig_params),
    zeros at the tail up to a multiple of the group size, rank ``r`` holding the ``r``-th equal run.

    Element for element torch FSDP1's, which keeps LOCAL checkpoints interchangeable with it. Unsharded
    (``is_sharded`` False) the one "shard" is the whole flat parameter and the local views have the
    parameters' own shapes.
    """

    def __init__(self, shapes: Sequence[torch.Size], aligned_numel: int, rank: int, world_size: int, is_sharded: bool) -> None:
        self.shapes = tuple(shapes)
        self.shard_dims = (0,) * len(self.shapes)
        self.rank, self.world_size, self.is_sharded = rank, world_size, is_sharded
        self.flat: FlatLayout = plan_flat_layout([shape.numel() for shape in self.shapes], aligned_numel, world_size)
        shard_world = world_size if is_sharded else 1
        self.unsharded_numel = padded_unsharded_numel(self.flat.numel, shard_world)
        self.shard_numel = self.unsharded_numel // shard_world
        self.span: ShardSpan = shard_span(self.flat.numel, rank if is_sharded else 0, shard_world)
        self.shard_infos = param_shard_infos(self.flat, self.span)
        self._plan_split()

    def new_unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        unsharded = torch.full((self.unsharded_numel,), ALIGNMENT_PADDING_VALUE, dtype=dtype, device=device)
        unsharded[self.flat.numel :].zero_()
        return unsharded

    def held_slices(self, index: int) -> Tuple[int, int]:
        rows = shard_span(self.shapes[index][0], *self._row_rank_and_world)
        return rows.start, rows.end

    def held_slices_of(self, shard_like: torch.Tensor, group: comm.ProcessGroup) -> List[torch.Tensor]:
        return self._row_redistribution(group).rows_of(shard_like)

    def load_held_slices(self, slices: Sequence[Optional[torch.Tensor]], shard_like: torch.Tensor, group: comm.ProcessGroup) -> None:
        for offset, piece in self._row_redistribution(group).pieces_for(slices, shard_like):
            shard_like[offset : offset + piece.numel()].copy_(piece)

    @property
    def _row_rank_and_world(self) -> Tuple[int, int]:
        """Where this rank's rows lie among the rows' holders: unsharded, it holds every row."""
        return (self.rank, self.world_size) if self.is_sharded else (0, 1)

    def _row_redistribution(self, group: comm.ProcessGroup) -> RowRedistribution:
        """The all-to-all between the flat shards and the rows."""
        return RowRedistribution(self.flat.offsets, self.shapes, self.flat.numel, *self._row_rank_and_world, group)

    gathers_in_place = True

    def sent_runs(self, rank: int, skipped: FrozenSet[int] = frozenset()) -> Tuple[Run, ...]:
        assert not skipped, "a flat shard's runs cross parameters: none is left out"
        params = set(self._piece_of_param)  # the other pieces are padding: alignment's fill, then zeros
        pieces = tuple(Run(size, index not in params) for index, size in enumerate(self._split_sizes))
        start = rank * self.shard_numel if self.is_sharded else 0
        return runs_between(pieces, start, start + self.shard_numel)

    def copy_out(self, unsharded: torch.Tensor, rows: Iterator[Tuple[int, torch.Tensor]],
                 skipped: FrozenSet[int] = frozenset()) -> None:
        assert not skipped, "a flat shard's runs cross parameters: none is left out"
        alloc_storage(unsharded)
        for rank, values in rows:
            unsharded[rank * self.shard_numel : (rank + 1) * self.shard_numel].copy_(values)

    def reduce_input(self, unsharded_grad: torch.Tensor, skipped: FrozenSet[int] = frozenset()) -> torch.Tensor:
        assert not skipped, "a flat shard's runs cross parameters: none is left out"
        return unsharded_grad  # the gathered order is the parameters' order

    def local_view(self, shard_like: torch.Tensor, index: int, start: int = 0) -> torch.Tensor:
        info = self.shard_infos[index]
        piece = shard_like[info.offset_in_shard - start : info.offset_in_shard - start + info.numel_in_shard]
        return piece if self.is_sharded else piece.view(self.shapes[index])

    @property
    def unpadded_numel(self) -> int:
        """Elements of the flat parameter before tail padding: what a LOCAL state dict describes."""
        return self.flat.numel

    @property
    def shard_padding_numel(self) -> int:
        return self.span.numel_padded
