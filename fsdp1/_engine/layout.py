"""Where a unit's parameters lie: in the unsharded buffer a gather fills, and in each rank's shard.

A layout answers the four questions the handle's collectives, its views and the state dicts ask, and
nothing else:

* what an all-gather of the ranks' shards fills: the unsharded buffer, of which every parameter is
  a view in its own shape (``unflatten``), and how the gather is issued (``all_gather``);
* what a gradient reduction reads: the unsharded gradient, in the order the collective splits it
  over the ranks (``reduce_input``);
* where each original parameter's part of this rank's shard lives (``shard_infos``,
  ``local_views``), which the original parameters at rest, their gradients and the state dicts use;
* which slices of each parameter this rank holds in DTensor's ``Shard(dim)`` (``shard_dims``: dim 0
  but where ``fully_shard`` was told otherwise) and how they move out of the shard and back
  (``held_rows``, ``rows_of``, ``load_rows``), which SHARDED state dicts use; and how full values
  go into a shard (``shard_of_values``).

Both layouts keep the unsharded buffer parameter-major (``flat``: every parameter contiguous, in flat
order, so that one split gives a forward all of them); they differ in what a rank holds.
``FlatShardLayout`` is FSDP1's: the parameters end to end, the concatenation split into equal runs,
so that a rank's run may hold part of one parameter or parts of several, and the gathered order is
the parameters' order. ``RowShardLayout`` is FSDP2's ``Shard(0)``: every parameter split along its
rows, a rank holding a padded row chunk of each; the collectives then see the ranks' chunks
rank-major, and ``all_gather`` / ``reduce_input`` permute between that order and the buffer's.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from . import collectives as comm
from .redistribute import RowRedistribution
from .shard_math import (
    ALIGNMENT_PADDING_VALUE,
    FlatLayout,
    ParamShardInfo,
    ShardSpan,
    padded_unsharded_numel,
    param_shard_infos,
    plan_flat_layout,
    shard_span,
)


@dataclass(frozen=True)
class GatherExtras:
    """What a unit's gather carries besides its shard, in the same collective: the parameters whose
    place in the shard is not sent (their values are gathered apart, by an all-gather extension),
    the tensors each rank sends instead (of equal sizes on every rank), the byte buffers their
    gathered copies land in (rank after rank; the same buffers every gather), and what runs once
    they have."""

    skipped: FrozenSet[int]
    inputs: Sequence[torch.Tensor]
    outputs: Sequence[torch.Tensor]
    finish: Callable[[], None]


class ParamLayout(ABC):
    """The placement of one unit's parameters (in flat order) over its shard group.

    ``unsharded_numel`` is the size of the buffer a gather fills and of the gradient a reduction
    reads (padding included); ``shard_numel`` the size of each rank's shard, and of every tensor
    laid out as it (the sharded gradient, optimizer state).
    """

    shapes: Tuple[torch.Size, ...]
    shard_dims: Tuple[int, ...]  # the dim each parameter is split along in DTensor's terms
    flat: FlatLayout  # where each parameter lies in the unsharded buffer
    shard_infos: Tuple[ParamShardInfo, ...]
    unsharded_numel: int
    shard_numel: int
    rank: int
    world_size: int
    is_sharded: bool

    @abstractmethod
    def new_unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An unsharded buffer whose padding holds its fill values; the parameters' views are uninitialised."""

    def _plan_split(self) -> None:
        self._split_sizes, self._piece_of_param = self.flat.split_sizes(self.unsharded_numel)

    def split(self, unsharded: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``unsharded`` split into pieces (one autograd node for all of them, so that a forward's
        views route every parameter's gradient into one unsharded gradient)."""
        return torch.split(unsharded, list(self._split_sizes))

    def param_views(self, pieces: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Each parameter, in its own shape, as a view of the pieces ``split`` made."""
        return [pieces[i].view(shape) for i, shape in zip(self._piece_of_param, self.shapes)]

    def params_given(self, piece_grads: Sequence[Optional[torch.Tensor]]) -> List[bool]:
        """Which parameters got a gradient, from the gradients of ``split``'s pieces (autograd passes
        None for a piece nothing used)."""
        return [piece_grads[i] is not None for i in self._piece_of_param]

    @property
    def unpadded_numel(self) -> int:
        """Elements of the unsharded buffer before its tail padding."""
        return self.unsharded_numel

    @property
    def shard_padding_numel(self) -> int:
        """Elements of this rank's shard that belong to no parameter."""
        return self.shard_numel - sum(info.numel_in_shard for info in self.shard_infos)

    def unflatten(self, unsharded: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter, in its own shape, as a view of an unsharded buffer (or of its gradient)."""
        return self.param_views(self.split(unsharded))

    @abstractmethod
    def all_gather(self, unsharded: torch.Tensor, shard: torch.Tensor, group: comm.ProcessGroup, path: str,
                   extras: Optional[GatherExtras] = None) -> comm.Waitable:
        """Start filling ``unsharded`` from every rank's ``shard`` (and, with ``extras``, gathering
        those in the same collective); the parameters' views of it are valid once the returned work
        is waited for. ``unsharded``'s storage may be freed: the layout allocates it when it first
        writes there."""

    @abstractmethod
    def reduce_input(self, unsharded_grad: torch.Tensor, skipped: FrozenSet[int] = frozenset()) -> torch.Tensor:
        """The unsharded gradient in the order a reduce-scatter hands each rank its shard's part,
        without the parameters in ``skipped`` (frozen ones: only where ``reduces_by_parameter``)."""

    reduces_by_parameter = False
    """Whether a parameter's part of the reduction can be left out, a frozen one sending nothing,
    as under torch's FSDP2 (each rank's part of every parameter is a run of its shard)."""

    def shard_of_reduced(self, reduced: torch.Tensor, skipped: FrozenSet[int]) -> torch.Tensor:
        """The reduced shard, from a reduction that left ``skipped`` out: zeros in their place."""
        assert not skipped, "only a layout that reduces by parameter leaves any out"
        return reduced

    @abstractmethod
    def local_view(self, shard_like: torch.Tensor, index: int, start: int = 0) -> torch.Tensor:
        """Parameter ``index``'s part of a tensor laid out as this rank's shard from element ``start``
        on (empty when the parameter has no element there)."""

    def local_views(self, shard_like: torch.Tensor) -> List[torch.Tensor]:
        """Every parameter's part of a tensor laid out as this rank's shard."""
        return [self.local_view(shard_like, index) for index in range(len(self.shapes))]

    def shard_of_values(self, values: Sequence[Optional[torch.Tensor]], shard: torch.Tensor) -> None:
        """Write this rank's part of each full value (None: left as it is) into ``shard`` (laid out as
        the shard), where each part is one contiguous run of the flattened value."""
        for info, value in zip(self.shard_infos, values):
            if value is not None and info.in_shard:
                shard[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard] = piece_in_shard(info, value)

    @abstractmethod
    def held_rows(self, index: int) -> Tuple[int, int]:
        """The slices ``[start, end)`` along its shard dim (``shard_dims``) of parameter ``index``
        this rank holds in DTensor's ``Shard(dim)`` over the group (all of them when the layout is
        not sharded)."""

    def held_part(self, index: int, full_value: torch.Tensor) -> torch.Tensor:
        """This rank's slices (``held_rows``) of parameter ``index``'s full value, as a view."""
        start, end = self.held_rows(index)
        return full_value.detach().reshape(self.shapes[index]).narrow(self.shard_dims[index], start, end - start)

    @abstractmethod
    def rows_of(self, shard_like: torch.Tensor, group: comm.ProcessGroup) -> List[torch.Tensor]:
        """Each parameter's slices this rank holds in DTensor's ``Shard(dim)`` over the group, of a
        tensor laid out as its shard, as new tensors (collective where the layout is not in rows)."""

    @abstractmethod
    def load_rows(self, rows: Sequence[Optional[torch.Tensor]], shard_like: torch.Tensor, group: comm.ProcessGroup) -> None:
        """The inverse of ``rows_of``, written into ``shard_like`` in place; None leaves a parameter
        as it is (on every rank alike)."""

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A new unsharded buffer holding ``tensors`` (the parameters' values, in flat order)."""
        first = tensors[0]
        unsharded = self.new_unsharded(first.dtype, first.device)
        with torch.no_grad():
            for view, tensor in zip(self.unflatten(unsharded), tensors):
                view.copy_(tensor.detach().reshape(view.shape))
        return unsharded

    def shard_of(self, unsharded: torch.Tensor) -> torch.Tensor:
        """This rank's shard of an unsharded buffer (a view where the layout allows one)."""
        start = self.rank * self.shard_numel if self.is_sharded else 0
        return unsharded[start : start + self.shard_numel]

    def trainable_span(self, requires_grad: Sequence[bool]) -> Tuple[int, int]:
        """The smallest run of the shard that holds every element of a parameter that needs a gradient."""
        bounds = [
            (info.offset_in_shard, info.offset_in_shard + info.numel_in_shard)
            for info, needs_grad in zip(self.shard_infos, requires_grad)
            if needs_grad and info.in_shard
        ]
        if not bounds:
            return 0, 0
        return min(lo for lo, _ in bounds), max(hi for _, hi in bounds)


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

    def held_rows(self, index: int) -> Tuple[int, int]:
        rows = shard_span(self.shapes[index][0], *self._row_rank_and_world)
        return rows.start, rows.end

    def rows_of(self, shard_like: torch.Tensor, group: comm.ProcessGroup) -> List[torch.Tensor]:
        return self._row_redistribution(group).rows_of(shard_like)

    def load_rows(self, rows: Sequence[Optional[torch.Tensor]], shard_like: torch.Tensor, group: comm.ProcessGroup) -> None:
        for offset, piece in self._row_redistribution(group).pieces_for(rows, shard_like):
            shard_like[offset : offset + piece.numel()].copy_(piece)

    @property
    def _row_rank_and_world(self) -> Tuple[int, int]:
        """Where this rank's rows lie among the rows' holders: unsharded, it holds every row."""
        return (self.rank, self.world_size) if self.is_sharded else (0, 1)

    def _row_redistribution(self, group: comm.ProcessGroup) -> RowRedistribution:
        """The all-to-all between the flat shards and the rows."""
        return RowRedistribution(self.flat.offsets, self.shapes, self.flat.numel, *self._row_rank_and_world, group)

    def all_gather(self, unsharded: torch.Tensor, shard: torch.Tensor, group: comm.ProcessGroup, path: str,
                   extras: Optional[GatherExtras] = None) -> comm.Waitable:
        assert extras is None, "all-gather extensions are fully_shard's, on the rows layout"
        alloc_storage(unsharded)
        return comm.all_gather_into(unsharded, shard, group, path)

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


