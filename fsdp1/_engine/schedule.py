"""``UnitSchedule``: when a unit reshards and which units it prefetches, the one object a unit's
runtime asks. Each front resolves its own arguments into it when it builds the unit: FSDP1 from the
sharding strategy and the prefetch arguments, ``fully_shard`` from ``reshard_after_forward`` and
``FSDPModule``'s setters, which change it afterwards through its methods."""

from typing import Generic, List, Optional, Sequence

from ..api import BackwardPrefetch
from .root_state import ExecutionOrder, U


class UnitSchedule(Generic[U]):
    """A unit's resharding and prefetching, as its front resolved them."""

    def __init__(self, reshard_after_forward: Optional[bool], keeps_gathered_without_sync: bool = False,
                 backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
                 forward_prefetch: bool = False) -> None:
        self.reshard_after_forward = reshard_after_forward
        """None: every unit but the root (FSDP1's FULL_SHARD, FSDP2's default). After a forward without
        grad every unit reshards whatever this says: no backward will come, and a unit kept gathered
        would show its unsharded parameters to an optimizer or ``clip_grad_norm_`` built on
        ``parameters()`` then (torch's FSDP2 keeps the root gathered, and trains it silently wrong so)."""
        self.reshard_after_backward = True
        """False: the unit stays gathered after every backward (FSDP2's ``set_reshard_after_backward``)."""
        self.keeps_gathered_without_sync = keeps_gathered_without_sync
        """A backward that does not synchronise gradients (``no_sync``) keeps the unit gathered for the
        next micro-batch (FSDP1's SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2)."""
        self.backward_prefetch = backward_prefetch
        """When backward starts the next unit's all-gather in the recorded order: at this unit's
        pre-backward (BACKWARD_PRE), after its reduction (BACKWARD_POST), or never (None)."""
        self.forward_prefetch = forward_prefetch
        """Whether forward starts the next unit's all-gather in the first iteration's order."""
        self._forward_prefetch_units: Optional[List[U]] = None
        self._backward_prefetch_units: Optional[List[U]] = None

    def prefetch_in_forward(self, units: Sequence[U]) -> None:
        """Start these units' all-gathers right after this unit's, in place of the recorded order."""
        self._forward_prefetch_units = list(units)

    def prefetch_in_backward(self, units: Sequence[U]) -> None:
        """Start these units' all-gathers at this unit's backward, in place of the recorded order."""
        self._backward_prefetch_units = list(units)

    def reshards_after_forward(self, is_root: bool) -> bool:
        return not is_root if self.reshard_after_forward is None else self.reshard_after_forward

    def reshards_after_backward(self, sync_gradients: bool) -> bool:
        return self.reshard_after_backward and (sync_gradients or not self.keeps_gathered_without_sync)

    def forward_prefetches(self, unit: U, order: ExecutionOrder[U]) -> List[U]:
        """The units whose all-gathers start once ``unit``'s forward gathered its own."""
        if self._forward_prefetch_units is not None:
            return self._forward_prefetch_units
        return _present([order.next_in_forward(unit)] if self.forward_prefetch else [])

    def backward_prefetches_before(self, unit: U, order: ExecutionOrder[U]) -> List[U]:
        """The units whose all-gathers start at ``unit``'s pre-backward."""
        if self._backward_prefetch_units is not None:
            return self._backward_prefetch_units
        return _present([order.next_in_backward(unit)] if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE else [])

    def backward_prefetches_after(self, unit: U, order: ExecutionOrder[U]) -> List[U]:
        """The units whose all-gathers start once ``unit``'s gradient reduction started."""
        if self._backward_prefetch_units is not None or self.backward_prefetch is not BackwardPrefetch.BACKWARD_POST:
            return []
        return _present([order.next_in_backward(unit)])


def _present(units: List[Optional[U]]) -> List[U]:
    return [unit for unit in units if unit is not None]
