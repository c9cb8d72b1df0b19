"""``ParamViews``: what a unit's modules hold under their original parameter names, in each phase
of the unit. Its kinds: ``OrigParamViews`` (``orig_views``: the original Parameters stay, viewing the
shard), ``FlatParamViews`` (the FSDP1 front's ``flat_views``: the FlatParameter in their place) and the ``fully_shard``
front's ``DTensorParamViews``; the front that builds a unit chooses its kind.

Every kind keeps the registrations (``ParamSlot``: a tied parameter has several, a module registered
under two names has aliases) and assigns through a module's own ``__setattr__`` where its class
defines one (``_register``). The handle decides *when* each phase begins; the views decide *what*
the modules hold then.
"""

import contextlib
import dataclasses
import os
import weakref
from abc import ABC, abstractmethod
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .layout import GatherExtras, ParamLayout
from .traversal import ParamSlot, split_registrations

FLAT_PARAM = "_flat_param"
UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"  # torch's switch: views bypass a module's own __setattr__
FLATTENED = "_fsdp_flattened"
"""Marks an original parameter that a unit has flattened (torch's name), so that wrapping the same
module object twice is refused instead of flattening shard views a second time."""


class ParamViews(ABC):
    """The registrations of one unit's parameters, and what each holds in each phase.

    ``owner`` is the module that holds the FlatParameter when it is registered (the unit's module).
    """

    use_orig_params: bool
    """Whether the modules hold the original Parameters at rest (torch's ``use_orig_params``)."""

    def __init__(self, slots: Sequence[ParamSlot], owner: nn.Module) -> None:
        self.slots, self.shared_slots, self.alias_fqns = split_registrations(slots)
        self.owner = owner
        self.requires_grad = tuple(slot.live_param.requires_grad for slot in self.slots)
        self.shapes = tuple(slot.live_param.shape for slot in self.slots)
        self.path = ""  # the unit's clean path from its root, for messages
        # id -> (weak reference, fqn of its first registration): identity, never tensor ==
        self._managed_params: Dict[int, Tuple["weakref.ref[nn.Parameter]", str]] = {}
        self._modules_with_setattr = set() if os.environ.get(UNSAFE_SETATTR) == "1" else {
            id(slot.module) for slot in self.all_slots() if type(slot.module).__setattr__ is not nn.Module.__setattr__
        }

    # ----------------------------------------------------------------------------- registrations
    def all_slots(self) -> List[ParamSlot]:
        return list(self.slots) + [slot for slot, _ in self.shared_slots]

    @property
    def fqns(self) -> Tuple[str, ...]:
        return tuple(slot.fqn for slot in self.slots)

    def slot_fqns(self) -> List[Tuple[str, int]]:
        """Every registration's name (relative to the unit) with the index of its parameter in flat
        order: first registrations in order, then the later ones of tied parameters, then the other
        names of a module registered under several."""
        return ([(slot.fqn, i) for i, slot in enumerate(self.slots)] + [(slot.fqn, i) for slot, i in self.shared_slots]
                + list(self.alias_fqns))

    def set_path(self, path: str, layout: ParamLayout, is_resharded: bool) -> None:
        """The unit's clean path from its root, so that errors name parameters as the user's model does."""
        self.path = path

    def clean_fqn(self, slot: ParamSlot) -> str:
        """The slot's name from the root, as the user's unwrapped model names it."""
        return f"{self.path}.{slot.fqn}" if self.path else slot.fqn

    def param_modules(self) -> List[nn.Module]:
        """The modules that hold this unit's parameters, each once."""
        return list({id(slot.module): slot.module for slot in self.all_slots()}.values())

    def fqn_of(self, param: nn.Parameter) -> Optional[str]:
        """The name (relative to the unit) under which this unit flattened ``param``, if it did."""
        ref, fqn = self._managed_params.get(id(param), (None, None))
        return fqn if ref is not None and ref() is param else None

    def orig_params(self) -> List[nn.Parameter]:
        """The original parameters, in flat order (first registrations; use_orig_params)."""
        return [slot.live_param for slot in self.slots]

    def initial_values(self) -> List[torch.Tensor]:
        """The values the unit starts from, in flat order and in the layout's shapes."""
        return list(self.orig_params())

    def materialize(self, views: Sequence[torch.Tensor]) -> None:
        """Meta parameters become Parameters viewing ``views`` (their places in a new unsharded
        buffer); every registration of a tied one gets the same new Parameter."""
        replaced = {id(slot.live_param): nn.Parameter(view, requires_grad=slot.live_param.requires_grad)
                    for slot, view in zip(self.slots, views)}
        self.slots = tuple(dataclasses.replace(slot, param=replaced[id(slot.param)]) for slot in self.slots)
        self.shared_slots = tuple(
            (dataclasses.replace(slot, param=replaced[id(slot.param)]), i) for slot, i in self.shared_slots
        )
        for slot in self.all_slots():
            slot.module._parameters[slot.attr] = slot.param

    def _manage(self) -> None:
        for slot in self.all_slots():
            self._managed_params.setdefault(id(slot.param), (weakref.ref(slot.live_param), slot.fqn))
        for slot in self.slots:
            setattr(slot.param, FLATTENED, True)

    def _replace_param(self, index: int, param: nn.Parameter) -> None:
        """``param`` stands for slot ``index``'s parameter under every name it has."""
        self.slots = tuple(dataclasses.replace(s, param=param) if i == index else s for i, s in enumerate(self.slots))
        self.shared_slots = tuple(
            (dataclasses.replace(s, param=param), i) if i == index else (s, i) for s, i in self.shared_slots
        )

    def _adopt_param(self, index: int, param: nn.Parameter) -> None:
        """``param`` replaced the original parameter of slot ``index`` (and its repeats)."""
        old = self.slots[index].live_param
        self._replace_param(index, param)
        _, fqn = self._managed_params.pop(id(old))
        self._managed_params[id(param)] = (weakref.ref(param), fqn)
        setattr(param, FLATTENED, True)

    @contextlib.contextmanager
    def names_registered(self, placeholder: torch.Tensor) -> Iterator[None]:
        """``placeholder`` under every original name in the modules' ``_parameters`` for the
        duration, so that a state-dict save lists their keys where the plain model would."""
        for slot in self.all_slots():
            slot.module._parameters[slot.attr] = placeholder  # type: ignore[assignment]  # a stand-in, removed on exit
        try:
            yield
        finally:
            for slot in self.all_slots():
                slot.module._parameters.pop(slot.attr, None)

    def _register_flat_param(self, flat_param: nn.Parameter) -> None:
        """The FlatParameter joins the owner in place of the originals."""
        for slot in self.all_slots():
            del slot.module._parameters[slot.attr]
        self.owner._parameters[FLAT_PARAM] = flat_param

    def install(self, tensors: Sequence[torch.Tensor], as_parameters: bool, through_setattr: bool = False) -> None:
        """Register ``tensors`` under the original names: in ``_parameters`` (use_orig_params, and
        inside summon_full_params, so the names stay visible), else as plain attributes. Frozen
        original parameters get detached views, so autograd computes no gradient for them."""
        for slot, tensor in zip(self.slots, tensors):
            if as_parameters and slot.param is not None and not slot.param.requires_grad:
                tensor = tensor.detach()
            self._register(slot, tensor, as_parameters, through_setattr)
        for slot, primary in self.shared_slots:
            first = self.slots[primary]
            source = first.module._parameters if as_parameters else first.module.__dict__
            self._register(slot, source[first.attr], as_parameters, through_setattr)  # type: ignore[arg-type]  # set just above

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
            module._parameters[slot.attr] = tensor  # type: ignore[assignment]  # a view standing in for the Parameter
        else:
            module.__dict__[slot.attr] = tensor

    # ----------------------------------------------------------------------------- phases
    as_parameters: bool
    """Whether the modules hold the forward's views as parameters (in ``_parameters``)."""

    @abstractmethod
    def aligned_numel(self, dtype: torch.dtype) -> int:
        """The multiple each parameter's start in the flat layout is padded to (0: none)."""

    @property
    @abstractmethod
    def span_requires_grad(self) -> Tuple[bool, ...]:
        """Which parameters the optimizer's gradient must cover."""

    @abstractmethod
    def install_initial(self, flat_param: nn.Parameter, shard: torch.Tensor, unsharded: torch.Tensor, layout: ParamLayout) -> None:
        """At construction, with the unsharded buffer still alive."""

    @abstractmethod
    def repoint(self, shard: torch.Tensor, layout: ParamLayout) -> None:
        """The shard is a new tensor (construction, a dtype or device conversion)."""

    @abstractmethod
    def show_resting(self, unsharded: torch.Tensor, layout: ParamLayout) -> None:
        """Outside the unit's computation, with ``unsharded`` (the shard itself when the unit is not
        sharded) alive: it stays readable after an optimizer step changed the flat parameter."""

    @abstractmethod
    def show_sharded(self, shard: torch.Tensor, layout: ParamLayout) -> None:
        """The unsharded storage was freed."""

    @abstractmethod
    def show_kept_gathered(self) -> None:
        """After a forward whose unit stays gathered for its backward (the root, SHARD_GRAD_OP)."""

    def sync_requires_grad(self) -> Optional[Tuple[bool, ...]]:
        """The parameters' requires_grad now, if it changed since the last call (else None)."""
        return None

    def gather_extras(self) -> Optional[GatherExtras]:
        """What a gather for computing carries besides the shard: the tensors of the parameters
        gathered by their all-gather extension, in place of their places in it (None: nothing)."""
        return None

    def computes_on_resting_params(self) -> bool:
        """Whether a forward may compute on the Parameters the modules hold while the unit rests
        gathered (``resting_params_shown``), rather than on views of the flat parameter."""
        return False

    def resting_params_shown(self, unsharded: torch.Tensor) -> Optional[List[nn.Parameter]]:
        """The unsharded Parameters over ``unsharded`` the modules hold while the unit rests gathered,
        if they hold them now and a forward may compute on them as leaves of the autograd graph (the
        same objects every time, as torch's FSDP2 keeps them: a pipeline's weight pass, run after later
        forwards, reaches the ones each forward computed on). None: the forward computes on views of
        the flat parameter."""
        return None

    def new_resting_grads(self) -> Optional[List[Optional[torch.Tensor]]]:
        """The gradients a backward or a pipeline's weight pass left on those Parameters, by parameter."""
        return None

    def drop_resting_grads(self) -> None:
        """Those gradients joined the unit's flat gradient."""

    def take_user_changes(self, is_gathered_for_backward: bool, layout: ParamLayout) -> bool:
        """Take into the shard what the user assigned to an original parameter; whether any was."""
        return False

    def registered(self) -> List[Optional[nn.Parameter]]:
        """What each parameter's first registration holds now."""
        return [slot.module._parameters.get(slot.attr) for slot in self.slots]

    def register(self, params: Sequence[Optional[nn.Parameter]]) -> None:
        """Put back what ``registered`` returned (None: left as it is)."""
        for slot, param in zip(self.slots, params):
            if param is not None:
                slot.module._parameters[slot.attr] = param

    def replacement(self) -> Optional[torch.Tensor]:
        """While the shard is on the meta device: a real tensor registered in a parameter's place
        since, whose device and dtype the shard must be materialised in to take it (None: none)."""
        return None

    def still_on_meta(self) -> List[str]:
        """The clean FQNs of the parameters that have no values off the meta device yet."""
        return []

    def show_grads(self, grad: Optional[torch.Tensor], layout: ParamLayout, start: int) -> None:
        """The optimizer's gradient ``grad`` (over the shard from element ``start``) was handed over."""

    def show_unreduced_grads(self, flat_grad: Optional[torch.Tensor], layout: ParamLayout) -> None:
        """Inside ``no_sync``, after a backward: ``flat_grad`` holds this rank's unreduced sums (None:
        they are kept apart, in ``reduce_dtype``)."""

    tracks_arrivals = False
    """Whether a parameter no backward gave a gradient shows None rather than zeros, and the
    parameters' post-accumulate-grad hooks run once a backward reduced their gradients
    (``grads_arrived``), as under torch's FSDP2; FSDP1 shows the flat gradient's zeros."""

    def grads_arrived(self, arrived: Sequence[bool]) -> None:
        """A backward reduced the gradient, which the next ``show_grads`` shows; ``arrived``: which
        parameters autograd gave one since the last reduction (``tracks_arrivals`` only)."""

    writes_show_in_shard = False
    """Whether every in-place write to the parameters (an optimizer step) bumps the shard's version
    counter: their tensors are views of the shard. FSDP1's are re-pointed through ``.data``, which
    keeps a counter of their own, so a copy gathered from their shard counts as stale."""

    holds_grad = False
    """Whether the optimizer's gradient lives only as long as the parameters' ``.grad`` views of it
    (the views keep it; the handle holds it weakly, through ``held_grad``)."""

    def held_grad(self) -> Optional[torch.Tensor]:
        """The optimizer's gradient, while a ``.grad`` still views it (``holds_grad`` only)."""
        return None

    def every_grad_dropped(self) -> bool:
        """Whether the user set every original parameter's ``.grad`` to None."""
        return False

    def take_user_grads(self) -> bool:
        """Carry the user's changes of the original parameters' ``.grad`` into the optimizer's
        gradient; False once every part is None (the gradient is then freed)."""
        return True

    @abstractmethod
    def expose_full(self, flat_param: nn.Parameter, views: List[torch.Tensor]) -> List[nn.Parameter]:
        """``summon_full_params``: the modules hold full parameters viewing ``views``."""

    @abstractmethod
    def hide_full(self, flat_param: nn.Parameter, shard: torch.Tensor, layout: ParamLayout) -> None:
        """Leaving ``summon_full_params`` (the unsharded buffer is freed)."""

    def registered_full_params(self, exposed: List[nn.Parameter]) -> List[nn.Parameter]:
        """What the modules hold under each original name now: the parameter exposed, or one the
        caller assigned in its place, whose values are then written back."""
        registered = [slot.module._parameters.get(slot.attr) for slot in self.slots]
        return [param if current is None else current for param, current in zip(exposed, registered)]

    def adopt_replaced(self, exposed: List[nn.Parameter], registered: List[nn.Parameter]) -> None:
        """A parameter assigned in place of an exposed one inside ``summon_full_params``."""

    @contextlib.contextmanager
    def flat_param_registered(self, flat_param: nn.Parameter, shard: torch.Tensor, layout: ParamLayout) -> Iterator[None]:
        """Within, the owner holds the FlatParameter (so ``nn.Module._apply`` converts it)."""
        yield


def assign_grad(param: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """``param.grad = grad``, also for a gradient kept in lower precision than the parameter
    (keep_low_precision_grads) or of the full shape while the parameter is a shard (``no_sync``),
    which autograd's setter refuses: it gets a stand-in of the right dtype and shape (no storage of
    that size), whose data is then swapped, as torch's does."""
    if grad is None or (grad.dtype, grad.shape) == (param.dtype, param.shape):
        param.grad = grad
        return
    param.grad = torch.empty(1, dtype=param.dtype, device=param.device).expand(param.shape)
    param.grad.data = grad
