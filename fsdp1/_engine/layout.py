"""Where a unit's parameters lie: in the unsharded buffer a gather fills, and in each rank's shard.

A layout answers four questions that the handle's collectives, its views and the state dicts ask
(its other members are sizes and helpers built on the answers):

* what an all-gather of the ranks' shards fills: the unsharded buffer, of which every parameter is
  a view in its own shape (``unflatten``), which runs of a shard travel (``sent_pieces``; each
  parameter's part of them, where a codec's blocks end: ``sent_runs``) and where each rank's land
  (``gathers_in_place``, ``copy_out``); the collectives themselves are the unit's
  transport's (``transport.py``), which knows nothing of where values sit;
* what a gradient reduction reads: the unsharded gradient, in the order the collective splits it
  over the ranks (``reduce_input``);
* where each original parameter's part of this rank's shard lives (``shard_infos``,
  ``local_views``), which the original parameters at rest, their gradients and the state dicts use;
* which slices of each parameter this rank holds in DTensor's ``Shard(dim)`` (``shard_dims``: dim 0
  but where ``fully_shard`` was told otherwise) and how they move out of the shard and back
  (``held_slices``, ``held_slices_of``, ``load_held_slices``), which SHARDED state dicts use; and how full values
  go into a shard (``shard_of_values``).

Every layout keeps the unsharded buffer parameter-major (``flat``: every parameter contiguous, in
flat order, so that one split gives a forward all of them); the kinds differ in what a rank holds.
The engine runs any layout through this interface and builds none: each front builds its own kind,
in a file of its own (``_wrapper/flat_shard_layout.py``: FSDP1's runs of the flat concatenation;
``_fully_shard/chunk_shard_layout.py``: FSDP2's chunks of every parameter).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, FrozenSet, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import collectives as comm
from .shard_math import FlatLayout, ParamShardInfo


class Run(NamedTuple):
    """A stretch of what a rank sends: one parameter's part of its shard, or padding; ``fill`` where
    it is padding that a codec is to send as zeros (FSDP1's, whose alignment padding holds a fill
    value other than zero)."""

    numel: int
    fill: bool = False


def runs_between(runs: Sequence[Run], start: int, end: int) -> Tuple[Run, ...]:
    """The parts of ``runs`` (end to end) in ``[start, end)``; past their end, zeros (an all-reduce's
    padding up to equal chunks) as a run of their own."""
    cut, cursor = [], 0
    for run in runs:
        numel = min(cursor + run.numel, end) - max(cursor, start)
        if numel > 0:
            cut.append(Run(numel, run.fill))
        cursor += run.numel
    return (*cut, Run(end - max(cursor, start))) if end > cursor else tuple(cut)


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

    A subclass's ``__init__`` sets every field below and ends with ``_plan_split()``. Its answers
    keep these invariants: sharded, ``unsharded_numel == world_size * shard_numel`` (the reduction's
    output is one shard); ``reduce_input`` orders the gradient rank-major, rank ``r``'s part being
    what lands in its shard; ``shard_infos[i]`` gives where parameter ``i``'s elements lie in the
    shard and, as ``intra_param_start``, which element of the flattened parameter comes first;
    ``local_view`` returns the shape the original parameter shows at rest (flat where the shard
    holds a run of elements, the held slices' shape where it holds whole slices). The defaults
    (``shard_of``, ``shard_of_values``) assume one contiguous run per parameter; a layout that cuts
    otherwise overrides them. Leaving parameters out of a gather or a reduction (``skipped``) is
    ``fully_shard``'s; ``is_sharded`` False (NO_SHARD) and ``unpadded_numel`` are FSDP1's.
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
        """Elements of this rank's shard that belong to no parameter; where the padding is all at the
        shard's end (FSDP1's layout), what a LOCAL state dict cuts off (torch's ``_shard_numel_padded``)."""
        return self.shard_numel - sum(info.numel_in_shard for info in self.shard_infos)

    def unflatten(self, unsharded: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter, in its own shape, as a view of an unsharded buffer (or of its gradient)."""
        return self.param_views(self.split(unsharded))

    gathers_in_place = False
    """Whether the ranks' shards, rank after rank, are the unsharded buffer itself (FSDP1's flat
    shard), so that a gather fills it with no copy; otherwise ``copy_out`` places them."""

    def sent_pieces(self, shard: torch.Tensor, skipped: FrozenSet[int] = frozenset()) -> List[torch.Tensor]:
        """The runs of ``shard`` a gather sends, in order, without the parameters in ``skipped``
        (gathered apart by an all-gather extension: only where ``reduces_by_parameter``)."""
        assert not skipped, "only a layout that reduces by parameter leaves any out"
        return [shard]

    @abstractmethod
    def sent_runs(self, rank: int, skipped: FrozenSet[int] = frozenset()) -> Tuple[Run, ...]:
        """What ``sent_pieces`` of rank ``rank``'s shard sends, end to end, as runs: each parameter's
        part and each run of padding. A gradient's piece for that rank in ``reduce_input`` (without the
        same ``skipped``) is laid out alike. A codec's blocks never mix two runs."""

    @abstractmethod
    def copy_out(self, unsharded: torch.Tensor, rows: Iterator[Tuple[int, torch.Tensor]],
                 skipped: FrozenSet[int] = frozenset()) -> None:
        """Each ``(rank, values)`` of ``rows`` into ``unsharded`` (allocated only now: a prefetched
        gather holds one unsharded buffer's worth until it is waited for, not two), ``values`` being
        what ``sent_pieces`` of that rank's shard sent, end to end."""

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
    def held_slices(self, index: int) -> Tuple[int, int]:
        """The slices ``[start, end)`` along its shard dim (``shard_dims``) of parameter ``index``
        this rank holds in DTensor's ``Shard(dim)`` over the group (all of them when the layout is
        not sharded)."""

    def held_part(self, index: int, full_value: torch.Tensor) -> torch.Tensor:
        """This rank's slices (``held_slices``) of parameter ``index``'s full value, as a view."""
        start, end = self.held_slices(index)
        return full_value.detach().reshape(self.shapes[index]).narrow(self.shard_dims[index], start, end - start)

    @abstractmethod
    def held_slices_of(self, shard_like: torch.Tensor, group: comm.ProcessGroup) -> List[torch.Tensor]:
        """Each parameter's slices this rank holds in DTensor's ``Shard(dim)`` over the group, of a
        tensor laid out as its shard, as new tensors (collective where the shard does not hold them whole)."""

    @abstractmethod
    def load_held_slices(self, slices: Sequence[Optional[torch.Tensor]], shard_like: torch.Tensor, group: comm.ProcessGroup) -> None:
        """The inverse of ``held_slices_of``, written into ``shard_like`` in place; None leaves a parameter
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
