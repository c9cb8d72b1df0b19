"""FlatParameter and FlatParamHandle: one unit's parameters as one sharded 1-D tensor.

The handle is the only code that changes flat-parameter storage or the views the module sees. Its
invariants:

* ``_local_shard`` and the sharded ``flat_param`` share one storage, which the optimizer updates in
  place; the all-gather reads ``_local_shard`` so that ``flat_param``'s autograd version counter
  never moves.
* While unsharded, ``flat_param.data`` is the whole *padded* unsharded buffer, so autograd produces
  a gradient that is already in reduce-scatter layout (no copy before the collective).
* Resharding frees the unsharded buffer's storage in place (``resize_(0)``) and unsharding refills
  the same storage, so views saved by autograd in forward are valid again in backward.
"""

import dataclasses
import weakref
from dataclasses import dataclass
from enum import Enum, auto
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _collectives as comm
from ._shard_math import (
    ALIGNMENT_BYTES,
    ALIGNMENT_PADDING_VALUE,
    gradient_divide_factors,
    padded_unsharded_numel,
    param_shard_infos,
    plan_flat_layout,
    shard_span,
)

FLAT_PARAM = "_flat_param"


class _FlatParameterMeta(type(nn.Parameter)):
    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, torch.Tensor) and getattr(instance, "_is_flat_param", False)


class FlatParameter(nn.Parameter, metaclass=_FlatParameterMeta):
    """A unit's flattened parameters; ``FlatParameter(data)`` returns a plain ``nn.Parameter``.

    Being an exact ``nn.Parameter`` keeps optimizers on their fast foreach path (they choose it by
    exact type); ``isinstance(p, FlatParameter)`` still works through the marker below. These are the
    only attributes fsdp1 sets on a tensor, once, at construction.
    """

    _is_flat_param: bool
    _fqns: Tuple[str, ...]
    _shapes: Tuple[torch.Size, ...]
    _numels: Tuple[int, ...]
    _unpadded_unsharded_size: torch.Size
    _padded_unsharded_size: torch.Size
    _sharded_size: torch.Size
    _shard_numel_padded: int

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> nn.Parameter:  # type: ignore[misc]
        param = nn.Parameter(data, requires_grad=requires_grad)
        param._is_flat_param = True
        return param


@dataclass(frozen=True)
class ParamSlot:
    """One place a parameter is registered: ``module.<attr>``, reached as ``fqn`` from the unit.

    ``param`` is the original Parameter. Without use_orig_params the handle drops it once flattened
    (``param`` becomes None), so that its full-size storage is freed.
    """

    fqn: str
    module: nn.Module
    attr: str
    param: Optional[nn.Parameter]


class HandleState(Enum):
    """Where the flat parameter's data lives."""

    SHARDED = auto()
    UNSHARDING = auto()
    UNSHARDED = auto()