class RowShardLayout(ParamLayout):
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
        self.user_all_gather: Optional[comm.UserAllGather] = None  # set_custom_all_gather's, which allocates and gathers
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
                   extras: Optional[GatherExtras] = None) -> comm.Waitable:
        if extras is not None:
            return self._all_gather_packed(unsharded, shard, group, path, extras)
        if self.world_size == 1:  # one rank: its shard is the buffer
            alloc_storage(unsharded)
            return comm.all_gather_into(unsharded, shard, group, path)
        if self.user_all_gather is not None:
            gathered, work = comm.user_all_gather(self.user_all_gather, shard, group, path)
            return _CopiedOut(work, self, unsharded, dict(enumerate(gathered.view(self.world_size, self.shard_numel).unbind())))
        if comm.is_gloo_pair(group):  # only the peer's shard travels; each is copied out once
            peer = shard.new_empty(self.shard_numel)
            return _CopiedOut(comm.receive_peer_shard(peer, shard, group, path), self, unsharded, {self.rank: shard, 1 - self.rank: peer})
        gathered = unsharded.new_empty(self.unsharded_numel).view(self.world_size, self.shard_numel)
        return _CopiedOut(comm.all_gather_into(gathered.view(-1), shard, group, path), self, unsharded,
                          dict(enumerate(gathered.unbind())))

    def _all_gather_packed(self, unsharded: torch.Tensor, shard: torch.Tensor, group: comm.ProcessGroup, path: str,
                           extras: GatherExtras) -> comm.Waitable:
        """One gather, in bytes, of this rank's chunks but the skipped ones and of the extra inputs,
        as torch's FSDP2 packs a group's all-gather inputs of several dtypes into one."""
        pieces = [piece for index, piece in enumerate(torch.split(shard, list(self.chunk_numels))) if index not in extras.skipped]
        sizes = [tensor.numel() * tensor.element_size() for tensor in (*pieces, *extras.inputs)]
        padding = -sum(sizes) % shard.element_size()  # every rank's row starts aligned for the chunks' dtype
        packed = torch.cat([tensor.contiguous().view(-1).view(torch.uint8) for tensor in (*pieces, *extras.inputs)]
                           + [shard.new_zeros(padding, dtype=torch.uint8)])
        work: comm.Waitable
        if self.user_all_gather is not None:
            gathered, work = comm.user_all_gather(self.user_all_gather, packed, group, path)
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

    def held_rows(self, index: int) -> Tuple[int, int]:
        return self._held[index]

    def rows_of(self, shard_like: torch.Tensor, group: comm.ProcessGroup) -> List[torch.Tensor]:
        return [view.clone() for view in self.local_views(shard_like)]

    def load_rows(self, rows: Sequence[Optional[torch.Tensor]], shard_like: torch.Tensor, group: comm.ProcessGroup) -> None:
        for view, row in zip(self.local_views(shard_like), rows):
            if row is not None:
                view.copy_(row.reshape(view.shape))

    def local_view(self, shard_like: torch.Tensor, index: int, start: int = 0) -> torch.Tensor:
        info, shape, dim = self.shard_infos[index], self.shapes[index], self.shard_dims[index]
        piece = shard_like[info.offset_in_shard - start : info.offset_in_shard - start + info.numel_in_shard]
        first, end = self._held[index]
        return piece.view(*shape[:dim], end - first, *shape[dim + 1 :])


