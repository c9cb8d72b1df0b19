"""FSDP2's layout of a unit's parameters: every parameter split along its shard dim, a chunk a rank.

The collectives see the ranks' chunks rank-major, while the unsharded buffer is parameter-major like
every layout's: ``copy_out`` and ``reduce_input`` permute between the two orders.
"""

from typing import FrozenSet, Iterator, List, Optional, Sequence, Tuple

import torch

from .._engine import collectives as comm
from .._engine.layout import ParamLayout, Run, alloc_storage
from .._engine.shard_math import FlatLayout, ParamShardInfo, shard_span


class ChunkShardLayout(ParamLayout):
    """FSDP2's layout: every parameter split along its shard dim as ``torch.chunk`` splits it
    (DTensor's ``Shard(dim)``; dim 0 unless ``shard_dims`` says otherwise), and this rank's shard the
    concatenation of its chunks, in flat order. A dim-0 chunk is padded to ``ceil(rows /
    world_size)`` rows; a chunk along another dim is never padded (the front refuses uneven ones, as
    torch's). That is the all-gather's input as torch's FSDP2 lays it out, so every rank's shard and
    gradient are element for element torch's.

    The unsharded buffer is parameter-major: parameter ``i`` at ``flat.offsets[i]``, followed by the
    padding rows of its last chunks, so the buffer splits into the same views as FSDP1's. The
    collectives order the ranks' shards rank-major (``[rank 0: p0 chunk, p1 chunk, ... | rank 1: ...]``);
    ``copy_out`` copies that order out into the buffer once the collective is done, and
    ``reduce_input`` copies the gradient into it. One copy each way, as torch's FSDP2 pays; its
    copy into the all-gather's input is saved, since the shard already is that input.
    """

    def __init__(self, shapes: Sequence[torch.Size], rank: int, world_size: int,
                 shard_dims: Optional[Sequence[int]] = None) -> None:
        self.shapes = tuple(shapes)
        self.shard_dims = tuple(shard_dims) if shard_dims is not None else (0,) * len(self.shapes)
        self.rank, self.world_size, self.is_sharded = rank, world_size, True
        self.chunk_numels: Tuple[int, ...] = ()  # each parameter's padded chunk: a rank's part of the shard
        infos, offsets, shard_offset = [], [], 0
        self._held: List[Tuple[int, int]] = []  # the slices [start, end) along its dim this rank holds
        for shape, dim in zip(self.shapes, self.shard_dims):
            slices = shape[dim]
            slice_numel = shape.numel() // slices if slices else 0
            held = shard_span(slices, rank, world_size)
            first_element = held.start * shape[dim + 1 :].numel()
            infos.append(ParamShardInfo(shard_offset, held.numel * slice_numel, first_element))
            offsets.append(world_size * shard_offset)  # every rank's chunks before it come first
            self._held.append((held.start, held.end))
            self.chunk_numels += ((held.numel + held.numel_padded) * slice_numel,)
            shard_offset += self.chunk_numels[-1]
        self.shard_infos = tuple(infos)
        self.shard_numel = shard_offset
        self.unsharded_numel = shard_offset * world_size
        self.flat = FlatLayout(tuple(offsets), tuple(shape.numel() for shape in self.shapes), self.unsharded_numel)
        self._split_along_rows = all(dim == 0 for dim in self.shard_dims)
        self.gathers_in_place = world_size == 1  # one rank: its shard is the buffer
        self._plan_split()

    def new_unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.unsharded_numel, dtype=dtype, device=device)

    def _rank_major(self, unsharded: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's padded chunks in ``unsharded`` as views whose index ``r`` on their first
        dim is rank ``r``'s chunk: ``(world_size, chunk numel)`` for a split along dim 0, ``(world_size,
        *chunk shape)`` (strided) for one along another dim."""
        views = []
        for offset, chunk, shape, dim in zip(self.flat.offsets, self.chunk_numels, self.shapes, self.shard_dims):
            region = unsharded[offset : offset + self.world_size * chunk]
            if dim == 0:
                views.append(region.view(self.world_size, chunk))
            else:
                split = (*shape[:dim], self.world_size, shape[dim] // self.world_size, *shape[dim + 1 :])
                views.append(region.view(split).movedim(dim, 0))
        return views

    def shard_of(self, unsharded: torch.Tensor) -> torch.Tensor:
        return torch.cat([chunks[self.rank].reshape(-1) for chunks in self._rank_major(unsharded)])

    def shard_of_values(self, values: Sequence[Optional[torch.Tensor]], shard: torch.Tensor) -> None:
        for index, value in enumerate(values):
            if value is not None:
                self.local_view(shard, index).copy_(self.held_part(index, value))

    def sent_pieces(self, shard: torch.Tensor, skipped: FrozenSet[int] = frozenset()) -> List[torch.Tensor]:
        if not skipped:
            return [shard]
        return [piece for index, piece in enumerate(torch.split(shard, list(self.chunk_numels))) if index not in skipped]

    def sent_runs(self, rank: int, skipped: FrozenSet[int] = frozenset()) -> Tuple[Run, ...]:
        return tuple(Run(numel) for index, numel in enumerate(self.chunk_numels) if index not in skipped)  # the same on every rank

    def copy_out(self, unsharded: torch.Tensor, rows: Iterator[Tuple[int, torch.Tensor]],
                 skipped: FrozenSet[int] = frozenset()) -> None:
        alloc_storage(unsharded)
        sent = [(numel, chunks) for index, (numel, chunks) in enumerate(zip(self.chunk_numels, self._rank_major(unsharded)))
                if index not in skipped]
        sizes = [numel for numel, _ in sent]
        for rank, values in rows:
            targets = [chunks[rank] for _, chunks in sent]
            if self._split_along_rows:
                torch.split_with_sizes_copy(values, sizes, out=targets)
                continue
            for target, piece in zip(targets, torch.split(values, sizes)):
                target.copy_(piece.view(target.shape))

    reduces_by_parameter = True

    def reduce_input(self, unsharded_grad: torch.Tensor, skipped: FrozenSet[int] = frozenset()) -> torch.Tensor:
        if self.world_size == 1:
            return unsharded_grad
        return torch.cat([chunks.reshape(self.world_size, -1) for index, chunks in enumerate(self._rank_major(unsharded_grad))
                          if index not in skipped], dim=1).view(-1)

    def shard_of_reduced(self, reduced: torch.Tensor, skipped: FrozenSet[int]) -> torch.Tensor:
        if not skipped:
            return reduced
        shard = reduced.new_zeros(self.shard_numel)
        sent = [piece for index, piece in enumerate(torch.split(shard, list(self.chunk_numels))) if index not in skipped]
        for piece, part in zip(sent, torch.split(reduced, [piece.numel() for piece in sent])):
            piece.copy_(part)
        return shard

    def held_slices(self, index: int) -> Tuple[int, int]:
        return self._held[index]

    def held_slices_of(self, shard_like: torch.Tensor, group: comm.ProcessGroup) -> List[torch.Tensor]:
        return [view.clone() for view in self.local_views(shard_like)]

    def load_held_slices(self, slices: Sequence[Optional[torch.Tensor]], shard_like: torch.Tensor, group: comm.ProcessGroup) -> None:
        for view, held in zip(self.local_views(shard_like), slices):
            if held is not None:
                view.copy_(held.reshape(view.shape))

    def local_view(self, shard_like: torch.Tensor, index: int, start: int = 0) -> torch.Tensor:
        info, shape, dim = self.shard_infos[index], self.shapes[index], self.shard_dims[index]
        piece = shard_like[info.offset_in_shard - start : info.offset_in_shard - start + info.numel_in_shard]
        first, end = self._held[index]
        return piece.view(*shape[:dim], end - first, *shape[dim + 1 :])