class HandleTrainingState(Enum):
    """What the unit is doing; named as torch's so that tools reading it keep working."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()
    SUMMON_FULL_PARAMS = auto()


@dataclass
class GradReduction:
    """A gradient reduce-scatter (or all-reduce) in flight for one handle."""

    handle: "FlatParamHandle"
    work: "comm.Work | comm.PairwiseExchange"
    unsharded_grad: torch.Tensor  # kept alive until the collective has read it
    reduced: torch.Tensor

    def finish(self) -> None:
        self.work.wait()
        self.handle._accumulate_reduced_grad(self.reduced)


class FlatParamHandle:
    """Flattens, shards, unshards and reshards one unit's parameters and reduces their gradient."""

    def __init__(
        self,
        slots: Sequence[ParamSlot],
        group: comm.ProcessGroup,
        is_sharded: bool,
        use_orig_params: bool,
    ) -> None:
        self.group = group
        self.rank = comm.group_rank(group)
        self.world_size = comm.group_size(group)
        self.is_sharded = is_sharded
        self.use_orig_params = use_orig_params
        self._slots, self._shared_slots = _split_shared(slots)
        self._managed_params = weakref.WeakSet(slot.param for slot in slots)
        self._pre_divide, self._post_divide = gradient_divide_factors(self.world_size)

        first = self._slots[0].param
        self._shapes = tuple(slot.param.shape for slot in self._slots)
        aligned_numel = ALIGNMENT_BYTES // first.element_size() if use_orig_params else 0
        self._layout = plan_flat_layout([s.param.numel() for s in self._slots], aligned_numel, self.world_size)
        shard_world = self.world_size if is_sharded else 1
        self._padded_numel = padded_unsharded_numel(self._layout.numel, shard_world)
        self._span = shard_span(self._layout.numel, self.rank if is_sharded else 0, shard_world)
        self._shard_infos = param_shard_infos(self._layout, self._span)
        self._split_sizes, self._piece_of_param = self._layout.split_sizes(self._padded_numel)

        unsharded = self._flatten()
        chunk = self._padded_numel // shard_world
        if is_sharded:
            self._local_shard = unsharded[self.rank * chunk : (self.rank + 1) * chunk].clone()
        else:
            self._local_shard = unsharded
        requires_grad = any(slot.param.requires_grad for slot in self._slots)
        self.flat_param = FlatParameter(self._local_shard, requires_grad=requires_grad)
        self._set_flat_param_metadata(chunk)
        self._unsharded_buffer = unsharded
        self._install_initial_views()
        self.state = HandleState.UNSHARDED
        if is_sharded:
            _free_storage(self._unsharded_buffer)
            self.state = HandleState.SHARDED
        self.training_state = HandleTrainingState.IDLE
        self._gather_work: "Optional[comm.Work | comm.PairwiseExchange]" = None
        self._reduced_grad: Optional[torch.Tensor] = None  # reduced gradient accumulated this step
        self._grad_is_unreduced = False  # flat_param.grad holds local sums (inside no_sync)
        self._orig_grad_views: List[Optional[torch.Tensor]] = []

    # ----------------------------------------------------------------------------- construction
    def _flatten(self) -> torch.Tensor:
        """Concatenate the parameters, alignment padding (torch's fill value) and zero tail padding."""
        first = self._slots[0].param
        pieces, cursor = [], 0
        with torch.no_grad():
            for slot, offset in zip(self._slots, self._layout.offsets):
                if offset > cursor:
                    pieces.append(first.new_full((offset - cursor,), ALIGNMENT_PADDING_VALUE))
                pieces.append(slot.param.detach().reshape(-1))
                cursor = offset + slot.param.numel()
            if self._layout.numel > cursor:
                pieces.append(first.new_full((self._layout.numel - cursor,), ALIGNMENT_PADDING_VALUE))
            if self._padded_numel > self._layout.numel:
                pieces.append(first.new_zeros(self._padded_numel - self._layout.numel))
            return torch.cat(pieces)

    def _set_flat_param_metadata(self, chunk: int) -> None:
        flat = self.flat_param
        flat._fqns = tuple(slot.fqn for slot in self._slots)
        flat._shapes = self._shapes
        flat._numels = self._layout.numels
        flat._unpadded_unsharded_size = torch.Size([self._layout.numel])
        flat._padded_unsharded_size = torch.Size([self._padded_numel])
        flat._sharded_size = torch.Size([chunk])
        flat._shard_numel_padded = self._span.numel_padded

    def _views_of_local_part(self, local: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's part of a shard-sized tensor: 1-D slices when sharded, full shapes if not."""
        views = []
        for info, shape in zip(self._shard_infos, self._shapes):
            piece = local[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
            views.append(piece if self.is_sharded else piece.view(shape))
        return views

    def _install_initial_views(self) -> None:
        """use_orig_params keeps the original Parameters, now viewing the shard; otherwise the
        Parameters leave the module and plain views of the unsharded buffer take their names."""
        if self.use_orig_params:
            with torch.no_grad():
                for slot, view in zip(self._slots, self._views_of_local_part(self._local_shard)):
                    slot.param.data = view
            return
        views = self._unflatten(self._unsharded_buffer.detach())
        for slot in self._all_slots():
            del slot.module._parameters[slot.attr]
        self._slots = tuple(dataclasses.replace(slot, param=None) for slot in self._slots)
        self._shared_slots = tuple((dataclasses.replace(slot, param=None), i) for slot, i in self._shared_slots)
        self._install(views, as_parameters=False)

    # ----------------------------------------------------------------------------- queries
    @property
    def fqns(self) -> Tuple[str, ...]:
        return self.flat_param._fqns

    def manages(self, param: nn.Parameter) -> bool:
        return param in self._managed_params

    # ----------------------------------------------------------------------------- unshard / reshard
    def unshard(self) -> None:
        """Start the all-gather of the full parameter (no-op if unsharded or already started)."""
        if self.state is not HandleState.SHARDED:
            return
        _alloc_storage(self._unsharded_buffer, self._padded_numel)
        self._gather_work = comm.all_gather_into(self._unsharded_buffer, self._local_shard, self.group)
        self.state = HandleState.UNSHARDING

    def wait_unshard(self) -> None:
        """Finish the all-gather and point the flat parameter at the unsharded buffer."""
        if self.state is HandleState.UNSHARDING:
            self._gather_work.wait()
            self._gather_work = None
            self.state = HandleState.UNSHARDED
        if self.is_sharded:
            self.flat_param.data = self._unsharded_buffer

    def use_unsharded_views(self) -> Optional[torch.autograd.graph.Node]:
        """Give the module views of the unsharded flat parameter, made under the caller's grad mode so
        that autograd routes every original parameter's gradient into the flat parameter.

        Returns the autograd node that will assemble the unsharded flat gradient from the views'
        gradients (None when no gradient will flow), so that the runtime can act just before that
        gradient is allocated.
        """
        pieces = torch.split(self.flat_param, self._split_sizes)
        self._install(self._param_views(pieces), as_parameters=self.use_orig_params)
        return pieces[0].grad_fn

    def reshard(self) -> None:
        """Point everything back at the local shard and free the unsharded storage (no-op when sharded:
        the end-of-backward catch-all calls it for every unit). A prefetched all-gather that nobody
        waited for is finished first, so the collective never writes into freed storage."""
        if self.state is HandleState.SHARDED:
            return
        if self.state is HandleState.UNSHARDING:
            self._gather_work.wait()
            self._gather_work = None
        if self.use_orig_params:
            for slot in self._all_slots():
                slot.module._parameters[slot.attr] = slot.param
        if not self.is_sharded:
            return
        self.flat_param.data = self._local_shard
        _free_storage(self._unsharded_buffer)
        self.state = HandleState.SHARDED

    def _unflatten(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return self._param_views(torch.split(flat, self._split_sizes))

    def _param_views(self, pieces: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Each parameter's piece of the split unsharded flat parameter, in its own shape."""
        return [pieces[i].view(shape) for i, shape in zip(self._piece_of_param, self._shapes)]

    def _install(self, views: List[torch.Tensor], as_parameters: bool) -> None:
        """Register ``views`` under the original names: in ``_parameters`` for use_orig_params (so the
        names stay visible), else as plain attributes. Frozen parameters get detached views, so autograd
        computes no gradient for them."""
        for slot, view in zip(self._slots, views):
            if as_parameters:
                slot.module._parameters[slot.attr] = view if slot.param.requires_grad else view.detach()
            else:
                slot.module.__dict__[slot.attr] = view
        for slot, primary in self._shared_slots:
            target = slot.module._parameters if as_parameters else slot.module.__dict__
            target[slot.attr] = getattr(self._slots[primary].module, self._slots[primary].attr)

    def _all_slots(self) -> List[ParamSlot]:
        return list(self._slots) + [slot for slot, _ in self._shared_slots]

    # ----------------------------------------------------------------------------- gradients
    def prepare_gradient_for_backward(self) -> None:
        """Move last step's reduced gradient aside so this step's reduction accumulates onto it.

        A gradient left unreduced by ``no_sync`` stays on ``flat_param.grad``, where autograd adds
        this step's local gradient to it.
        """
        if self._grad_is_unreduced:
            return
        if self.use_orig_params:
            self._write_back_orig_grads()
        self._reduced_grad = self.flat_param.grad
        self.flat_param.grad = None

    def _write_back_orig_grads(self) -> None:
        """Carry what the user did to the original parameters' ``.grad`` into the flat gradient:
        ``None`` (``zero_grad``) zeroes that part, a replaced tensor is copied in."""
        flat_grad = self.flat_param.grad
        if flat_grad is None or not self._orig_grad_views:
            return
        any_grad = False
        with torch.no_grad():
            for slot, view in zip(self._slots, self._orig_grad_views):
                if view is None:
                    continue
                grad = slot.param.grad
                if grad is None:
                    view.zero_()
                    continue
                any_grad = True
                if grad is not view:
                    view.copy_(grad)
        self._orig_grad_views = []
        if not any_grad:
            self.flat_param.grad = None

    def reduce_grad(self) -> GradReduction:
        """Start reducing this step's unsharded gradient: mean over the ranks, this rank's shard kept."""
        grad = self.flat_param.grad
        self.flat_param.grad = None
        self._grad_is_unreduced = False
        if grad.numel() != self._padded_numel:
            raise RuntimeError(
                f"fsdp1 internal error: unit with {self.fqns[:3]}... got a gradient of {grad.numel()} "
                f"elements, expected {self._padded_numel}"
            )
        if self._pre_divide > 1:
            grad.div_(self._pre_divide)
        if self.is_sharded:
            reduced = grad.new_empty(self._local_shard.shape)
            work = comm.reduce_scatter_into(reduced, grad, self.group)
        else:
            reduced = grad
            work = comm.all_reduce(grad, self.group)
        return GradReduction(self, work, grad, reduced)

    def _accumulate_reduced_grad(self, reduced: torch.Tensor) -> None:
        if self._post_divide > 1:
            reduced.div_(self._post_divide)
        if self._reduced_grad is None:
            self._reduced_grad = reduced
        else:
            self._reduced_grad += reduced

    def keep_grad_unreduced(self) -> None:
        """Inside ``no_sync``: leave the local gradient sum on ``flat_param.grad`` for later steps."""
        self._grad_is_unreduced = True

    def prepare_gradient_for_optim(self) -> None:
        """Hand the reduced gradient to the optimizer: as the flat parameter's ``.grad``, and with
        use_orig_params as views on the original parameters (``None`` for frozen ones and for those
        with no element in this rank's shard, as torch's)."""
        if self._grad_is_unreduced:
            return
        self.flat_param.grad = self._reduced_grad
        self._reduced_grad = None
        if not self.use_orig_params:
            return
        grad = self.flat_param.grad
        if grad is None:
            self._orig_grad_views = []
            for slot in self._slots:
                slot.param.grad = None
            return
        self._orig_grad_views = [
            view if slot.param.requires_grad and info.in_shard else None
            for slot, info, view in zip(self._slots, self._shard_infos, self._views_of_local_part(grad))
        ]
        for slot, view in zip(self._slots, self._orig_grad_views):
            slot.param.grad = view


def _split_shared(slots: Sequence[ParamSlot]) -> Tuple[Tuple[ParamSlot, ...], Tuple[Tuple[ParamSlot, int], ...]]:
    """First occurrence of each parameter, and every later occurrence with its first's index."""
    first_index: dict = {}
    unique, shared = [], []
    for slot in slots:
        if slot.param in first_index:
            shared.append((slot, first_index[slot.param]))
        else:
            first_index[slot.param] = len(unique)
            unique.append(slot)
    return tuple(unique), tuple(shared)


def _alloc_storage(tensor: torch.Tensor, numel: int) -> None:
    storage = tensor.untyped_storage()
    nbytes = numel * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)