class _CopiedOut:
    """An all-gather of the ranks' shards (by rank), copied out into the parameter-major buffer on
    ``wait()``."""

    def __init__(self, work: comm.Waitable, layout: RowShardLayout, unsharded: torch.Tensor, shards: Dict[int, torch.Tensor]) -> None:
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
    """A packed all-gather (``RowShardLayout._all_gather_packed``), copied out on ``wait()``: each
    rank's chunks into the parameter-major buffer, each extra input's copies into its byte buffer;
    then the extras' ``finish``."""

    def __init__(self, work: comm.Waitable, layout: RowShardLayout, unsharded: torch.Tensor, dtype: torch.dtype,
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


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give ``tensor`` (whose storage a reshard freed) its storage back, in place, so that views
    autograd saved of it see what is written next."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def free_storage(tensor: torch.Tensor) -> None:
    """Free ``tensor``'s storage in place; its views stay, to be refilled by ``alloc_storage``."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def piece_in_shard(info: ParamShardInfo, full_value: torch.Tensor) -> torch.Tensor:
    """The part of a parameter's full value (any shape) that lies in this rank's shard, flat, where
    that part is one contiguous run of the flattened value (FSDP1's layout, and rows along dim 0)."""
    return full_value.detach().reshape(-1)[info.intra_param_start : info.intra_param_start + info.numel_in_shard]
