"""``OrigParamViews``: the views of ``use_orig_params=True`` (and the base of ``fully_shard``'s
DTensor views). The original ``nn.Parameter`` objects stay registered; at rest they view this rank's
part of the shard (an optimizer built on ``model.parameters()`` steps them, and their ``.grad``
views the sharded gradient); during computation the modules hold views of the unsharded flat
parameter.

Frozen parameters are laid out after the trainable ones (the slot order), so the trainable
elements of each shard are one contiguous span and the gradient kept between steps covers that
span only (pytorch#104690; see ``FlatGrad``). What the user assigns to an original parameter between
steps (a new ``Parameter`` in its place, or new ``.data``) becomes part of the shard at the next
forward, state dict or ``summon_full_params``, as under torch's FSDP1; a shape other than the
resting view's raises instead of being dropped. Writes into the shard from outside autograd go
through ``.data``, so that the flat parameter's version counter, which the views a pending backward
saved check, does not move. Where a module's class overrides ``__setattr__``, views are assigned
through it, as torch's does.
"""

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .layout import ParamLayout
from .shard_math import ALIGNMENT_BYTES
from .traversal import ParamSlot
from .views import FLAT_PARAM, ParamViews, assign_grad


class OrigParamViews(ParamViews):
    """use_orig_params=True: the original Parameters stay, viewing the shard at rest."""

    use_orig_params = True

    as_parameters = True

    def __init__(self, slots: Sequence[ParamSlot], owner: nn.Module) -> None:
        # frozen parameters last, so that the trainable ones' gradient is contiguous
        super().__init__(sorted(slots, key=lambda slot: not slot.live_param.requires_grad), owner)
        self._resting_views: List[torch.Tensor] = []  # what the originals view at rest
        self._grad_views: List[Optional[torch.Tensor]] = []  # what their .grad views of the optimizer's gradient

    def aligned_numel(self, dtype: torch.dtype) -> int:
        return ALIGNMENT_BYTES // dtype.itemsize

    @property
    def span_requires_grad(self) -> Tuple[bool, ...]:
        return self.requires_grad

    def install_initial(self, flat_param: nn.Parameter, shard: torch.Tensor, unsharded: torch.Tensor, layout: ParamLayout) -> None:
        self._manage()
        self.repoint(shard, layout)

    def repoint(self, shard: torch.Tensor, layout: ParamLayout) -> None:
        self._resting_views = layout.local_views(shard)
        with torch.no_grad():
            for slot, view in zip(self.slots, self._resting_views):
                slot.live_param.data = view

    def _show_originals(self) -> None:
        """The original Parameters under their names again, also where the caller assigned another."""
        for slot in self.all_slots():
            self._register(slot, slot.live_param, as_parameter=True, through_setattr=True)

    def show_resting(self, unsharded: torch.Tensor, layout: ParamLayout) -> None:
        self._show_originals()

    def show_sharded(self, shard: torch.Tensor, layout: ParamLayout) -> None:
        self._show_originals()

    def show_kept_gathered(self) -> None:
        self._show_originals()

    def sync_requires_grad(self) -> Optional[Tuple[bool, ...]]:
        requires_grad = tuple(slot.live_param.requires_grad for slot in self.slots)
        if requires_grad == self.requires_grad:
            return None
        self.requires_grad = requires_grad
        return requires_grad

    def take_user_changes(self, is_gathered_for_backward: bool, layout: ParamLayout) -> bool:
        """As torch's: a new ``Parameter`` assigned in an original's place (it becomes the original;
        its gradient starts empty) or new ``.data`` assigned to one. Either must have the shape the
        parameter has at rest (its 1-D part of this rank's shard when sharded); anything else would
        be dropped silently, so it raises. Between a forward and its backward while the unit stays
        gathered the backward computes on the gathered values, so a change there is refused
        (``is_gathered_for_backward``). One identity and one pointer check per parameter when
        nothing changed."""
        written = False
        for index, (slot, view) in enumerate(zip(self.slots, self._resting_views)):
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
                    f"on rank {layout.rank} but its part of this rank's shard is {tuple(view.shape)}. Assign values "
                    "inside summon_full_params() (full shapes), or keep the shape the parameter has now."
                )
            with torch.no_grad():  # through ``.data``: the shard's version counter is the flat parameter's
                view.data.copy_(current.detach())
            if current is not slot.param:
                self._adopt_param(index, current)
            current.data = view
            written = True
        for slot, primary in self.shared_slots:
            if slot.module._parameters.get(slot.attr, self.slots[primary].param) is not self.slots[primary].param:
                raise NotImplementedError(
                    f"fsdp1: '{self.clean_fqn(slot)}' and '{self.clean_fqn(self.slots[primary])}' shared one parameter when the unit was "
                    "built, and one of them was replaced since; changing shared parameters after wrapping is "
                    "not supported. Assign new values in place (param.data.copy_(...)) instead."
                )
        return written

    def show_grads(self, grad: Optional[torch.Tensor], layout: ParamLayout, start: int) -> None:
        """Views of ``grad`` on the original parameters (``None`` for frozen ones and for those with no
        element in this rank's shard, as torch's)."""
        if grad is None:
            self._grad_views = []
            for slot in self.slots:
                slot.live_param.grad = None
            return
        self._grad_views = [
            layout.local_view(grad, index, start) if requires_grad and info.in_shard else None
            for index, (info, requires_grad) in enumerate(zip(layout.shard_infos, self.requires_grad))
        ]
        for slot, view in zip(self.slots, self._grad_views):
            assign_grad(slot.live_param, view)

    def show_unreduced_grads(self, flat_grad: Optional[torch.Tensor], layout: ParamLayout) -> None:
        """Each original parameter's ``.grad`` is its full-shape part of the local sum, as torch's shows
        it, for code that reads or clips gradients between micro-batches. Remade after every backward:
        autograd may replace the accumulated tensor instead of adding into it."""
        assert flat_grad is not None, "FSDP1 keeps the local sum on the flat parameter"
        self._grad_views = []  # not the optimizer's gradient: nothing to write back into it
        for slot, grad, requires_grad in zip(self.slots, layout.unflatten(flat_grad), self.requires_grad):
            assign_grad(slot.live_param, grad if requires_grad else None)

    def every_grad_dropped(self) -> bool:
        return all(slot.live_param.grad is None for slot in self.slots)

    def take_user_grads(self) -> bool:
        if not self._grad_views:
            return True
        if self.every_grad_dropped():  # zero_grad(): nothing to keep
            return False
        any_grad = False
        with torch.no_grad():
            for slot, view in zip(self.slots, self._grad_views):
                if view is None:
                    continue
                grad = slot.live_param.grad
                if grad is None:
                    view.zero_()
                    continue
                any_grad = True
                if grad is not view:
                    view.copy_(grad)
        return any_grad

    def expose_full(self, flat_param: nn.Parameter, views: List[torch.Tensor]) -> List[nn.Parameter]:
        exposed = self.orig_params()
        for param, view in zip(exposed, views):
            param.data = view
        self._show_originals()
        return exposed

    def hide_full(self, flat_param: nn.Parameter, shard: torch.Tensor, layout: ParamLayout) -> None:
        self.repoint(shard, layout)
        self._show_originals()

    def adopt_replaced(self, exposed: List[nn.Parameter], registered: List[nn.Parameter]) -> None:
        for index, (param, current) in enumerate(zip(exposed, registered)):
            if current is not param:
                self._adopt_param(index, current)

    @contextlib.contextmanager
    def flat_param_registered(self, flat_param: nn.Parameter, shard: torch.Tensor, layout: ParamLayout) -> Iterator[None]:
        self._register_flat_param(flat_param)
        try:
            yield
        finally:
            del self.owner._parameters[FLAT_PARAM]
            self._show_originals()
