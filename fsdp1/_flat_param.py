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
* Outside a unit's own forward the module sees no view of freed storage: with use_orig_params the
  original ``nn.Parameter`` objects (viewing this rank's shard), otherwise placeholders that raise a
  clear error on use, or views while the storage is alive.
* Parameters are compared by identity only: ``==`` between tensors is elementwise, so no tensor is
  ever a member of a set of weak references or a key compared by value (tied weights broke so).
"""

import contextlib
import dataclasses
import os
import weakref
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _collectives as comm
from ._device import wait_for_device
from ._placeholder import ShardedParamPlaceholder
from ._shard_conversions import ShardConversions
from ._shard_math import (
    ALIGNMENT_BYTES,
    ALIGNMENT_PADDING_VALUE,
    ParamShardInfo,
    gradient_divide_factors,
    padded_unsharded_numel,
    param_shard_infos,
    plan_flat_layout,
    shard_span,
)
from ._traversal import ParamSlot

if TYPE_CHECKING:
    from ._mixed_precision import HandlePrecision

FLAT_PARAM = "_flat_param"
UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"  # torch's switch: views bypass a module's own __setattr__
FLATTENED = "_fsdp_flattened"
"""Marks an original parameter that a unit has flattened (torch's name), so that wrapping the same
module object twice is refused instead of flattening shard views a second time."""


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
        setattr(param, FLATTENED, True)  # torch's marker of a flattened parameter, which Lightning reads
        return param


class HandleState(Enum):
    """Where the flat parameter's data lives."""

    SHARDED = auto()
    UNSHARDING = auto()
    UNSHARDED = auto()


@dataclass(frozen=True)
class CommHook:
    """A hook ``register_comm_hook`` installed: ``hook(state, grad, output)`` for a sharded unit,
    ``hook(state, grad)`` otherwise. ``casts_itself``: a low-precision hook, which reduces in its own
    dtype and casts back, so the unit does neither."""

    hook: Callable[..., object]
    state: object
    casts_itself: bool

    def reduce(self, grad: torch.Tensor, output: Optional[torch.Tensor]) -> Optional[object]:
        """Start (or do) the reduction; what is still in flight if the hook returned it, else None."""
        result = self.hook(self.state, grad) if output is None else self.hook(self.state, grad, output)
        return result if callable(getattr(result, "wait", None)) else None


@dataclass
class GradReduction:
    """A gradient reduce-scatter (or all-reduce) in flight for one handle."""

    handle: "FlatParamHandle"
    work: "Optional[comm.GuardedWork | comm.PairwiseExchange]"  # None: a comm hook finished it already
    unsharded_grad: torch.Tensor  # kept alive until the collective has read it
    reduced: torch.Tensor

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        replicate_group = self.handle.replicate_group
        if replicate_group is not None:
            comm.all_reduce(self.reduced, replicate_group, self.handle.path).wait()
        self.handle._accumulate_reduced_grad(self.reduced)


class FlatParamHandle(ShardConversions):
    """Flattens, shards, unshards and reshards one unit's parameters and reduces their gradient.

    ``owner`` is the module whose ``_parameters`` holds the FlatParameter (use_orig_params=False), so
    that ``module.parameters()`` and the optimizer see it. ``group`` is the group the unit shards
    over; ``replicate_group`` (hybrid strategies) holds the ranks with the same shard, over which the
    reduced gradient is then all-reduced.

    ``precision`` says which dtype the unit gathers and computes in, reduces its gradient in and
    hands the optimizer; only the gathered copy and the gradient in flight are in low precision.
    With ``offload_params`` the shard and its gradient live on the CPU, where the optimizer steps
    them, and each gather copies the shard to the compute device first (a no-op when that is the CPU).

    ``materialize_in_place`` is given for a unit whose parameters are still on the meta device: the
    handle gives them storage inside the unsharded flat buffer on ``device`` and calls it with the
    new parameters' slots to fill them there (``reset_parameters``, then ``sync_module_states``), so
    that construction never holds the unit's parameters twice.
    """

    def __init__(
        self,
        slots: Sequence[ParamSlot],
        owner: nn.Module,
        group: comm.ProcessGroup,
        replicate_group: Optional[comm.ProcessGroup],
        is_sharded: bool,
        use_orig_params: bool,
        precision: "HandlePrecision",
        offload_params: bool = False,
        materialize_in_place: Optional[Callable[[Sequence[ParamSlot]], None]] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        self.group = group
        self.replicate_group = replicate_group
        self.rank = comm.group_rank(group)
        self.world_size = comm.group_size(group)
        self.is_sharded = is_sharded
        self.use_orig_params = use_orig_params
        self.precision = precision
        self._owner = owner
        if use_orig_params:  # frozen parameters last, so that the trainable ones' gradient is contiguous
            slots = sorted(slots, key=lambda slot: not slot.param.requires_grad)
        self._slots, self._shared_slots, self._alias_fqns = _split_shared(slots)
        self._requires_grad = tuple(slot.param.requires_grad for slot in self._slots)
        replicas = comm.group_size(replicate_group) if replicate_group is not None else 1
        self._pre_divide, self._post_divide = gradient_divide_factors(self.world_size * replicas)

        self._shapes = tuple(slot.param.shape for slot in self._slots)
        aligned_numel = ALIGNMENT_BYTES // precision.param_dtype.itemsize if use_orig_params else 0
        self._layout = plan_flat_layout([s.param.numel() for s in self._slots], aligned_numel, self.world_size)
        shard_world = self.world_size if is_sharded else 1
        self._padded_numel = padded_unsharded_numel(self._layout.numel, shard_world)
        self._span = shard_span(self._layout.numel, self.rank if is_sharded else 0, shard_world)
        self._shard_infos = param_shard_infos(self._layout, self._span)
        self._split_sizes, self._piece_of_param = self._layout.split_sizes(self._padded_numel)

        if materialize_in_place is not None:
            unsharded = self._materialize_into_flat_buffer(materialize_in_place, device)
        else:
            unsharded = self._flatten()
        # id -> (weak reference, fqn of its first registration): identity, never tensor ==
        self._managed_params: Dict[int, Tuple["weakref.ref[nn.Parameter]", str]] = {}
        for slot in self._all_slots():
            self._managed_params.setdefault(id(slot.param), (weakref.ref(slot.param), slot.fqn))
        chunk = self._padded_numel // shard_world
        self.compute_device = unsharded.device
        self._offloaded = offload_params and self.compute_device.type not in ("cpu", "meta")
        if is_sharded:
            self._local_shard = unsharded[self.rank * chunk : (self.rank + 1) * chunk].clone()
        else:
            self._local_shard = unsharded
        if self._offloaded:
            self._local_shard = _to_host(self._local_shard)
        requires_grad = any(slot.param.requires_grad for slot in self._slots)
        self.flat_param = FlatParameter(self._local_shard, requires_grad=requires_grad)
        self._set_flat_param_metadata(chunk)
        # The buffers a gather fills: the full-precision one (for a handle that is not sharded, the
        # shard itself) and, with a low param_dtype, the one forward and backward compute on.
        self._full_precision_buffer = unsharded
        self._low_precision_buffer = self._make_low_precision_buffer()
        self._unsharded_buffer = unsharded  # the one the current gather filled
        self._path = ""  # the unit's clean path from its root, for error messages
        self._placeholders = self._make_placeholders()
        for slot in self._slots:
            setattr(slot.param, FLATTENED, True)
        self._resting_views: List[torch.Tensor] = []  # use_orig_params: what the originals view at rest
        self._modules_with_setattr = set() if os.environ.get(UNSAFE_SETATTR) == "1" else {
            id(slot.module) for slot in self._all_slots() if type(slot.module).__setattr__ is not nn.Module.__setattr__
        }
        self._install_initial_views()
        self.state = HandleState.UNSHARDED
        if self._needs_unshard:
            self._free_unsharded()
        self._gather_work: "Optional[comm.GuardedWork | comm.PairwiseExchange]" = None
        self._backward_started = False  # this backward has moved the optimizer's gradient aside
        self._grad_before_backward: Optional[torch.Tensor] = None  # sharded gradient of earlier backwards
        self._grad_this_backward: Optional[torch.Tensor] = None  # this backward's reduced gradient
        self._grad_is_unreduced = False  # flat_param.grad holds local sums (inside no_sync)
        self._grad_span = self._trainable_span()  # the part of the shard the gradients below cover
        self._span_grad: Optional[torch.Tensor] = None  # the optimizer's gradient when the span is partial
        self._orig_grad_views: List[Optional[torch.Tensor]] = []
        self._forward_views: List[torch.Tensor] = []  # the last forward's, tied to autograd
        self._comm_hook: Optional["CommHook"] = None  # register_comm_hook's, replacing the reduction below

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

    def _materialize_into_flat_buffer(self, materialize: Callable[[Sequence[ParamSlot]], None], device: torch.device) -> torch.Tensor:
        """Meta parameters become Parameters viewing their place in a new unsharded flat buffer (every
        registration of a tied one gets the same new Parameter), then ``materialize`` fills them."""
        first = self._slots[0].param
        flat = torch.full((self._padded_numel,), ALIGNMENT_PADDING_VALUE, dtype=first.dtype, device=device)
        flat[self._layout.numel :].zero_()
        views = self._unflatten(flat)
        replaced = {
            id(slot.param): nn.Parameter(views[i], requires_grad=slot.param.requires_grad)
            for i, slot in enumerate(self._slots)
        }
        self._slots = tuple(dataclasses.replace(slot, param=replaced[id(slot.param)]) for slot in self._slots)
        self._shared_slots = tuple(
            (dataclasses.replace(slot, param=replaced[id(slot.param)]), i) for slot, i in self._shared_slots
        )
        for slot in self._all_slots():
            slot.module._parameters[slot.attr] = slot.param
        materialize(self._all_slots())
        return flat

    def _set_flat_param_metadata(self, chunk: int) -> None:
        flat = self.flat_param
        flat._fqns = tuple(slot.fqn for slot in self._slots)
        flat._shapes = self._shapes
        flat._numels = self._layout.numels
        flat._unpadded_unsharded_size = torch.Size([self._layout.numel])
        flat._padded_unsharded_size = torch.Size([self._padded_numel])
        flat._sharded_size = torch.Size([chunk])
        flat._shard_numel_padded = self._span.numel_padded

    def _make_low_precision_buffer(self) -> Optional[torch.Tensor]:
        """The buffer forward and backward compute on when param_dtype is lower than the shard's dtype
        (storage allocated at each gather, freed at each reshard)."""
        if not self.precision.gathers_low_precision:
            return None
        return self._unallocated_buffer(self.precision.param_dtype)

    def _unallocated_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """An unsharded flat buffer on the compute device whose storage each gather allocates."""
        buffer = torch.empty(self._padded_numel, dtype=dtype, device=self.compute_device)
        _free_storage(buffer)
        return buffer

    @property
    def _needs_unshard(self) -> bool:
        """Whether computing needs a buffer apart from the shard: a sharded handle gathers one; one
        that is not sharded copies its parameters into one to compute in low precision, or on the
        compute device when they are offloaded."""
        return self._full_precision_buffer is not self._local_shard or self._low_precision_buffer is not None

    @property
    def computes_on_low_precision_copy(self) -> bool:
        """Unsharded for computing in a low-precision copy of a shard that is the whole flat parameter
        (a unit that is not sharded, with param_dtype set)."""
        return not self.is_sharded and self._unsharded_buffer is self._low_precision_buffer

    @property
    def forces_full_precision(self) -> bool:
        """Evaluation in full precision (``FSDP_USE_FULL_PREC_IN_EVAL=1`` and the module in eval mode):
        the unit gathers and reduces in its own dtype, as torch's."""
        return self.precision.is_mixed and self.precision.full_precision_in_eval and not self._owner.training

    def _make_placeholders(self) -> List[torch.Tensor]:
        return [ShardedParamPlaceholder(self.clean_fqn(s), shape, self._local_shard) for s, shape in zip(self._slots, self._shapes)]

    @property
    def path(self) -> str:
        return self._path

    def clean_fqn(self, slot: ParamSlot) -> str:
        """The slot's name from the root, as the user's unwrapped model names it."""
        return f"{self._path}.{slot.fqn}" if self._path else slot.fqn

    def set_path(self, path: str) -> None:
        """The unit's clean path from its root, so that errors name parameters as the user's model does."""
        self._path = path
        self._placeholders = self._make_placeholders()
        if self.state is HandleState.SHARDED and not self.use_orig_params:
            self._install(self._placeholders, as_parameters=False)

    def _views_of_local_part(self, local: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's part of a shard-sized tensor: 1-D slices when sharded, full shapes if not."""
        return [self._view_in(local, info, shape) for info, shape in zip(self._shard_infos, self._shapes)]

    def _view_in(self, local: torch.Tensor, info: ParamShardInfo, shape: torch.Size, start: int = 0) -> torch.Tensor:
        """One parameter's part of ``local``, a tensor over this rank's shard from offset ``start``."""
        piece = local[info.offset_in_shard - start : info.offset_in_shard - start + info.numel_in_shard]
        return piece if self.is_sharded else piece.view(shape)

    def _install_initial_views(self) -> None:
        """use_orig_params keeps the original Parameters, now viewing the shard; otherwise the
        Parameters leave the module, the FlatParameter joins the owner, and views of the unsharded
        buffer take the original names."""
        if self.use_orig_params:
            self._point_orig_params_at_shard()
            return
        self._register_flat_param_in_place_of_originals()
        self._slots = tuple(dataclasses.replace(slot, param=None) for slot in self._slots)
        self._shared_slots = tuple((dataclasses.replace(slot, param=None), i) for slot, i in self._shared_slots)
        self._install(self._unflatten(self._unsharded_buffer.detach()), as_parameters=False)

    def _register_flat_param_in_place_of_originals(self) -> None:
        for slot in self._all_slots():
            del slot.module._parameters[slot.attr]
        self._owner._parameters[FLAT_PARAM] = self.flat_param

    def _point_orig_params_at_shard(self) -> None:
        self._resting_views = self._views_of_local_part(self._local_shard)
        with torch.no_grad():
            for slot, view in zip(self._slots, self._resting_views):
                slot.param.data = view

    def write_back_orig_params(self, is_gathered_for_backward: bool = False) -> None:
        """use_orig_params: take into the shard what the user did to an original parameter at rest,
        as torch's does: a new ``Parameter`` assigned in its place (it becomes the original; its
        gradient starts empty) or new ``.data`` assigned to it. Either must have the shape the
        parameter has at rest (its 1-D part of this rank's shard when sharded); anything else would
        be dropped silently, so it raises. Between a forward and its backward while the unit stays
        gathered (SHARD_GRAD_OP, the root) the backward computes on the gathered values, so a change
        there is refused (``is_gathered_for_backward``). One identity and one pointer check per
        parameter when nothing changed."""
        if not self.use_orig_params:
            return
        written = False
        for index, (slot, view) in enumerate(zip(self._slots, self._resting_views)):
            current = slot.module._parameters.get(slot.attr)
            if current is None:  # deregistered for a while (a client's own checkpointing)
                continue
            if current is slot.param and (view.numel() == 0 or current.data_ptr() == view.data_ptr()):
                continue
            where = self.clean_fqn(slot)
            if is_gathered_for_backward:
                raise AssertionError(
                    f"fsdp1: parameter '{where}' was changed between forward and backward; FSDP does not "
                    "support changing the parameters between forward and backward for a unit that stays "
                    "gathered for its backward (the root, and every unit under SHARD_GRAD_OP). Change it "
                    "after backward()."
                )
            if current.shape != view.shape:
                raise RuntimeError(
                    f"fsdp1: Cannot writeback when the parameter shape changes: '{where}' is {tuple(current.shape)} "
                    f"on rank {self.rank} but its part of this rank's shard is {tuple(view.shape)}. Assign values "
                    "inside summon_full_params() (full shapes), or keep the shape the parameter has now."
                )
            with torch.no_grad():  # through ``.data``: the shard's version counter is the flat parameter's
                view.data.copy_(current.detach())
            if current is not slot.param:
                self._adopt_orig_param(index, current)
            current.data = view
            written = True
        for slot, primary in self._shared_slots:
            if slot.module._parameters.get(slot.attr, self._slots[primary].param) is not self._slots[primary].param:
                raise NotImplementedError(
                    f"fsdp1: '{self.clean_fqn(slot)}' and '{self.clean_fqn(self._slots[primary])}' shared one parameter when the unit was "
                    "built, and one of them was replaced since; changing shared parameters after wrapping is "
                    "not supported. Assign new values in place (param.data.copy_(...)) instead."
                )
        if written and self.holds_gathered_copy:
            self.reshard()  # the gathered copy is stale; the next use gathers the new values

    @property
    def holds_gathered_copy(self) -> bool:
        """Unsharded into a buffer apart from the shard (kept for a backward, or inside no_sync)."""
        return self.state is not HandleState.SHARDED and self._needs_unshard

    def _adopt_orig_param(self, index: int, param: nn.Parameter) -> None:
        """``param`` replaced the original parameter of slot ``index`` (and its repeats)."""
        old = self._slots[index].param
        self._slots = tuple(dataclasses.replace(s, param=param) if i == index else s for i, s in enumerate(self._slots))
        self._shared_slots = tuple(
            (dataclasses.replace(s, param=param), i) if i == index else (s, i) for s, i in self._shared_slots
        )
        ref, fqn = self._managed_params.pop(id(old))
        self._managed_params[id(param)] = (weakref.ref(param), fqn)
        setattr(param, FLATTENED, True)

    # ----------------------------------------------------------------------------- queries
    @property
    def fqns(self) -> Tuple[str, ...]:
        return self.flat_param._fqns

    def param_modules(self) -> List[nn.Module]:
        """The modules that hold this unit's parameters, each once."""
        return list({id(slot.module): slot.module for slot in self._all_slots()}.values())

    def fqn_of(self, param: nn.Parameter) -> Optional[str]:
        """The name (relative to the unit) under which this unit flattened ``param``, if it did."""
        ref, fqn = self._managed_params.get(id(param), (None, None))
        return fqn if ref is not None and ref() is param else None

    # ----------------------------------------------------------------------------- unshard / reshard
    def unshard(self, full_precision: Optional[bool] = None) -> None:
        """Start the all-gather of the full parameter (no-op if already unsharded, or started, in the
        precision wanted). It runs in param_dtype: the shard is cast (and, offloaded, copied to the
        compute device) into a temporary that the collective's work keeps alive until it has read
        it, and no longer. ``full_precision`` (summon_full_params, state dicts; by default evaluation
        under ``FSDP_USE_FULL_PREC_IN_EVAL``) gathers the shard's own dtype instead."""
        if full_precision is None:
            full_precision = self.forces_full_precision
        target = self._full_precision_buffer
        if self._low_precision_buffer is not None and not full_precision:
            target = self._low_precision_buffer
        if self.state is not HandleState.SHARDED:
            if self._unsharded_buffer is target:
                return
            self.reshard()
        self._unsharded_buffer = target
        if target is self._local_shard:  # not sharded, full precision: the shard is the parameter
            self.state = HandleState.UNSHARDED
            return
        _alloc_storage(target, self._padded_numel)
        if not self.is_sharded:
            target.copy_(self._local_shard, non_blocking=True)
            self.state = HandleState.UNSHARDED
            return
        source = self._local_shard.to(device=target.device, dtype=target.dtype, non_blocking=True)
        self._gather_work = comm.all_gather_into(target, source, self.group, self._path)
        self.state = HandleState.UNSHARDING

    def wait_unshard(self) -> None:
        """Finish the all-gather and point the flat parameter at the unsharded buffer."""
        if self.state is HandleState.UNSHARDING:
            self._finish_gather()
            self.state = HandleState.UNSHARDED
        if self._unsharded_buffer is not self._local_shard:
            self.flat_param.data = self._unsharded_buffer

    def _finish_gather(self) -> None:
        """Wait for the all-gather once: a failed one is not waited for again by the reshard that
        undoes the aborted forward."""
        work, self._gather_work = self._gather_work, None
        if work is not None:
            work.wait()

    def use_unsharded_views(self) -> Optional[torch.autograd.graph.Node]:
        """Give the module views of the unsharded flat parameter, made under the caller's grad mode so
        that autograd routes every original parameter's gradient into the flat parameter.

        Returns the autograd node that will assemble the unsharded flat gradient from the views'
        gradients (None when no gradient will flow), so that the runtime can act just before that
        gradient is allocated.
        """
        if self.use_orig_params:
            self._sync_requires_grad()
        pieces = torch.split(self.flat_param, self._split_sizes)
        self._forward_views = self._param_views(pieces)
        self._install(self._forward_views, as_parameters=self.use_orig_params, through_setattr=True)
        return pieces[0].grad_fn

    def use_forward_views(self) -> None:
        """The last forward's views again, for backward: activation checkpointing recomputes part of
        the forward then, and these are tied to the flat parameter as a reentrant recomputation needs
        (the gather has refilled their storage)."""
        self._install(self._forward_views, as_parameters=self.use_orig_params)

    def _sync_requires_grad(self) -> None:
        """The flat parameter needs a gradient while any original one does (frozen or unfrozen after
        wrapping); the gradients kept between steps cover what is trainable now."""
        requires_grad = tuple(slot.param.requires_grad for slot in self._slots)
        if requires_grad == self._requires_grad:
            return
        self._requires_grad = requires_grad
        if self.flat_param.requires_grad != any(requires_grad):
            self.flat_param.requires_grad_(any(requires_grad))
        grad = self._optim_grad
        old_span, self._grad_span = self._grad_span, self._trainable_span()
        if self._grad_before_backward is not None:
            self._grad_before_backward = self._respan(self._grad_before_backward, old_span)
        if grad is not None:
            self._set_grad_for_optim(self._respan(grad, old_span))

    def _trainable_span(self) -> Tuple[int, int]:
        """The part of this rank's shard that gradients kept between steps cover: all of it, unless
        the unit holds frozen parameters (use_orig_params), which then cost no gradient memory
        (torch's keeps it, pytorch#104690). Frozen parameters are laid out last, so the trainable
        ones' elements are contiguous."""
        shard_numel = self._local_shard.numel()
        if not self.use_orig_params or all(self._requires_grad):
            return 0, shard_numel
        bounds = [
            (info.offset_in_shard, info.offset_in_shard + info.numel_in_shard)
            for info, requires_grad in zip(self._shard_infos, self._requires_grad)
            if requires_grad and info.in_shard
        ]
        if not bounds:
            return 0, 0
        return min(lo for lo, _ in bounds), max(hi for _, hi in bounds)

    def _respan(self, grad: torch.Tensor, old_span: Tuple[int, int]) -> torch.Tensor:
        """``grad`` over ``old_span`` moved to the current span (zeros where it had no values)."""
        (old_lo, old_hi), (lo, hi) = old_span, self._grad_span
        moved = grad.new_zeros(hi - lo)
        start, end = max(lo, old_lo), min(hi, old_hi)
        if start < end:
            moved[start - lo : end - lo] = grad[start - old_lo : end - old_lo]
        return moved

    def use_resting_views(self) -> None:
        """Outside the unit's computation the module holds, with use_orig_params, the original
        Parameters (viewing this rank's shard), so that ``parameters()`` never yields a view; without
        it, views of the gathered buffer outside autograd, which stay readable after an optimizer
        step changed the flat parameter in place."""
        if self.use_orig_params:
            for slot in self._all_slots():
                self._register(slot, slot.param, as_parameter=True, through_setattr=True)
        else:
            self._install(self._unflatten(self._unsharded_buffer.detach()), as_parameters=False)

    def keep_gathered_for_backward(self) -> None:
        """End of a forward after which the unit stays gathered for its backward (the root, SHARD_GRAD_OP):
        until the backward re-points it, the flat parameter shows the shard and, with use_orig_params,
        the module the original parameters, so that an optimizer step in between (no backward came)
        updates the shard. Without it the forward's views stay: their storage is alive."""
        if self.use_orig_params:
            self.use_resting_views()
        if self._unsharded_buffer is not self._local_shard:
            self.flat_param.data = self._local_shard

    def reshard(self) -> None:
        """Point everything back at the local shard and free the unsharded storage (no-op when sharded:
        the end-of-backward catch-all calls it for every unit). A prefetched all-gather that nobody
        waited for is finished first, so the collective never writes into freed storage."""
        if self.state is HandleState.SHARDED:
            return
        try:
            if self.state is HandleState.UNSHARDING:
                self._finish_gather()
        finally:  # a failed gather still leaves the handle sharded
            if not self._needs_unshard:
                self.use_resting_views()
            else:
                self.flat_param.data = self._local_shard
                self._free_unsharded()

    def _free_unsharded(self) -> None:
        if self._unsharded_buffer is not self._local_shard:
            _free_storage(self._unsharded_buffer)
        self._unsharded_buffer = self._full_precision_buffer
        self.state = HandleState.SHARDED
        if self.use_orig_params:
            self.use_resting_views()
        elif self.is_sharded:
            self._install(self._placeholders, as_parameters=False)
        else:  # views of the shard, which is the whole parameter (an offloaded one's device copy is freed)
            self._install(self._unflatten(self._local_shard.detach()), as_parameters=False)

    def _unflatten(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return self._param_views(torch.split(flat, self._split_sizes))

    def _param_views(self, pieces: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Each parameter's piece of the split unsharded flat parameter, in its own shape."""
        return [pieces[i].view(shape) for i, shape in zip(self._piece_of_param, self._shapes)]

    def _install(self, tensors: Sequence[torch.Tensor], as_parameters: bool, through_setattr: bool = False) -> None:
        """Register ``tensors`` under the original names: in ``_parameters`` (use_orig_params, and
        inside summon_full_params, so the names stay visible), else as plain attributes. Frozen
        original parameters get detached views, so autograd computes no gradient for them."""
        for slot, tensor in zip(self._slots, tensors):
            if as_parameters and slot.param is not None and not slot.param.requires_grad:
                tensor = tensor.detach()
            self._register(slot, tensor, as_parameters, through_setattr)
        for slot, primary in self._shared_slots:
            first = self._slots[primary]
            source = first.module._parameters if as_parameters else first.module.__dict__
            self._register(slot, source[first.attr], as_parameters, through_setattr)

    def _register(self, slot: ParamSlot, tensor: torch.Tensor, as_parameter: bool, through_setattr: bool) -> None:
        """``slot.module.<attr> = tensor``: straight into the module's dicts, or, ``through_setattr``
        (a forward's views, and the original parameters coming back), through the module's own
        ``__setattr__`` where its class overrides it, so that a cache keyed on assignment sees them
        as under torch's FSDP1 (``FSDP_USE_UNSAFE_SETATTR=1`` skips it, as torch's). Placeholders and
        the views backward re-installs never reach user code."""
        module = slot.module
        if through_setattr and id(module) in self._modules_with_setattr:
            module._parameters.pop(slot.attr, None)
            module.__dict__.pop(slot.attr, None)
            setattr(module, slot.attr, tensor)
            if as_parameter and slot.attr not in module._parameters:
                module._parameters[slot.attr] = module.__dict__.pop(slot.attr)
        elif as_parameter:
            module._parameters[slot.attr] = tensor
        else:
            module.__dict__[slot.attr] = tensor

    def _all_slots(self) -> List[ParamSlot]:
        return list(self._slots) + [slot for slot, _ in self._shared_slots]

    # ----------------------------------------------------------------------------- full parameters
    @contextlib.contextmanager
    def gathered_views(self) -> Iterator[List[torch.Tensor]]:
        """Every parameter's full value (collective: all ranks gather), as views of the unsharded
        buffer outside autograd until exit; the module is not touched. A buffer kept gathered for a
        backward is gathered afresh: an optimizer step may have changed the shard since."""
        self.reshard()
        self.unshard(full_precision=True)
        self.wait_unshard()
        try:
            yield self._unflatten(self._unsharded_buffer.detach())
        finally:
            self.reshard()

    @contextlib.contextmanager
    def full_params(self, writeback: bool, expose: bool = True, offload_to_cpu: bool = False,
                    with_grads: bool = False) -> Iterator[None]:
        """Within, the module holds every original parameter unsharded as an ``nn.Parameter`` (the
        originals themselves with use_orig_params), outside autograd; on exit with ``writeback`` this
        rank keeps its shard of what they hold then, including data the caller replaced, also when
        the body raised (as torch's).

        Collective on every rank; a rank with ``expose=False`` (not rank 0 under ``rank0_only``)
        frees what it gathered at once and its module stays as it was. ``offload_to_cpu`` shows CPU
        copies (the device buffer is freed meanwhile); ``with_grads`` sets each one's ``.grad`` to
        the full averaged gradient (None where no rank has one).
        """
        self.reshard()
        self.unshard(full_precision=True)
        self.wait_unshard()
        try:
            views = self._unflatten(self._unsharded_buffer.detach())
            grads = self._gathered_grads(with_grads)
            if not expose:
                self.reshard()
                yield
                return
            if offload_to_cpu and views[0].device.type != "cpu":
                views = [view.cpu() for view in views]
                grads = None if grads is None else [grad.cpu() for grad in grads]
                self.reshard()
            exposed = self._expose_full_params(views, grads)
            try:
                yield
            finally:  # written back even when the body raised, as torch's
                try:
                    if writeback:
                        registered = self._registered_full_params(exposed)
                        self._check_full_shapes(views, registered)
                        self._adopt_replaced_orig_params(exposed, registered)
                        self.load_full_params(registered)
                finally:
                    self._hide_full_params(restore_grads=grads is not None)
        finally:
            self.reshard()

    def _gathered_grads(self, with_grads: bool) -> Optional[List[torch.Tensor]]:
        """The full averaged gradient of every parameter (collective), or None without ``with_grads``
        or when no rank holds a gradient for this unit."""
        if not with_grads:
            return None
        if self._grad_is_unreduced:
            raise RuntimeError(
                f"fsdp1: summon_full_params(with_grads=True) inside no_sync() for unit with {self.fqns[:3]}: "
                "the gradients are this rank's unreduced sums. Call it after the backward that synchronises them."
            )
        self.write_back_orig_grads()  # a zero_grad() on the original parameters since the last step counts
        grad = self._optim_grad
        flag = torch.tensor([0.0 if grad is None else 1.0], device=self.compute_device)
        comm.all_reduce(flag, self.group).wait()
        if flag.item() == 0.0:
            return None
        shard = self._local_shard.new_zeros(self._local_shard.shape, device=self.compute_device)
        if grad is not None:
            lo, hi = self._grad_span
            shard[lo:hi] = grad
        full = shard.new_empty(self._padded_numel) if self.is_sharded else shard
        if self.is_sharded:
            comm.all_gather_into(full, shard, self.group).wait()
        return self._unflatten(full)

    def _expose_full_params(self, views: List[torch.Tensor], grads: Optional[List[torch.Tensor]]) -> List[nn.Parameter]:
        if self.use_orig_params:
            exposed = [slot.param for slot in self._slots]
            for param, view in zip(exposed, views):
                param.data = view
            self.use_resting_views()
        else:
            requires_grad = self.flat_param.requires_grad
            exposed = [nn.Parameter(view, requires_grad=requires_grad) for view in views]
            del self._owner._parameters[FLAT_PARAM]
            for slot in self._all_slots():
                del slot.module.__dict__[slot.attr]
            self._install(exposed, as_parameters=True)
        if grads is not None:
            for param, grad, requires_grad in zip(exposed, grads, self._requires_grad):
                param.grad = grad if requires_grad else None
        return exposed

    def _registered_full_params(self, exposed: List[nn.Parameter]) -> List[nn.Parameter]:
        """What the module holds under each original name now: the parameter exposed, or one the
        caller assigned in its place, whose values are then written back."""
        registered = [slot.module._parameters.get(slot.attr) for slot in self._slots]
        return [param if current is None else current for param, current in zip(exposed, registered)]

    def _adopt_replaced_orig_params(self, exposed: List[nn.Parameter], registered: List[nn.Parameter]) -> None:
        """use_orig_params: a parameter assigned in place of an original one becomes the original."""
        if self.use_orig_params:
            for index, (param, current) in enumerate(zip(exposed, registered)):
                if current is not param:
                    self._adopt_orig_param(index, current)

    def _check_full_shapes(self, views: List[torch.Tensor], exposed: List[nn.Parameter]) -> None:
        for slot, view, param in zip(self._slots, views, exposed):
            if param.shape != view.shape:
                raise RuntimeError(
                    f"fsdp1: Cannot writeback when the parameter shape changes: '{self.clean_fqn(slot)}' changed from "
                    f"{tuple(view.shape)} to {tuple(param.shape)} inside summon_full_params; FSDP can only write "
                    "back values of the same shape. Change values in place (e.g. param.copy_(...)) instead."
                )

    def _hide_full_params(self, restore_grads: bool) -> None:
        self.reshard()
        if self.use_orig_params:
            self._point_orig_params_at_shard()
            self.use_resting_views()  # the originals again, also where the caller assigned another
            if restore_grads:  # the originals showed full gradients: back to views of the sharded one
                self._set_grad_for_optim(self._optim_grad)
        else:
            self._register_flat_param_in_place_of_originals()

    # ----------------------------------------------------------------------------- module conversions
    @contextlib.contextmanager
    def flat_param_registered(self) -> Iterator[None]:
        """Within, the owner holds the FlatParameter in place of the originals (use_orig_params), so
        that ``nn.Module._apply`` (``.to``, ``.double()``, ...) converts the one tensor that owns the
        storage; ``adopt_converted_flat_param`` then rebuilds everything derived from it. The user's
        ``zero_grad`` on the originals is carried into the flat gradient first, which is converted too."""
        self.reshard()
        self.write_back_orig_grads()
        if not self.use_orig_params:
            yield
            return
        self._register_flat_param_in_place_of_originals()
        try:
            yield
        finally:
            del self._owner._parameters[FLAT_PARAM]
            self.use_resting_views()

    def adopt_replaced_flat_param(self) -> None:
        """A client replaced ``flat_param.data`` between steps (HF Accelerate upcasts the flat
        parameters of a model loaded in bf16 to fp32 before building its optimizer, as torch's FSDP1
        lets it): the new tensor becomes the shard and everything derived from it follows. One
        pointer comparison when nothing was replaced."""
        if self.state is HandleState.SHARDED or not self._needs_unshard:
            flat, shard = self.flat_param, self._local_shard
            if flat.data_ptr() != shard.data_ptr() or flat.dtype != shard.dtype or flat.shape != shard.shape:
                self.adopt_converted_flat_param()

    @property
    def _orig_param_dtype(self) -> torch.dtype:
        """torch's name for the shard's dtype, which clients read (and set after an upcast)."""
        return self.precision.orig_dtype

    @_orig_param_dtype.setter
    def _orig_param_dtype(self, dtype: torch.dtype) -> None:
        self.precision = self.precision.with_orig_dtype(dtype)

    def adopt_converted_flat_param(self) -> None:
        """After a dtype or device conversion of the (sharded) flat parameter: the local shard, the
        unsharded buffer, the views and the gradient views follow it."""
        self._local_shard = self.flat_param.data
        if not self._offloaded:  # ``.to(device)`` moved the shard, and so where the unit computes
            self.compute_device = self._local_shard.device
        self.precision = self.precision.with_orig_dtype(self._local_shard.dtype)
        self._placeholders = self._make_placeholders()
        if self.use_orig_params:
            self._point_orig_params_at_shard()
        self._full_precision_buffer = self._local_shard
        if self.is_sharded or self._offloaded:
            self._full_precision_buffer = self._unallocated_buffer(self._local_shard.dtype)
        self._low_precision_buffer = self._make_low_precision_buffer()
        self._unsharded_buffer = self._full_precision_buffer
        if self._needs_unshard:
            self._free_unsharded()
        else:
            self.state = HandleState.UNSHARDED
            self.use_resting_views()
        if not self._grad_is_unreduced:
            grad = self._optim_grad  # a whole-shard gradient was converted with the flat parameter
            self._set_grad_for_optim(None if grad is None else grad.to(self._local_shard))

    # ----------------------------------------------------------------------------- gradients
    def prepare_gradient_for_backward(self) -> None:
        """Once per backward, before autograd accumulates this unit's unsharded gradient: move the
        optimizer's sharded gradient aside, so that this backward's reduction adds onto it.

        Doing this when the gradient is about to arrive, not at the next forward, keeps ``.grad``
        intact through forwards that no backward follows (a metric between backward and step).
        A gradient left unreduced by ``no_sync`` stays on ``flat_param.grad``, where autograd adds
        this backward's local gradient to it.
        """
        if self._backward_started:
            return
        self._backward_started = True
        if self._grad_is_unreduced:
            return
        self.write_back_orig_grads()
        before = self._optim_grad  # in param_dtype under keep_low_precision_grads: accumulate in full
        self._grad_before_backward = None if before is None else before.to(self.precision.orig_dtype)
        self._span_grad = self.flat_param.grad = None

    def _show_unreduced_grads(self) -> None:
        """use_orig_params inside ``no_sync``: each original parameter's ``.grad`` is its full-shape part
        of the locally accumulated (unreduced) gradient, as torch's shows it, for code that reads or
        clips gradients between micro-batches. Remade after every backward: autograd may replace the
        accumulated tensor instead of adding into it."""
        if not self.use_orig_params:
            return
        self._orig_grad_views = []  # not the optimizer's gradient: nothing to write back into it
        for slot, grad, requires_grad in zip(self._slots, self._unflatten(self.flat_param.grad), self._requires_grad):
            _assign_grad(slot.param, grad if requires_grad else None)

    def write_back_orig_grads(self) -> None:
        """use_orig_params: carry what the user did to the original parameters' ``.grad`` into the flat
        gradient: ``None`` (``zero_grad``) zeroes that part, and frees the flat gradient once every
        part is ``None``; a replaced tensor is copied in. Idempotent, so the root runs it at every
        forward (freeing zeroed gradients before the forward, as torch's) and backward runs it again.
        Inside ``no_sync`` a ``zero_grad`` of every original parameter drops the local accumulation."""
        if self._grad_is_unreduced and self.use_orig_params and all(slot.param.grad is None for slot in self._slots):
            self.flat_param.grad = None
            self._grad_is_unreduced = False
        if self._optim_grad is None or not self._orig_grad_views:
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
        if not any_grad:
            self._set_grad_for_optim(None)

    def reduce_grad(self) -> GradReduction:
        """Start reducing this step's unsharded gradient in reduce_dtype: mean over the ranks, this
        rank's shard kept. Under a hybrid strategy the shard is all-reduced across the replicas when
        it is finished."""
        grad = self.flat_param.grad
        self.flat_param.grad = None
        hook = self._comm_hook
        casts_itself = hook is not None and hook.casts_itself
        if grad.dtype != self.precision.reduce_dtype and not self.forces_full_precision and not casts_itself:
            grad = grad.to(self.precision.reduce_dtype)
        self._grad_is_unreduced = False
        if grad.numel() != self._padded_numel:
            raise RuntimeError(
                f"fsdp1 internal error: unit with {self.fqns[:3]}... got a gradient of {grad.numel()} "
                f"elements, expected {self._padded_numel}"
            )
        reduced = grad.new_empty(self._local_shard.shape) if self.is_sharded else grad
        if hook is not None:
            return GradReduction(self, hook.reduce(grad, reduced if self.is_sharded else None), grad, reduced)
        if self._pre_divide > 1:
            grad.div_(self._pre_divide)
        if self.is_sharded:
            work = comm.reduce_scatter_into(reduced, grad, self.group, self._path)
        else:
            work = comm.all_reduce(grad, self.group, self._path)
        return GradReduction(self, work, grad, reduced)

    @property
    def has_comm_hook(self) -> bool:
        return self._comm_hook is not None

    def set_comm_hook(self, hook: "CommHook") -> None:
        self._comm_hook = hook

    def _accumulate_reduced_grad(self, reduced: torch.Tensor) -> None:
        if not self._span_is_whole_shard():  # frozen parameters keep no gradient
            lo, hi = self._grad_span
            reduced = reduced[lo:hi].clone()
        if self._post_divide > 1 and self._comm_hook is None:  # a hook divides as it sees fit
            reduced.div_(self._post_divide)
        if not (self._keep_low_precision_grads and not self.is_sharded):  # NO_SHARD keeps it as reduced, as torch's
            reduced = reduced.to(self.precision.orig_dtype)
        if self._offloaded:
            reduced = _to_host(reduced)  # still in flight: prepare_gradient_for_optim waits
        if self._grad_this_backward is None:
            self._grad_this_backward = reduced
        else:
            self._wait_for_offloaded_grads()
            self._grad_this_backward += reduced

    def keep_grad_unreduced(self) -> None:
        """Inside ``no_sync``: leave the local gradient sum on ``flat_param.grad`` for later steps."""
        self._grad_is_unreduced = True

    def prepare_gradient_for_optim(self) -> None:
        """End of backward: the optimizer's gradient is the earlier one plus this backward's reduction.
        A unit this backward never reached keeps its gradient as it was."""
        started, self._backward_started = self._backward_started, False
        if self._grad_is_unreduced and started:
            self._show_unreduced_grads()
        if self._grad_is_unreduced or not started:
            return
        self._wait_for_offloaded_grads()
        before, reduced = self._grad_before_backward, self._grad_this_backward
        self._grad_before_backward = self._grad_this_backward = None
        if before is not None and reduced is not None:
            before += reduced
        grad = reduced if before is None else before
        if grad is not None and self._keep_low_precision_grads and self.is_sharded:
            grad = grad.to(self.precision.param_dtype)  # not sharded: left in reduce_dtype, as torch's
        self._set_grad_for_optim(grad)

    def _wait_for_offloaded_grads(self) -> None:
        """Copies of reduced gradients to the CPU run asynchronously on the compute device's stream;
        wait for them before the CPU reads one (after the first wait the stream is idle)."""
        if self._offloaded and self._grad_this_backward is not None:
            wait_for_device(self.compute_device)

    @property
    def _keep_low_precision_grads(self) -> bool:
        return self.precision.keep_low_precision_grads and not self.forces_full_precision

    def abandon_backward(self) -> None:
        """Undo what an aborted forward or backward left: pending all-gather finished, this backward's
        reductions dropped, the optimizer's gradient as it was before, the parameters sharded."""
        self.reshard()
        started, self._backward_started = self._backward_started, False
        if started and not self._grad_is_unreduced:
            self.flat_param.grad = None
            self._set_grad_for_optim(self._grad_before_backward)
        self._grad_before_backward = self._grad_this_backward = None

    @property
    def optim_grad(self) -> Optional[torch.Tensor]:
        """The sharded gradient the optimizer steps with (None if there is none)."""
        return None if self._grad_is_unreduced else self._optim_grad

    @property
    def _optim_grad(self) -> Optional[torch.Tensor]:
        """The optimizer's sharded gradient, over the gradient span: the flat parameter's ``.grad``
        (where ``zero_grad`` of a flat-parameter optimizer acts) when the span is the whole shard."""
        return self.flat_param.grad if self._span_is_whole_shard() else self._span_grad

    def _span_is_whole_shard(self) -> bool:
        return self._grad_span == (0, self._local_shard.numel())

    def _set_grad_for_optim(self, grad: Optional[torch.Tensor]) -> None:
        """Hand ``grad`` (over the gradient span) to the optimizer: as the flat parameter's ``.grad``
        when it covers the whole shard, and with use_orig_params as views on the original parameters
        (``None`` for frozen ones and for those with no element in this rank's shard, as torch's)."""
        lo, _ = self._grad_span
        if self._span_is_whole_shard():
            _assign_grad(self.flat_param, grad)
            self._span_grad = None
        else:
            self.flat_param.grad, self._span_grad = None, grad
        if not self.use_orig_params:
            return
        if grad is None:
            self._orig_grad_views = []
            for slot in self._slots:
                slot.param.grad = None
            return
        self._orig_grad_views = [
            self._view_in(grad, info, shape, start=lo) if requires_grad and info.in_shard else None
            for info, shape, requires_grad in zip(self._shard_infos, self._shapes, self._requires_grad)
        ]
        for slot, view in zip(self._slots, self._orig_grad_views):
            _assign_grad(slot.param, view)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``, in pinned memory so that the copy is asynchronous; the caller waits
    (``wait_for_device``) before reading it."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    host.copy_(tensor, non_blocking=True)
    return host


def _assign_grad(param: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """``param.grad = grad``, also for a gradient kept in lower precision than the parameter
    (keep_low_precision_grads) or of the full shape while the parameter is a shard (``no_sync``),
    which autograd's setter refuses: it gets a stand-in of the right dtype and shape (no storage of
    that size), whose data is then swapped, as torch's does."""
    if grad is None or (grad.dtype, grad.shape) == (param.dtype, param.shape):
        param.grad = grad
        return
    param.grad = torch.empty(1, dtype=param.dtype, device=param.device).expand(param.shape)
    param.grad.data = grad


_Registrations = Tuple[Tuple[ParamSlot, ...], Tuple[Tuple[ParamSlot, int], ...], Tuple[Tuple[str, int], ...]]


def _split_shared(slots: Sequence[ParamSlot]) -> _Registrations:
    """First occurrence of each parameter; every later registration of it with its first's index;
    and the other names of a registration already seen: a module registered under two names
    (``m.b = m.a``) is reached twice with the same attribute, one registration whose second name
    only state dicts list."""
    first_index: Dict[int, int] = {}  # id(param) -> index in unique: identity, never tensor ==
    registrations = set()
    unique, shared, aliases = [], [], []
    for slot in slots:
        index = first_index.get(id(slot.param))
        if (id(slot.module), slot.attr) in registrations:
            aliases.append((slot.fqn, index))
            continue
        registrations.add((id(slot.module), slot.attr))
        if index is not None:
            shared.append((slot, index))
        else:
            first_index[id(slot.param)] = len(unique)
            unique.append(slot)
    return tuple(unique), tuple(shared), tuple(aliases)


def _alloc_storage(tensor: torch.Tensor, numel: int) -> None:
    storage = tensor.untyped_storage()
    nbytes = numel * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)
