"""FSDP2's layout of a unit's parameters: every parameter split along its shard dim, a chunk a rank.

The collectives see the ranks' chunks rank-major, while the unsharded buffer is parameter-major like
every layout's: ``all_gather`` and ``reduce_input`` permute between the two orders.
"""

from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from .._engine import collectives as comm
from .._engine.layout import GatherExtras, ParamLayout, alloc_storage
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
    ``all_gather`` copies that order out into the buffer once the collective is done, and
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

    def all_gather(self, unsharded: torch.Tensor, shard: torch.Tensor, group: comm.ProcessGroup, path: str,
                   extras: Optional[GatherExtras] = None, custom: Optional[comm.UserAllGather] = None) -> comm.Waitable:
        if extras is not None:
            return self._all_gather_packed(unsharded, shard, group, path, extras, custom)
        if self.world_size == 1:  # one rank: its shard is the buffer
            alloc_storage(unsharded)
            return comm.all_gather_into(unsharded, shard, group, path)
        if custom is not None:
            gathered, work = comm.user_all_gather(custom, shard, group, path)
            return _CopiedOut(work, self, unsharded, dict(enumerate(gathered.view(self.world_size, self.shard_numel).unbind())))
        if comm.is_gloo_pair(group):  # only the peer's shard travels; each is copied out once
            peer = shard.new_empty(self.shard_numel)
            return _CopiedOut(comm.receive_peer_shard(peer, shard, group, path), self, unsharded, {self.rank: shard, 1 - self.rank: peer})
        gathered = unsharded.new_empty(self.unsharded_numel).view(self.world_size, self.shard_numel)
        return _CopiedOut(comm.all_gather_into(gathered.view(-1), shard, group, path), self, unsharded,
                          dict(enumerate(gathered.unbind())))

    def _all_gather_packed(self, unsharded: torch.Tensor, shard: torch.Tensor, group: comm.ProcessGroup, path: str,
                           extras: GatherExtras, custom: Optional[comm.UserAllGather]) -> comm.Waitable:
        """One gather, in bytes, of this rank's chunks but the skipped ones and of the extra inputs,
        as torch's FSDP2 packs a group's all-gather inputs of several dtypes into one."""
        pieces = [piece for index, piece in enumerate(torch.split(shard, list(self.chunk_numels))) if index not in extras.skipped]
        sizes = [tensor.numel() * tensor.element_size() for tensor in (*pieces, *extras.inputs)]
        padding = -sum(sizes) % shard.element_size()  # every rank's row starts aligned for the chunks' dtype
        packed = torch.cat([tensor.contiguous().view(-1).view(torch.uint8) for tensor in (*pieces, *extras.inputs)]
                           + [shard.new_zeros(padding, dtype=torch.uint8)])
        work: comm.Waitable
        if custom is not None:
            gathered, work = comm.user_all_gather(custom, packed, group, path)
        else:
            gathered = packed.new_empty(packed.numel() * self.world_size)
            work = comm.all_gather_into(gathered, packed, group, path)
        return _PackedCopiedOut(work, self, unsharded, shard.dtype, gathered.view(self.world_size, -1), sizes + [padding], extras)

    def copy_out(self, shards: Dict[int, torch.Tensor], unsharded: torch.Tensor) -> None:
        """Each rank's shard into its chunks of the parameter-major ``unsharded``, allocated only now:
        a prefetched gather holds one unsharded buffer's worth until it is waited for, not two."""
        alloc_storage(unsharded)
        rank_major = self._rank_major(unsharded)
        for rank, shard in shards.items():
            if self._split_along_rows:
                torch.split_with_sizes_copy(shard, list(self.chunk_numels), out=[chunks[rank] for chunks in rank_major])
                continue
            for chunks, piece in zip(rank_major, torch.split(shard, list(self.chunk_numels))):
                chunks[rank].copy_(piece.view(chunks[rank].shape))

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


class _CopiedOut:
    """An all-gather of the ranks' shards (by rank), copied out into the parameter-major buffer on
    ``wait()``."""

    def __init__(self, work: comm.Waitable, layout: ChunkShardLayout, unsharded: torch.Tensor, shards: Dict[int, torch.Tensor]) -> None:
        self._work: Optional[comm.Waitable] = work
        self._layout, self._unsharded, self._shards = layout, unsharded, shards

    def wait(self) -> bool:
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
            self._layout.copy_out(self._shards, self._unsharded)
            self._shards = {}
        return True


class _PackedCopiedOut:
    """A packed all-gather (``ChunkShardLayout._all_gather_packed``), copied out on ``wait()``: each
    rank's chunks into the parameter-major buffer, each extra input's copies into its byte buffer;
    then the extras' ``finish``."""

    def __init__(self, work: comm.Waitable, layout: ChunkShardLayout, unsharded: torch.Tensor, dtype: torch.dtype,
                 rows: torch.Tensor, sizes: List[int], extras: GatherExtras) -> None:
        self._work: Optional[comm.Waitable] = work
        self._layout, self._unsharded, self._dtype = layout, unsharded, dtype
        self._rows, self._sizes, self._extras = rows, sizes, extras

    def wait(self) -> bool:
        if self._work is None:
            return True
        work, self._work = self._work, None
        work.wait()
        alloc_storage(self._unsharded)
        layout, extras = self._layout, self._extras
        sent = [chunks for index, chunks in enumerate(layout._rank_major(self._unsharded)) if index not in extras.skipped]
        outputs = [output.view(layout.world_size, -1) for output in extras.outputs]
        for rank, row in enumerate(self._rows.unbind()):
            segments = torch.split(row, self._sizes)
            for chunks, segment in zip(sent, segments):
                chunks[rank].copy_(segment.view(self._dtype).view(chunks[rank].shape))
            for output, segment in zip(outputs, segments[len(sent):]):
                output[rank].copy_(segment)
        self._rows = torch.empty(0, dtype=torch.uint8)
        extras.finish()
        return True
