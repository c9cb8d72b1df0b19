"""A unit's gradient: from the unsharded gradient autograd accumulates to the sharded one the
optimizer steps with, across backwards, ``no_sync`` and aborted iterations.

``FlatGrad`` owns every gradient tensor of one handle but the one autograd writes
(``flat_param.grad`` while a backward runs) and the reduction's configuration (communication hook,
divide factors); it starts each reduction (a ``GradReduction``, which the root's state finishes in
order). Its phases, and the only moves between them:

    SHARDED ──begin_backward──▶ BACKWARD ──finish_backward / abandon──▶ SHARDED
    LOCAL ──begin_backward──▶ LOCAL_BACKWARD ──finish_backward / abandon──▶ LOCAL
    BACKWARD ──keep_unreduced (no_sync)──▶ LOCAL_BACKWARD ──reduce──▶ BACKWARD
    LOCAL ──every original parameter's .grad set to None──▶ SHARDED

Every move goes through ``_move``, which refuses any other (an internal error naming the phases).

Gradients are set aside when they are about to arrive (``begin_backward``, from the prehook of
the node that assembles the unsharded gradient), not at the next forward: a forward that no backward
follows (a metric between backward and step) cannot lose them, and a backward that raises leaves
them as they were, since its reductions add up apart and join ``.grad`` only in the final callback.
"""

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple, cast

import torch

from . import collectives as comm
from .device import run_on_stream, wait_for_device
from .dtensors import is_wrapper_subclass
from .layout import ParamLayout, free_storage
from .mixed_precision import HandlePrecision
from .shard_math import gradient_divide_factors
from .transport import Transport
from .views import ParamViews, assign_grad


