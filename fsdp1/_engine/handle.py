"""FlatParamHandle: one unit's parameters as one sharded 1-D tensor (a ``FlatParameter``).

The handle owns the flat parameter's storage and decides when the unit is sharded or unsharded; it
composes the parts that say what each of those means: the layout (``layout``: where each parameter
lies in the shard and the unsharded buffer), the views (``views``: what the modules hold under the
original names), the gradient (``flat_grad``) and the state-dict conversions
(``shard_conversions``). Its invariants:

* ``_local_shard`` and the sharded ``flat_param`` share one storage, which the optimizer updates in
  place; the all-gather reads ``_local_shard`` so that ``flat_param``'s autograd version counter
  never moves.
* While unsharded, ``flat_param.data`` is the whole *padded* unsharded buffer, so autograd produces
  a gradient that is already in reduce-scatter layout (no copy before the collective).
* Resharding frees the unsharded buffer's storage in place (``resize_(0)``) and unsharding refills
  the same storage, so views saved by autograd in forward are valid again in backward.
* Outside a unit's own forward the module sees no view of freed storage.
* Parameters are compared by identity only: ``==`` between tensors is elementwise, so no tensor is
  ever a member of a set of weak references or a key compared by value (tied weights broke so).

The padded buffer as the unsharded flat parameter is what makes the reduce-scatter input free:
torch's FSDP1 uses the unpadded prefix and pads every gradient with a copy (``F.pad``) per unit per
step; the views the module sees never include the padding.

Mixed precision keeps two unsharded buffers: the low-precision one forward and backward compute on,
and the full-precision one that ``summon_full_params``, FULL state dicts and full-precision
evaluation gather into (``unshard(full_precision)`` picks one and regathers if the other is held).
One buffer re-typed per gather would break the views autograd saved in forward. The low-precision
copy of the shard the all-gather reads is made per gather and dropped once the collective's work
has read it (keeping it until ``wait()`` cost one bf16 shard of peak under prefetching). Every
handle follows one rule: it computes on a buffer apart from its shard exactly when it is sharded,
computes in low precision, or is offloaded.

Every collective goes through the handle's ``transport``, which decides how values travel; the
layout only says where they sit. With ``quantization`` (``BlockQuantization``) the gathers that
forward and backward compute on travel block-quantized from the full-precision shard, and every
other gather (``summon_full_params``, the state dicts, full gradients) travels exact: quantization
changes what is sent, never what is kept.

CPU offload moves only the shard and its gradient: the shard lives in pinned CPU memory, a gather
copies it to the compute device on its way into the all-gather, and a reduced gradient comes back
asynchronously into pinned memory, with one wait before the optimizer's gradient is assembled. On a
CPU compute device it is the identity (torch's fails there in ``pin_memory()``).
"""

import contextlib
from enum import Enum, auto
from typing import Callable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

from .._torch_internals import version_of
from ..api import BlockQuantization
from . import collectives as comm
from .collectives import ProcessGroups
from .flat_grad import FlatGrad, ReduceSettings, to_host
from .flat_parameter import FlatParameter
from .layout import ParamLayout, alloc_storage, free_storage
from .mixed_precision import HandlePrecision
from .shard_conversions import ShardConversions
from .transport import Transport
from .traversal import ParamSlot
from .views import FLAT_PARAM, ParamViews, assign_grad


class HandleState(Enum):
    """Where the flat parameter's data lives."""

    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()
    """Between a forward and its backward, this rank keeps its rows over a smaller group than the
    unit shards over (``RowsAfterForward``), which backward gathers from; otherwise as SHARDED."""
    UNSHARDING = auto()
    UNSHARDED = auto()


RESTING = (HandleState.SHARDED, HandleState.SHARDED_POST_FORWARD)


class RowsAfterForward(Protocol):
    """What a unit keeps between its forward and its backward instead of resharding fully (torch's
    FSDP2 ``reshard_after_forward=k``): its rows over a smaller group, which backward gathers from.
    The front that offers it implements it; the handle only moves through its states."""

    def keep(self, unsharded: torch.Tensor) -> List[nn.Parameter]:
        """Keep this rank's part of the gathered ``unsharded`` buffer; what the module shows meanwhile."""

    def gather_into(self, unsharded: torch.Tensor, path: str) -> None:
        """Fill ``unsharded`` (freed) from the kept parts, and drop them."""

    def drop(self) -> None:
        """Drop the kept parts."""


