"""The handle's conversions for state dicts: its parameters, and any tensor laid out as its local
shard (optimizer state), between the flat shard and the per-parameter forms FULL (full values),
SHARDED (DTensor rows, through ``RowRedistribution``) and LOCAL (the unpadded shard) describe.

``ShardConversions`` is a part of ``FlatParamHandle`` (its base class), kept apart so that the
handle's file stays about its lifecycle; what it changes is still the handle's own local shard.
"""

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _collectives as comm
from ._redistribute import RowRedistribution
from ._shard_math import FlatLayout, ParamShardInfo, ShardSpan, shard_span


class ShardConversions:
    """The state-dict conversions of ``FlatParamHandle``, over the handle's fields declared here and
    its methods ``_all_slots``, ``_unflatten`` and ``reshard``."""

    is_sharded: bool
    rank: int
    world_size: int
    group: comm.ProcessGroup
    use_orig_params: bool
    _slots: Tuple[Any, ...]  # ParamSlot, first registrations in flat order
    _shared_slots: Tuple[Tuple[Any, int], ...]  # later registrations of tied parameters, with their index
    _alias_fqns: Tuple[Tuple[str, int], ...]  # other names of a module registered under several
    _shapes: Tuple[torch.Size, ...]
    _layout: FlatLayout
    _shard_infos: Tuple[ParamShardInfo, ...]
    _local_shard: torch.Tensor
    compute_device: torch.device
    _padded_numel: int
    _span: ShardSpan  # the unpadded flat elements this rank's shard holds

    @property
    def shapes(self) -> Tuple[torch.Size, ...]:
        """The shape of each parameter, in flat order (first registrations only)."""
        return self._shapes

    @property
    def unpadded_numel(self) -> int:
        """Elements of the flat parameter before tail padding: what a LOCAL state dict describes."""
        return self._layout.numel

    def slot_fqns(self) -> List[Tuple[str, int]]:
        """Every registration's name (relative to the unit) with the index of its parameter in flat
        order: first registrations in order, then the later ones of tied parameters, then the other
        names of a module registered under several."""
        return ([(slot.fqn, i) for i, slot in enumerate(self._slots)] + [(slot.fqn, i) for slot, i in self._shared_slots]
                + list(self._alias_fqns))

    @contextlib.contextmanager
    def names_registered(self, placeholder: torch.Tensor) -> Iterator[None]:
        """use_orig_params=False: ``placeholder`` under every original name in the modules'
        ``_parameters`` for the duration, so that a state-dict save lists their keys where the plain
        model would (the module otherwise holds only the flat parameter)."""
        for slot in self._all_slots():
            slot.module._parameters[slot.attr] = placeholder
        try:
            yield
        finally:
            for slot in self._all_slots():
                slot.module._parameters.pop(slot.attr, None)

    def load_full_params(self, values: Sequence[Optional[torch.Tensor]]) -> None:
        """Copy this rank's part of each full value (in flat order; None keeps the parameter) into
        the local shard; no communication. The shard changes in place, so optimizer references stay;
        a gathered copy is dropped, so the next use gathers the new values. The write bypasses the
        shard's autograd version counter (``.data``), which the flat parameter shares: views a forward
        saved for its backward stay valid across a ``summon_full_params`` between the two."""
        shard = self._local_shard.data
        with torch.no_grad():
            for info, value in zip(self._shard_infos, values):
                if value is not None and info.in_shard:
                    shard[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard].copy_(piece_in_shard(info, value))
        self.reshard()

    def dim0_chunks(self) -> List[torch.Tensor]:
        """Each parameter's rows that this rank holds when split along dim 0 over the group (DTensor's
        ``Shard(0)``), as new tensors, without unsharding the unit (``RowRedistribution``)."""
        return self._row_redistribution().rows_of(self._local_shard)

    def load_dim0_chunks(self, chunks: Sequence[Optional[torch.Tensor]]) -> None:
        """The inverse of ``dim0_chunks``: each parameter's rows of this rank (None keeps the
        parameter, on every rank alike) go into the flat shards that cover them."""
        pieces = self._row_redistribution().pieces_for(chunks, self._local_shard)
        with torch.no_grad():
            for offset, piece in pieces:
                self._local_shard[offset : offset + piece.numel()].copy_(piece)
        self.reshard()

    # ----------------------------------------------------------------------------- tensors laid out as the shard
    # Optimizer state of the flat parameter (or assembled from the original parameters' states) has
    # the local shard's layout; these convert such tensors without touching the parameters.
    @property
    def shard_infos(self) -> Tuple[ParamShardInfo, ...]:
        """Which slice of each parameter (flat order) lies in this rank's shard, and where."""
        return self._shard_infos

    @property
    def shard_numel(self) -> int:
        return self._local_shard.numel()

    def orig_params(self) -> List[nn.Parameter]:
        """use_orig_params: the original parameters, in flat order (first registrations)."""
        return [slot.param for slot in self._slots]

    def full_values_of(self, flat_shard: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's full value of a shard-laid-out tensor (collective: an all-gather)."""
        if not self.is_sharded:
            return [view.clone() for view in self._unflatten(flat_shard)]
        flat_shard = flat_shard.to(self.compute_device)  # an offloaded shard is gathered where the group works
        full = flat_shard.new_empty(self._padded_numel)
        comm.all_gather_into(full, flat_shard.contiguous(), self.group).wait()
        return self._unflatten(full)

    def shard_of_full_values(self, values: Sequence[Optional[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        """The inverse of ``full_values_of`` without communication: this rank's slices of each full
        value (None: zeros) in a new shard-laid-out tensor."""
        shard = like.new_zeros(self._local_shard.shape)
        for info, value in zip(self._shard_infos, values):
            if value is not None and info.in_shard:
                shard[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard] = piece_in_shard(info, value)
        return shard

    def padded_full_of(self, values: Sequence[Optional[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        """The full values laid out as the padded unsharded flat parameter (None: zeros), in a new
        tensor: what a scatter hands each rank its shard of."""
        full = like.new_zeros(self._padded_numel)
        for view, value in zip(self._unflatten(full), values):
            if value is not None:
                view.copy_(value.detach().reshape(view.shape))
        return full

    def rows_of(self, flat_shard: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's dim-0 rows of this rank, of a shard-laid-out tensor (one all-to-all)."""
        return self._row_redistribution().rows_of(flat_shard)

    def shard_of_rows(self, rows: Sequence[Optional[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        """The inverse of ``rows_of``, in a new shard-laid-out tensor (None: zeros)."""
        shard = like.new_zeros(self._local_shard.shape)
        for offset, piece in self._row_redistribution().pieces_for(rows, shard):
            shard[offset : offset + piece.numel()] = piece
        return shard

    def local_flat_shard(self) -> torch.Tensor:
        """This rank's part of the unpadded flat parameter (a view of the shard; no copy)."""
        return self._local_shard[: self._span.numel]

    def rows_held(self, index: int) -> ShardSpan:
        """The rows of parameter ``index`` this rank holds in the row layout (``dim0_chunks``)."""
        rank, world_size = self._rank_in_row_layout()
        return shard_span(self._shapes[index][0], rank, world_size)

    def load_local_flat_shard(self, local: torch.Tensor) -> None:
        """Copy ``local`` (this rank's unpadded flat part, as ``local_flat_shard`` gave it) into the shard."""
        with torch.no_grad():
            self._local_shard[: local.numel()].copy_(local.reshape(-1))
        self.reshard()

    def _rank_in_row_layout(self) -> Tuple[int, int]:
        """(rank, world size) the rows are split over: the group, or this rank alone when unsharded."""
        return (self.rank, self.world_size) if self.is_sharded else (0, 1)

    def _row_redistribution(self) -> RowRedistribution:
        return RowRedistribution(self._layout.offsets, self._shapes, self._layout.numel, *self._rank_in_row_layout(), self.group)


def piece_in_shard(info: ParamShardInfo, full_value: torch.Tensor) -> torch.Tensor:
    """The part of a parameter's full value (any shape) that lies in this rank's shard, flat."""
    return full_value.detach().reshape(-1)[info.intra_param_start : info.intra_param_start + info.numel_in_shard]