def plain_gradient(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad`` in ``dtype`` as a plain tensor. A gradient that is a tensor subclass of several tensors
    (a module computing on one, torch's ``TwoTensor``) writes itself into a plain tensor as its own
    ``copy_`` decides, as it does into torch's reduce-scatter input, so the reduction sees torch's
    values."""
    if is_wrapper_subclass(grad):
        plain = torch.empty(grad.shape, dtype=dtype, device=grad.device)
        plain.copy_(grad)
        return plain
    return grad.to(dtype)


class GradPhase(Enum):
    SHARDED = auto()
    """Between steps: the optimizer's sharded gradient (or none) is in place."""
    BACKWARD = auto()
    """A backward is under way: the optimizer's gradient is set aside, this backward's reductions add up."""
    LOCAL = auto()
    """Inside ``no_sync``, between backwards: ``flat_param.grad`` holds this rank's unreduced sum."""
    LOCAL_BACKWARD = auto()
    """A backward is under way on top of an unreduced sum, which autograd adds to."""


_MOVES: Dict[GradPhase, FrozenSet[GradPhase]] = {
    GradPhase.SHARDED: frozenset({GradPhase.BACKWARD}),
    GradPhase.BACKWARD: frozenset({GradPhase.SHARDED, GradPhase.LOCAL_BACKWARD}),
    GradPhase.LOCAL: frozenset({GradPhase.LOCAL_BACKWARD, GradPhase.SHARDED}),
    GradPhase.LOCAL_BACKWARD: frozenset({GradPhase.LOCAL, GradPhase.BACKWARD}),
}
_UNREDUCED = (GradPhase.LOCAL, GradPhase.LOCAL_BACKWARD)
_IN_BACKWARD = (GradPhase.BACKWARD, GradPhase.LOCAL_BACKWARD)


@dataclass(frozen=True)
class CommHook:
    """A hook ``register_comm_hook`` installed: ``hook(state, grad, output)`` for a sharded unit,
    ``hook(state, grad)`` otherwise. ``casts_itself``: a low-precision hook, which reduces in its own
    dtype and casts back, so the unit does neither."""

    hook: Callable[..., object]
    state: object
    casts_itself: bool

    def reduce(self, grad: torch.Tensor, output: Optional[torch.Tensor]) -> Optional[comm.Waitable]:
        """Start (or do) the reduction; what is still in flight if the hook returned it, else None."""
        result = self.hook(self.state, grad) if output is None else self.hook(self.state, grad, output)
        return cast(comm.Waitable, result) if callable(getattr(result, "wait", None)) else None


@dataclass
class GradReduction:
    """A gradient reduce-scatter (or all-reduce) in flight for one unit."""

    grad: "FlatGrad"
    work: Optional[comm.Waitable]  # None: a comm hook finished it already
    unsharded_grad: torch.Tensor  # kept alive until the collective has read it
    reduced: torch.Tensor
    frees_input: bool = False
    """Free the unsharded gradient's storage once the collective has read it (a reduce-scatter of
    fsdp1's own): a gloo worker drops its reference a moment after the wait, which would otherwise
    keep it alive past the next allocation, or not, by the threads' timing."""

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.frees_input:
            free_storage(self.unsharded_grad)
        self.grad.add_reduced(self.reduced)


@dataclass
class ReduceSettings:
    """How a unit's gradient is reduced, as its front configures it. The front keeps this object and
    its setters change it (``register_comm_hook``, ``set_gradient_divide_factor``,
    ``set_requires_all_reduce``, ``set_all_reduce_hook``); the gradient only reads it."""

    divide_factor: Optional[float] = None
    """Divide the summed gradient by this, once after the reduction; None: the mean over the ranks,
    divided partly before the reduction and partly after (torch's FSDP1, which keeps fp16 in range)."""
    comm_hook: Optional[CommHook] = None
    """``register_comm_hook``'s, replacing the reduction."""
    all_reduces_replicas: bool = True
    """Hybrid: False leaves the all-reduce over the replicas to a later backward, which adds the kept sums first."""
    after_reduce: Optional[Callable[[torch.Tensor], None]] = None
    """Called with the reduced shard, after the all-reduce over the replicas (``set_all_reduce_hook``)."""
    after_reduce_stream: Optional[Any] = None
    """The stream ``after_reduce`` runs on (None: the current one)."""


class FlatGrad:
    """The gradient of one handle's flat parameter.

    The optimizer's gradient covers the *gradient span* of the shard: all of it, unless frozen
    original parameters (use_orig_params) lie at its end, which then cost no gradient memory (torch's
    keeps it, pytorch#104690). Over the whole shard it is ``flat_param.grad``, where a flat-parameter
    optimizer's ``zero_grad`` acts; over a part it is kept here and shown only through the original
    parameters' ``.grad``.
    """

    def __init__(self, flat_param: torch.nn.Parameter, layout: ParamLayout, views: ParamViews,
                 transport: Transport, precision: HandlePrecision, settings: ReduceSettings,
                 in_full_precision: Callable[[], bool], compute_device: torch.device, offloaded: bool) -> None:
        self._flat_param = flat_param
        self._layout = layout
        self._views = views
        self._transport = transport
        self._group = transport.group
        self._replicate_group = replicate_group = transport.replicate_group
        self.settings = settings
        self.precision = precision
        self._in_full_precision = in_full_precision  # evaluation in full precision right now
        self.compute_device = compute_device
        self._offloaded = offloaded
        self.path = ""  # the unit's clean path, for messages
        replicas = comm.group_size(replicate_group) if replicate_group is not None else 1
        self._mean_divide_factors = gradient_divide_factors(layout.world_size * replicas)
        self._unreplicated: Optional[torch.Tensor] = None  # reductions the replicas have not summed yet
        self.phase = GradPhase.SHARDED
        self.span = self._trainable_span()
        self._before_backward: Optional[torch.Tensor] = None  # the optimizer's gradient, set aside
        self._this_backward: Optional[torch.Tensor] = None  # this backward's reduced gradient
        self._span_grad: Optional[torch.Tensor] = None  # the optimizer's gradient when the span is partial
        self._arrived: Optional[List[bool]] = None  # by parameter, since the last reduction (tracks_arrivals)
        self._unreduced_sum: Optional[torch.Tensor] = None  # earlier backwards' local sum (accumulates_in_reduce_dtype)
        self._skipped: FrozenSet[int] = frozenset()  # the parameters the reduction in flight leaves out (frozen)

    def rebind(self, flat_param: torch.nn.Parameter) -> None:
        """The handle's flat parameter is a new object (converted off the meta device)."""
        self._flat_param = flat_param

    @property
    def _divide_factors(self) -> Tuple[float, float]:
        """What the gradient is divided by before the reduction and after it."""
        factor = self.settings.divide_factor
        return self._mean_divide_factors if factor is None else (1.0, factor)

    def _move(self, phase: GradPhase) -> None:
        if phase is not self.phase and phase not in _MOVES[self.phase]:
            raise RuntimeError(f"fsdp1 internal error: unit '{self.path}' moved its gradient from {self.phase.name} to {phase.name}")
        self.phase = phase

    @property
    def is_unreduced(self) -> bool:
        """``flat_param.grad`` holds local sums (inside ``no_sync``)."""
        return self.phase in _UNREDUCED

    @property
    def arrived_this_backward(self) -> bool:
        """Autograd assembled this unit's unsharded gradient in the backward running now."""
        return self.phase in _IN_BACKWARD

    # ----------------------------------------------------------------------------- the optimizer's gradient
    @property
    def for_optim(self) -> Optional[torch.Tensor]:
        """The sharded gradient the optimizer steps with (None if there is none)."""
        return None if self.is_unreduced else self._optim_grad

    @property
    def _optim_grad(self) -> Optional[torch.Tensor]:
        if self._views.holds_grad:
            return self._views.held_grad()
        return self._flat_param.grad if self._span_is_whole_shard() else self._span_grad

    def _span_is_whole_shard(self) -> bool:
        return self.span == (0, self._layout.shard_numel)

    def _set_for_optim(self, grad: Optional[torch.Tensor]) -> None:
        """Hand ``grad`` (over the span) to the optimizer: as the flat parameter's ``.grad`` when it
        covers the whole shard, and through the views on the original parameters."""
        if self._views.holds_grad:  # the views alone hold it, so that zero_grad() frees it
            self._flat_param.grad = self._span_grad = None
        elif self._span_is_whole_shard():
            assign_grad(self._flat_param, grad)
            self._span_grad = None
        else:
            self._flat_param.grad, self._span_grad = None, grad
        self._views.show_grads(grad, self._layout, self.span[0])

    def reshow(self) -> None:
        """The original parameters show the optimizer's gradient again (after showing full ones)."""
        self._views.show_grads(self._optim_grad, self._layout, self.span[0])

    def take_user_changes(self) -> None:
        """Carry what the user did to the original parameters' ``.grad`` into the flat gradient:
        ``None`` (``zero_grad``) zeroes that part, and frees the flat gradient once every part is
        ``None``; a replaced tensor is copied in. Idempotent, so the root runs it at every forward
        (freeing zeroed gradients before the forward, as torch's) and backward runs it again. Inside
        ``no_sync`` a ``zero_grad`` of every original parameter drops the local accumulation."""
        if self.is_unreduced and self._views.every_grad_dropped():
            self._flat_param.grad = self._unreduced_sum = None
            self._move(GradPhase.SHARDED if self.phase is GradPhase.LOCAL else GradPhase.BACKWARD)
        if self._optim_grad is not None and not self._views.take_user_grads():
            self._set_for_optim(None)

    def respan(self, requires_grad: Tuple[bool, ...]) -> None:
        """Parameters were frozen or unfrozen: the kept gradients move to the new span (zeros where
        they had no values)."""
        grad = self._optim_grad
        old_span, self.span = self.span, self._trainable_span(requires_grad)
        if self._before_backward is not None:
            self._before_backward = self._respan(self._before_backward, old_span)
        if grad is not None:
            self._set_for_optim(self._respan(grad, old_span))

    def _trainable_span(self, requires_grad: Optional[Tuple[bool, ...]] = None) -> Tuple[int, int]:
        requires_grad = self._views.span_requires_grad if requires_grad is None else requires_grad
        if all(requires_grad):
            return 0, self._layout.shard_numel
        return self._layout.trainable_span(requires_grad)

    def _respan(self, grad: torch.Tensor, old_span: Tuple[int, int]) -> torch.Tensor:
        (old_lo, old_hi), (lo, hi) = old_span, self.span
        moved = grad.new_zeros(hi - lo)
        start, end = max(lo, old_lo), min(hi, old_hi)
        if start < end:
            moved[start - lo : end - lo] = grad[start - old_lo : end - old_lo]
        return moved

    def shard_sized(self) -> Optional[torch.Tensor]:
        """The optimizer's gradient over the whole shard on the compute device (zeros outside the
        span), or None when no rank has one (collective: every rank of the group answers)."""
        if self.is_unreduced:
            raise RuntimeError(
                f"fsdp1: summon_full_params(with_grads=True) inside no_sync() for unit with {self._views.fqns[:3]}: "
                "the gradients are this rank's unreduced sums. Call it after the backward that synchronises them."
            )
        self.take_user_changes()  # a zero_grad() on the original parameters since the last step counts
        grad = self._optim_grad
        flag = torch.tensor([0.0 if grad is None else 1.0], device=self.compute_device)
        comm.all_reduce(flag, self._group).wait()
        if flag.item() == 0.0:
            return None
        shard = torch.zeros(self._layout.shard_numel, dtype=self._flat_param.dtype, device=self.compute_device)
        if grad is not None:
            lo, hi = self.span
            shard[lo:hi] = grad
        return shard

    def adopt_converted(self, like: torch.Tensor, precision: HandlePrecision, compute_device: torch.device) -> None:
        """The flat parameter changed dtype or device: so does the kept gradient (a whole-shard one was
        converted with it)."""
        self.precision, self.compute_device = precision, compute_device
        if not self.is_unreduced:
            grad = self._optim_grad
            self._set_for_optim(None if grad is None else grad.to(like))

    # ----------------------------------------------------------------------------- one backward
    def begin_backward(self) -> None:
        """Once per backward, before autograd accumulates this unit's unsharded gradient: move the
        optimizer's sharded gradient aside, so that this backward's reduction adds onto it.

        Doing this when the gradient is about to arrive, not at the next forward, keeps ``.grad``
        intact through forwards that no backward follows (a metric between backward and step). A
        gradient left unreduced by ``no_sync`` stays on ``flat_param.grad``, where autograd adds this
        backward's local gradient to it.
        """
        if self.phase in _IN_BACKWARD:
            return
        if self.phase is GradPhase.LOCAL:
            self._move(GradPhase.LOCAL_BACKWARD)
            return
        self.take_user_changes()
        before = self._optim_grad  # in param_dtype under keep_low_precision_grads: accumulate in full
        self._before_backward = None if before is None else before.to(self.precision.orig_dtype)
        self._span_grad = self._flat_param.grad = None
        self._move(GradPhase.BACKWARD)

    def note_arrivals(self, piece_grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Autograd is about to assemble the unsharded gradient from these pieces' gradients: which
        parameters got one, for views that show None for the others."""
        if self._views.tracks_arrivals:
            self.note_params_given(self._layout.params_given(piece_grads))

    def sums_apart(self, dtype: torch.dtype) -> bool:
        """Whether unreduced gradients of ``dtype`` add up apart, in ``reduce_dtype`` (``keep_unreduced``)."""
        return self.precision.accumulates_in_reduce_dtype and dtype != self.precision.reduce_dtype

    def note_params_given(self, given: Sequence[bool]) -> None:
        """Which parameters got a gradient, by parameter (the resting Parameters' own)."""
        if self._views.tracks_arrivals:
            self._arrived = list(given) if self._arrived is None else [a or b for a, b in zip(self._arrived, given)]

    def keep_unreduced(self) -> None:
        """Inside ``no_sync``: leave the local gradient sum on ``flat_param.grad`` for later steps, or
        (``accumulates_in_reduce_dtype``, computing in lower precision) add it to a sum apart in
        ``reduce_dtype``, so that the micro-batches add up without rounding to ``param_dtype``."""
        self._move(GradPhase.LOCAL_BACKWARD)
        grad = self._flat_param.grad
        if grad is None or not self.sums_apart(grad.dtype):
            return
        self._flat_param.grad = None
        if self._unreduced_sum is None:
            self._unreduced_sum = grad.to(self.precision.reduce_dtype)
        else:
            self._unreduced_sum += grad

    def reduce(self) -> GradReduction:
        """Start reducing this backward's unsharded gradient in reduce_dtype: mean over the ranks, this
        rank's shard kept. Under a hybrid strategy the shard is all-reduced across the replicas when
        it is finished."""
        if self.phase not in _IN_BACKWARD:
            raise RuntimeError(f"fsdp1 internal error: unit '{self.path}' reduced its gradient in phase {self.phase.name}")
        grad, unreduced_sum = self._flat_param.grad, self._unreduced_sum
        self._flat_param.grad = self._unreduced_sum = None
        if grad is not None:
            grad = plain_gradient(grad, grad.dtype)
        if unreduced_sum is not None:  # alone where the last backward's gradient joined it already
            grad = unreduced_sum if grad is None else unreduced_sum.add_(grad)
        assert grad is not None, "the post-backward hook runs once autograd has accumulated the gradient"
        hook = self.settings.comm_hook
        casts_itself = hook is not None and hook.casts_itself
        if grad.dtype != self.precision.reduce_dtype and not self._in_full_precision() and not casts_itself:
            grad = grad.to(self.precision.reduce_dtype)
        self._move(GradPhase.BACKWARD)
        if grad.numel() != self._layout.unsharded_numel:
            raise RuntimeError(
                f"fsdp1 internal error: unit with {self._views.fqns[:3]}... got a gradient of {grad.numel()} "
                f"elements, expected {self._layout.unsharded_numel}"
            )
        sharded = self._layout.is_sharded
        self._skipped = self._frozen() if sharded and hook is None and self._layout.world_size > 1 else frozenset()
        grad = self._layout.reduce_input(grad, self._skipped)
        if hook is not None:
            reduced = grad.new_empty(grad.numel() // self._layout.world_size) if sharded else grad
            return GradReduction(self, hook.reduce(grad, reduced if sharded else None), grad, reduced)
        pre_divide = self._divide_factors[0]
        if pre_divide > 1:
            grad.div_(pre_divide)
        if not sharded:
            return GradReduction(self, self._transport.all_reduce(grad, self.path), grad, grad)
        work, reduce_input, reduced, frees_input = self._transport.reduce_scatter(grad, self.path, self._skipped)
        return GradReduction(self, work, reduce_input, reduced, frees_input)

    def _frozen(self) -> FrozenSet[int]:
        """The parameters the reduction leaves out: the frozen ones, where the layout reduces by
        parameter (not all of them: a unit with nothing to train reduces nothing anyway)."""
        frozen = frozenset(index for index, trainable in enumerate(self._views.requires_grad) if not trainable)
        return frozen if self._layout.reduces_by_parameter and len(frozen) < len(self._views.requires_grad) else frozenset()

    def add_reduced(self, reduced: torch.Tensor) -> None:
        """A reduction finished: all-reduce it over the replicas (hybrid strategies), keep the span,
        divide, cast and (offloaded) copy it to the CPU, and add it to this backward's gradient.
        Without ``all_reduces_replicas`` a hybrid unit keeps the sum over its shard group apart, and
        the next backward that all-reduces adds it in first (the gradient is unchanged until then)."""
        reduced = self._layout.shard_of_reduced(reduced, self._skipped)
        if self._replicate_group is not None:
            if self._unreplicated is not None:
                reduced += self._unreplicated
                self._unreplicated = None
            if not self.settings.all_reduces_replicas:
                self._unreplicated = reduced
                return
            self._transport.all_reduce(reduced, self.path, replicas=True).wait()
        if not self._span_is_whole_shard():  # frozen parameters keep no gradient
            lo, hi = self.span
            reduced = reduced[lo:hi].clone()
        post_divide = self._divide_factors[1]
        if post_divide != 1 and self.settings.comm_hook is None:  # a hook divides as it sees fit
            reduced.div_(post_divide)
        if self.settings.after_reduce is not None:
            run_on_stream(self.settings.after_reduce_stream, self.settings.after_reduce, reduced)
        if not (self._keeps_low_precision and not self._layout.is_sharded):  # NO_SHARD keeps it as reduced, as torch's
            reduced = reduced.to(self.precision.orig_dtype)
        if self._offloaded:
            reduced = to_host(reduced)  # still in flight: finish_backward waits
        if self._this_backward is None:
            self._this_backward = reduced
        else:
            self._wait_for_offloaded()
            self._this_backward += reduced

    def finish_backward(self) -> None:
        """End of backward: the optimizer's gradient is the earlier one plus this backward's reduction.
        A unit this backward never reached keeps its gradient as it was."""
        if self.phase is GradPhase.LOCAL_BACKWARD:
            self._move(GradPhase.LOCAL)
            self._views.show_unreduced_grads(self._flat_param.grad, self._layout)
            return
        if self.phase is not GradPhase.BACKWARD:
            return
        self._move(GradPhase.SHARDED)
        self._wait_for_offloaded()
        before, reduced = self._before_backward, self._this_backward
        self._before_backward = self._this_backward = None
        if before is not None and reduced is not None:
            before += reduced
        grad = reduced if before is None else before
        if grad is not None and self._keeps_low_precision and self._layout.is_sharded:
            grad = grad.to(self.precision.param_dtype)  # not sharded: left in reduce_dtype, as torch's
        if reduced is not None and self._arrived is not None:
            self._views.grads_arrived(self._arrived)
        self._arrived = None
        self._set_for_optim(grad)

    def abandon_backward(self) -> None:
        """An aborted backward: its reductions are dropped, the optimizer's gradient is as before."""
        if self.phase is GradPhase.BACKWARD:
            self._move(GradPhase.SHARDED)
            self._flat_param.grad = None
            self._arrived = None
            self._set_for_optim(self._before_backward)
        elif self.phase is GradPhase.LOCAL_BACKWARD:
            self._move(GradPhase.LOCAL)
        self._before_backward = self._this_backward = None

    def _wait_for_offloaded(self) -> None:
        """Copies of reduced gradients to the CPU run asynchronously on the compute device's stream;
        wait for them before the CPU reads one (after the first wait the stream is idle)."""
        if self._offloaded and self._this_backward is not None:
            wait_for_device(self.compute_device)

    @property
    def _keeps_low_precision(self) -> bool:
        return self.precision.keep_low_precision_grads and not self._in_full_precision()


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``, in pinned memory so that the copy is asynchronous; the caller waits
    (``wait_for_device``) before reading it."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    host.copy_(tensor, non_blocking=True)
    return host
