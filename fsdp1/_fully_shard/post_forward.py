"""``PostForwardRows``: the fully_shard front's ``RowsAfterForward``, what a unit keeps between its
forward and its backward under ``reshard_after_forward=k``."""

from typing import List, Optional

import torch
from torch import nn

from .._engine import collectives as comm
from .._engine.dtensors import MeshPlacements
from .._engine.layout import alloc_storage
from .._engine.transport import Transport
from .chunk_shard_layout import ChunkShardLayout


class PostForwardRows:
    """``reshard_after_forward=k``: between a forward and its backward each rank keeps its rows of
    the unit over a group of ``k`` ranks (``(Replicate(), Shard(0))`` on a ``(world / k, k)`` mesh,
    as torch's FSDP2), so that backward gathers over those ``k`` ranks only. ``full`` is the unit's
    own layout; the kept rows have a layout of their own over the ``k`` ranks."""

    def __init__(self, full: ChunkShardLayout, group: comm.ProcessGroup, sharding: MeshPlacements) -> None:
        self._full = full
        self.layout = ChunkShardLayout(full.shapes, comm.group_rank(group), comm.group_size(group))
        self._transport = Transport(self.layout, group)
        self.sharding = sharding
        self._kept: Optional[torch.Tensor] = None

    def keep(self, unsharded: torch.Tensor) -> List[nn.Parameter]:
        """Keep this rank's rows of the gathered parameters; the DTensors the module shows meanwhile."""
        kept = unsharded.new_zeros(self.layout.shard_numel)
        for index, param in enumerate(self._full.unflatten(unsharded.detach())):
            start, end = self.layout.held_slices(index)
            self.layout.local_view(kept, index).copy_(param[start:end])
        self._kept = kept
        return [self.sharding.parameter(local, shape, requires_grad=False)
                for local, shape in zip(self.layout.local_views(kept), self.layout.shapes)]

    def gather_into(self, unsharded: torch.Tensor, path: str) -> None:
        """Fill the unit's unsharded buffer from the ``k`` ranks' kept rows, and drop them."""
        kept, self._kept = self._kept, None
        assert kept is not None, "gathered from kept rows only while they are held"
        gathered = self.layout.new_unsharded(kept.dtype, kept.device)
        self._transport.all_gather(gathered, kept, path).wait()
        alloc_storage(unsharded)
        with torch.no_grad():
            for target, source in zip(self._full.unflatten(unsharded), self.layout.unflatten(gathered)):
                target.copy_(source)

    def drop(self) -> None:
        self._kept = None
