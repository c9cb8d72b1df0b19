"""A unit's state-dict conversions: its parameters, and any tensor laid out as its local shard
(optimizer state), between the flat shard and the per-parameter forms FULL (full values), SHARDED
(DTensor rows, which the layout moves: ``ParamLayout.held_slices_of``) and LOCAL (the unpadded shard) describe.

``ShardConversions`` reads the layout and writes the shard of the handle that holds it; what it
needs of the handle is ``ShardHolder``: the shard itself, where the group computes, and the reshard
that drops a gathered copy after the shard changed.
"""

from typing import List, Optional, Protocol, Sequence

import torch

from .layout import ParamLayout
from .transport import Transport


class ShardHolder(Protocol):
    @property
    def local_shard(self) -> torch.Tensor: ...

    @property
    def compute_device(self) -> torch.device: ...

    def reshard(self) -> None: ...


class ShardConversions:
    """Conversions between one unit's shard (or a tensor laid out as it) and per-parameter forms."""

    def __init__(self, holder: ShardHolder, layout: ParamLayout, transport: Transport) -> None:
        self._holder = holder
        self._layout = layout
        self._transport = transport
        self._group = transport.group

    # ----------------------------------------------------------------------------- the parameters
    def load_full_params(self, values: Sequence[Optional[torch.Tensor]]) -> None:
        """Copy this rank's part of each full value (in flat order; None keeps the parameter) into
        the local shard; no communication. The shard changes in place, so optimizer references stay;
        a gathered copy is dropped, so the next use gathers the new values. The write bypasses the
        shard's autograd version counter (``.data``), which the flat parameter shares: views a forward
        saved for its backward stay valid across a ``summon_full_params`` between the two."""
        with torch.no_grad():
            self._layout.shard_of_values(values, self._holder.local_shard.data)
        self._holder.reshard()

    def dim0_chunks(self) -> List[torch.Tensor]:
        """Each parameter's rows that this rank holds when split along dim 0 over the group (DTensor's
        ``Shard(0)``), as new tensors, without unsharding the unit."""
        return self.held_slices_of(self._holder.local_shard)

    def load_dim0_chunks(self, chunks: Sequence[Optional[torch.Tensor]]) -> None:
        """The inverse of ``dim0_chunks``: each parameter's rows of this rank (None keeps the
        parameter, on every rank alike) go into the shard."""
        with torch.no_grad():
            self._layout.load_held_slices(chunks, self._holder.local_shard, self._group)
        self._holder.reshard()

    def local_flat_shard(self) -> torch.Tensor:
        """This rank's part of the unpadded flat parameter (a view of the shard; no copy)."""
        return self._holder.local_shard[: self._layout.shard_numel - self._layout.shard_padding_numel]

    def load_local_flat_shard(self, local: torch.Tensor) -> None:
        """Copy ``local`` (this rank's unpadded flat part, as ``local_flat_shard`` gave it) into the shard."""
        with torch.no_grad():
            self._holder.local_shard[: local.numel()].copy_(local.reshape(-1))
        self._holder.reshard()

    # ----------------------------------------------------------------------------- tensors laid out as the shard
    # Optimizer state of the flat parameter (or assembled from the original parameters' states) has
    # the local shard's layout; these convert such tensors without touching the parameters.
    def full_values_of(self, flat_shard: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's full value of a shard-laid-out tensor (collective: an all-gather)."""
        if not self._layout.is_sharded:
            return [view.clone() for view in self._layout.unflatten(flat_shard)]
        flat_shard = flat_shard.to(self._holder.compute_device)  # an offloaded shard is gathered where the group works
        full = flat_shard.new_empty(self._layout.unsharded_numel)
        self._transport.all_gather(full, flat_shard.contiguous(), "").wait()
        return self._layout.unflatten(full)

    def shard_of_full_values(self, values: Sequence[Optional[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        """The inverse of ``full_values_of`` without communication: this rank's slices of each full
        value (None: zeros) in a new shard-laid-out tensor."""
        shard = like.new_zeros(self._layout.shard_numel)
        self._layout.shard_of_values(values, shard)
        return shard

    def padded_full_of(self, values: Sequence[Optional[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        """The full values laid out as the padded unsharded flat parameter (None: zeros), in a new
        tensor: what a scatter hands each rank its shard of."""
        full = like.new_zeros(self._layout.unsharded_numel)
        for view, value in zip(self._layout.unflatten(full), values):
            if value is not None:
                view.copy_(value.detach().reshape(view.shape))
        return full

    def held_slices_of(self, flat_shard: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's dim-0 rows of this rank, of a shard-laid-out tensor."""
        return self._layout.held_slices_of(flat_shard, self._group)

    def shard_of_rows(self, rows: Sequence[Optional[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        """The inverse of ``held_slices_of``, in a new shard-laid-out tensor (None: zeros)."""
        shard = like.new_zeros(self._layout.shard_numel)
        self._layout.load_held_slices(rows, shard, self._group)
        return shard