class FlatParamHandle:
    """Flattens, shards, unshards and reshards one unit's parameters.

    The front that builds the unit hands in its parts, made for its API: the ``views`` (what the
    modules hold under the original names; they know the unit's owner module, which holds the
    FlatParameter when it is registered), the ``layout`` (where each parameter lies in the shard and
    the unsharded buffer) and the ``groups``: the unit shards over ``groups.shard`` and, under a
    hybrid strategy, all-reduces its reduced gradient over ``groups.replicate``. The handle never
    asks which API built it.

    ``precision`` says which dtype the unit gathers and computes in, reduces its gradient in and
    hands the optimizer; only the gathered copy and the gradient in flight are in low precision.
    With ``offload_params`` the shard and its gradient live on the CPU, where the optimizer steps
    them, and each gather copies the shard to the compute device first (a no-op when that is the CPU).
    ``reduce_settings`` (kept by the front, which its setters change) say how the gradient is
    reduced; ``rows_after_forward`` what the unit keeps between forward and backward, if anything.

    ``materialize_in_place`` is given for a unit whose parameters are still on the meta device: the
    handle gives them storage inside the unsharded flat buffer on ``device`` and calls it with the
    new parameters' slots to fill them there (``reset_parameters``, then ``sync_module_states``), so
    that construction never holds the unit's parameters twice.
    """

    def __init__(
        self,
        views: ParamViews,
        layout: ParamLayout,
        groups: ProcessGroups,
        precision: HandlePrecision,
        offload_params: bool = False,
        reduce_settings: Optional[ReduceSettings] = None,
        rows_after_forward: Optional[RowsAfterForward] = None,
        materialize_in_place: Optional[Callable[[Sequence[ParamSlot]], None]] = None,
        device: Optional[torch.device] = None,
        quantization: Optional[BlockQuantization] = None,
    ) -> None:
        self.group = groups.shard
        self.replicate_group = groups.replicate
        self.views = views
        self.layout = layout
        self._owner = views.owner
        if materialize_in_place is not None:
            assert device is not None, "materializing in place needs the device to materialize on"
            unsharded = self.layout.new_unsharded(self.views.orig_params()[0].dtype, device)
            self.views.materialize(self.layout.unflatten(unsharded))
            materialize_in_place(self.views.all_slots())
        else:
            unsharded = self.layout.flatten(self.views.initial_values())
        self.compute_device = unsharded.device
        self._offloaded = offload_params and self.compute_device.type not in ("cpu", "meta")
        self._local_shard = self.layout.shard_of(unsharded).clone() if self.is_sharded else unsharded
        if self._offloaded:
            self._local_shard = to_host(self._local_shard)
        self.flat_param = FlatParameter(self._local_shard, requires_grad=any(self.views.requires_grad))
        self._set_flat_param_metadata()
        # The buffers a gather fills: the full-precision one (for a handle that is not sharded, the
        # shard itself) and, with a low param_dtype, the one forward and backward compute on.
        self._full_precision_buffer = unsharded
        self._precision = precision
        self._low_precision_buffer = self._make_low_precision_buffer()
        self._unsharded_buffer = unsharded  # the one the current gather filled
        self.views.install_initial(self.flat_param, self._local_shard, unsharded, self.layout)
        self.transport = Transport(self.layout, groups.shard, groups.replicate, quantization)
        self.grad = FlatGrad(self.flat_param, self.layout, self.views, self.transport, precision,
                             reduce_settings or ReduceSettings(), lambda: self.forces_full_precision,
                             self.compute_device, self._offloaded)
        self.conversions = ShardConversions(self, self.layout, self.transport)
        self.state = HandleState.UNSHARDED
        self.keeps_unsharded_storage = False  # set_keep_unsharded_storage: resharding keeps the buffers' storage
        if self._needs_unshard:
            self._free_unsharded()
        self._gather_work: Optional[comm.Waitable] = None
        self._rows_after_forward = rows_after_forward
        self._forward_views: List[torch.Tensor] = []  # the last forward's, tied to autograd
        self._gathered_from: Optional[Tuple[torch.Tensor, int]] = None  # the shard and its version at the last gather
        self.forward_on_resting_params = False  # the last forward computed on the views' resting Parameters

    # ----------------------------------------------------------------------------- construction and queries
    def _set_flat_param_metadata(self) -> None:
        """torch's FlatParameter attributes, which clients and torch's own tests read."""
        flat, layout = self.flat_param, self.layout
        flat._fqns = self.views.fqns  # type: ignore[attr-defined]  # see FlatParameter
        flat._shapes = layout.shapes  # type: ignore[attr-defined]  # see FlatParameter
        flat._numels = layout.flat.numels  # type: ignore[attr-defined]  # see FlatParameter
        flat._unpadded_unsharded_size = torch.Size([layout.unpadded_numel])  # type: ignore[attr-defined]  # see FlatParameter
        flat._padded_unsharded_size = torch.Size([layout.unsharded_numel])  # type: ignore[attr-defined]  # see FlatParameter
        flat._sharded_size = torch.Size([layout.shard_numel])  # type: ignore[attr-defined]  # see FlatParameter
        flat._shard_numel_padded = layout.shard_padding_numel  # type: ignore[attr-defined]  # see FlatParameter

    @property
    def is_sharded(self) -> bool:
        return self.layout.is_sharded

    @property
    def use_orig_params(self) -> bool:
        """Whether the modules hold the original parameters at rest (what the state-dict and
        optimizer-state forms depend on)."""
        return self.views.use_orig_params

    @property
    def precision(self) -> HandlePrecision:
        return self._precision

    @precision.setter
    def precision(self, precision: HandlePrecision) -> None:
        self._precision = self.grad.precision = precision

    @property
    def _orig_param_dtype(self) -> torch.dtype:
        """torch's name for the shard's dtype, which clients read (and set after an upcast)."""
        return self.precision.orig_dtype

    @_orig_param_dtype.setter
    def _orig_param_dtype(self, dtype: torch.dtype) -> None:
        self.precision = self.precision.with_orig_dtype(dtype)

    @property
    def local_shard(self) -> torch.Tensor:
        return self._local_shard

    def _make_low_precision_buffer(self) -> Optional[torch.Tensor]:
        """The buffer forward and backward compute on when param_dtype is lower than the shard's dtype
        (storage allocated at each gather, freed at each reshard)."""
        if not self._precision.gathers_low_precision:
            return None
        return self._unallocated_buffer(self._precision.param_dtype)

    def _unallocated_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """An unsharded flat buffer on the compute device whose storage each gather allocates."""
        buffer = torch.empty(self.layout.unsharded_numel, dtype=dtype, device=self.compute_device)
        free_storage(buffer)
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
        return self._precision.is_mixed and self._precision.full_precision_in_eval and not self._owner.training

    @property
    def path(self) -> str:
        return self.views.path

    def set_path(self, path: str) -> None:
        """The unit's clean path from its root, so that errors name parameters as the user's model does."""
        self.views.set_path(path, self.layout, self.state in RESTING)
        self.grad.path = path

    @property
    def fqns(self) -> Tuple[str, ...]:
        return self.views.fqns

    @property
    def holds_gathered_copy(self) -> bool:
        """Unsharded into a buffer apart from the shard (kept for a backward, or inside no_sync)."""
        return self.state not in RESTING and self._needs_unshard

    @property
    def holds_current_gathered_copy(self) -> bool:
        """Holds a gathered copy of the shard as it still is: nothing wrote to the shard since the
        gather (known only where writes show in its version counter)."""
        if not (self.holds_gathered_copy and self.views.writes_show_in_shard and self._gathered_from is not None):
            return False
        shard, version = self._gathered_from
        return shard is self._local_shard and version == version_of(shard)

    def write_back_orig_params(self, is_gathered_for_backward: bool = False) -> None:
        """Take into the shard what the user assigned to an original parameter at rest
        (use_orig_params); a gathered copy is then stale, and the next use gathers the new values."""
        if self.views.take_user_changes(is_gathered_for_backward, self.layout) and self.holds_gathered_copy:
            self.reshard()

    # ----------------------------------------------------------------------------- unshard / reshard
    def unshard(self, full_precision: Optional[bool] = None) -> None:
        """Start the all-gather of the full parameter (no-op if already unsharded, or started, in the
        precision wanted). It runs in param_dtype: the shard is cast (and, offloaded, copied to the
        compute device) into a temporary that the collective's work keeps alive until it has read
        it, and no longer. ``full_precision`` (summon_full_params, state dicts; by default evaluation
        under ``FSDP_USE_FULL_PREC_IN_EVAL``) gathers the shard's own dtype instead, and never
        quantized; the gathers for computing are, under ``quantization``."""
        for_computing = full_precision is None
        if full_precision is None:
            full_precision = self.forces_full_precision
        target = self._full_precision_buffer
        if self._low_precision_buffer is not None and not full_precision:
            target = self._low_precision_buffer
        if self.state is HandleState.SHARDED_POST_FORWARD:
            if target is self._low_precision_buffer or not self._precision.gathers_low_precision:
                assert self._rows_after_forward is not None, "kept rows exist only where they are offered"
                self._rows_after_forward.gather_into(target, self.path)  # the backward after its forward
                self._unsharded_buffer = target
                self.state = HandleState.UNSHARDED
                return
            self.reshard()
        if self.state is not HandleState.SHARDED:
            if self._unsharded_buffer is target:
                return
            self.reshard()
        self._unsharded_buffer = target
        self._gathered_from = (self._local_shard, version_of(self._local_shard))
        if target is self._local_shard:  # not sharded, full precision: the shard is the parameter
            self.state = HandleState.UNSHARDED
            return
        if not self.is_sharded:
            alloc_storage(target)
            target.copy_(self._local_shard, non_blocking=True)
            self.state = HandleState.UNSHARDED
            return
        extras = self.views.gather_extras() if for_computing else None
        self._gather_work = self.transport.all_gather(target, self._local_shard, self.path, extras,
                                                      quantized=for_computing and not full_precision)
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

    def use_unsharded_views(self, on_resting_params: bool = False) -> Optional[torch.autograd.graph.Node]:
        """Give the module views of the unsharded flat parameter, made under the caller's grad mode so
        that autograd routes every original parameter's gradient into the flat parameter; or, with
        ``on_resting_params`` (the unit stays gathered after this forward) where the modules hold the
        unit's resting Parameters (it rests gathered: ``unshard()``, a backward that kept it, an
        earlier forward on them), let the forward compute on those leaves. A unit resharded after
        forward never does: its next forward's views would not be the Parameters a pipeline's weight
        pass finds, and its backwards would mix both kinds.

        Returns the autograd node that will assemble the unsharded flat gradient from the views'
        gradients (None when no gradient will flow), so that the runtime can act just before that
        gradient is allocated.
        """
        requires_grad = self.views.sync_requires_grad()  # frozen or unfrozen since the last forward
        if requires_grad is not None:
            if self.flat_param.requires_grad != any(requires_grad):
                self.flat_param.requires_grad_(any(requires_grad))
            self.grad.respan(requires_grad)
        resting = self.views.resting_params_shown(self._unsharded_buffer) if on_resting_params else None
        self.forward_on_resting_params = resting is not None
        if resting is not None:  # their gradients join the flat one later (take_resting_grads)
            self._forward_views = list(resting)
            return None
        pieces = self.layout.split(self.flat_param)
        self._forward_views = self.layout.param_views(pieces)
        self.views.install(self._forward_views, as_parameters=self.views.as_parameters, through_setattr=True)
        return pieces[0].grad_fn

    def use_forward_views(self) -> None:
        """The last forward's views again, for backward: activation checkpointing recomputes part of
        the forward then, and these are tied to the flat parameter as a reentrant recomputation needs
        (the gather has refilled their storage)."""
        self.views.install(self._forward_views, as_parameters=self.views.as_parameters)

    def use_resting_views(self) -> None:
        """Outside the unit's computation: with use_orig_params the original Parameters, so that
        ``parameters()`` never yields a view; without it views of the gathered buffer outside
        autograd, which stay readable after an optimizer step changed the flat parameter in place."""
        self.views.show_resting(self._unsharded_buffer, self.layout)

    def take_resting_grads(self, reduce_now: bool, reached: bool) -> bool:
        """The gradients a backward (or a pipeline's weight pass) left on the resting Parameters a
        forward computed on join the unit's gradient: when it is reduced now, when it already holds
        an unreduced sum, or when unreduced sums add up apart in ``reduce_dtype``, so that the
        micro-batches add up in the order and precision they do on torch's FSDP2 unsharded
        parameters (which move theirs at each post-backward). Otherwise they stay there, adding up.
        A backward that ``reached`` the unit and reduces it now also reduces a sum autograd added
        onto in place (through the views of it the resting Parameters show). Whether the unit has a
        gradient to reduce or keep now."""
        grads = self.views.new_resting_grads()
        given = [] if grads is None else [grad for grad in grads if grad is not None]
        added_in_place = reduce_now and reached and self.forward_on_resting_params and self.grad.is_unreduced
        if not ((given and (reduce_now or self.grad.is_unreduced or self.grad.sums_apart(given[0].dtype))) or added_in_place):
            return False
        self.grad.begin_backward()
        if grads is not None and given:
            self.grad.note_params_given([grad is not None for grad in grads])
            flat = self.flat_param.grad
            if flat is None:
                flat = torch.zeros(self.layout.unsharded_numel, dtype=given[0].dtype, device=self.compute_device)
            with torch.no_grad():
                for view, grad in zip(self.layout.unflatten(flat), grads):
                    if grad is not None:
                        view.add_(grad)
            assign_grad(self.flat_param, flat)
        self.views.drop_resting_grads()
        return True

    def keep_gathered_for_backward(self) -> None:
        """End of a forward after which the unit stays gathered for its backward (the root, SHARD_GRAD_OP):
        until the backward re-points it, the flat parameter shows the shard and, with use_orig_params,
        the module the original parameters, so that an optimizer step in between (no backward came)
        updates the shard. Without it the forward's views stay: their storage is alive."""
        self.views.show_kept_gathered()
        if self._unsharded_buffer is not self._local_shard:
            self.flat_param.data = self._local_shard

    def reshard_after_forward(self) -> None:
        """The end of a forward that frees the unit: with ``rows_after_forward`` this rank keeps its
        rows over their smaller group (SHARDED_POST_FORWARD), which the module shows until backward
        gathers from them."""
        rows = self._rows_after_forward
        if rows is None or self.state is not HandleState.UNSHARDED or self._unsharded_buffer is self._local_shard:
            self.reshard()
            return
        shown = rows.keep(self._unsharded_buffer)
        self.reshard()
        self.state = HandleState.SHARDED_POST_FORWARD
        self.views.install(shown, as_parameters=True)

    def set_rows_after_forward(self, rows: Optional[RowsAfterForward]) -> None:
        """What the unit keeps between forward and backward from now on (rows kept now go)."""
        if self.state is HandleState.SHARDED_POST_FORWARD:
            self.reshard()
        self._rows_after_forward = rows

    def reshard(self) -> None:
        """Point everything back at the local shard and free the unsharded storage (no-op when sharded:
        the end-of-backward catch-all calls it for every unit). A prefetched all-gather that nobody
        waited for is finished first, so the collective never writes into freed storage."""
        if self.state is HandleState.SHARDED_POST_FORWARD:
            assert self._rows_after_forward is not None, "kept rows exist only where they are offered"
            self._rows_after_forward.drop()
            self.state = HandleState.SHARDED
            self.views.show_sharded(self._local_shard, self.layout)
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
        if self._unsharded_buffer is not self._local_shard and not self.keeps_unsharded_storage:
            free_storage(self._unsharded_buffer)
        self._unsharded_buffer = self._full_precision_buffer
        self.state = HandleState.SHARDED
        self.views.show_sharded(self._local_shard, self.layout)

    def set_keeps_unsharded_storage(self, keep: bool) -> None:
        """Whether resharding keeps the unsharded buffers' storage (their addresses stay, for CUDA graph
        capture); turned off at rest, what was kept is freed now."""
        self.keeps_unsharded_storage = keep
        if not keep and self.state is HandleState.SHARDED:
            for buffer in (self._full_precision_buffer, self._low_precision_buffer):
                if buffer is not None and buffer is not self._local_shard:
                    free_storage(buffer)

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
            yield self.layout.unflatten(self._unsharded_buffer.detach())
        finally:
            self.reshard()

    def full_grads(self) -> Optional[List[torch.Tensor]]:
        """Every parameter's full averaged gradient (collective), or None when no rank holds a
        gradient for this unit."""
        shard = self.grad.shard_sized()
        if shard is None:
            return None
        if not self.is_sharded:
            return self.layout.unflatten(shard)
        full = shard.new_empty(self.layout.unsharded_numel)
        self.transport.all_gather(full, shard, self.path).wait()
        return self.layout.unflatten(full)

    def set_custom_collectives(self, all_gather: Optional[comm.UserAllGather] = None,
                              reduce_scatter: Optional[comm.UserReduceScatter] = None) -> None:
        """The user's all-gather for the unit's gathers and reduce-scatter for its reductions
        (torch's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``); None keeps the one set."""
        self.transport.set_custom(self.path, all_gather, reduce_scatter)

    def adopt_replaced_flat_param(self) -> None:
        """A client replaced ``flat_param.data`` between steps (HF Accelerate upcasts the flat
        parameters of a model loaded in bf16 to fp32 before building its optimizer, as torch's FSDP1
        lets it): the new tensor becomes the shard and everything derived from it follows. One
        pointer comparison when nothing was replaced."""
        if self.state in RESTING or not self._needs_unshard:
            flat, shard = self.flat_param, self._local_shard
            if flat.data_ptr() != shard.data_ptr() or flat.dtype != shard.dtype or flat.shape != shard.shape:
                self.adopt_converted_flat_param()

    # ----------------------------------------------------------------------------- module conversions
    @contextlib.contextmanager
    def converting(self) -> Iterator[None]:
        """Within, the owner holds the FlatParameter in place of the originals (use_orig_params), so
        that ``nn.Module._apply`` (``.to()``, ``.double()``, ``to_empty()``) converts the one tensor
        that owns the storage; on exit everything derived from it follows. The user's ``zero_grad`` on
        the originals is carried into the flat gradient first, which is converted too. A conversion
        ``_apply`` cannot do in place (off the meta device) registers a new Parameter, which becomes
        the flat parameter."""
        self.reshard()
        self.grad.take_user_changes()
        with self.views.flat_param_registered(self.flat_param, self._local_shard, self.layout):
            yield
            converted = self._owner._parameters.get(FLAT_PARAM)
        if converted is not None and converted is not self.flat_param:
            self.flat_param = FlatParameter.mark(converted)
            self._set_flat_param_metadata()
            self.grad.rebind(converted)
        self.adopt_converted_flat_param()

    def adopt_converted_flat_param(self) -> None:
        """After a dtype or device conversion of the (sharded) flat parameter: the local shard, the
        unsharded buffer, the views and the gradient follow it."""
        self._local_shard = self.flat_param.data
        if not self._offloaded:  # ``.to(device)`` moved the shard, and so where the unit computes
            self.compute_device = self._local_shard.device
        self._precision = self._precision.with_orig_dtype(self._local_shard.dtype)
        self.views.repoint(self._local_shard, self.layout)
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
        self.grad.adopt_converted(self._local_shard, self._precision, self.compute_device)

    def abandon_backward(self) -> None:
        """Undo what an aborted forward or backward left: pending all-gather finished, this backward's
        reductions dropped, the optimizer's gradient as it was before, the parameters sharded."""
        self.reshard()
        self.grad.abandon_backward()
