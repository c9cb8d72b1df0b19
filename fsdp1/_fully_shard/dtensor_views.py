"""What a ``fully_shard`` module's parameters are: DTensors over its mesh at rest, plain unsharded
tensors while it computes.

``DTensorParamViews`` is the third kind of ``ParamViews``. At rest every original name holds a
DTensor ``nn.Parameter`` (placed as its ``ParamSharding`` says) whose local tensor is a view of this
rank's part of the unit's shard, so an optimizer built on ``model.parameters()`` updates the shard
in place; its ``.grad`` is a DTensor viewing the sharded gradient the same way. A forward installs
views of the unsharded buffer (the tensor-parallel DTensors over them, for parameters that were
DTensors), which stay registered as long as the unit stays gathered (the root after its forward, a
unit told not to reshard), as torch's FSDP2 leaves its unsharded parameters registered.
"""

import contextlib
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._engine.layout import GatherExtras, ParamLayout
from .._engine.orig_views import OrigParamViews
from .._engine.traversal import ParamSlot
from .._engine.views import FLATTENED
from .._torch_internals import dtensor, is_view, local_tensor, post_accumulate_grad_hooks, rebind, spec_of
from .extensions import ExtensionGather, GatherContext, has_extension
from .param_sharding import ParamSharding


class DTensorParamViews(OrigParamViews):
    """fully_shard: DTensor parameters at rest, viewing the shard; the forward's plain views while
    the unit is gathered."""

    def __init__(self, slots: Sequence[ParamSlot], owner: nn.Module, shardings: Dict[int, ParamSharding],
                 gather_context: GatherContext) -> None:
        """``shardings``: each parameter's, by the id of the parameter; ``gather_context``: what
        all-gather extensions are given."""
        super().__init__(slots, owner)
        self._gather_context = gather_context
        self._extensions: Dict[int, ExtensionGather] = {}  # by parameter, for those gathered by their extension
        self.shardings = [shardings[id(slot.live_param)] for slot in self.slots]
        self.shapes = tuple(sharding.local_shape for sharding in self.shardings)  # what the layout splits
        # The optimizer's gradient is held by the .grad DTensors alone (their local tensors view it),
        # so that zero_grad() frees it, as under torch's FSDP2; these are weak.
        self._grad: Optional["weakref.ref[torch.Tensor]"] = None
        self._grads_shown: List[Optional["weakref.ref[DTensor]"]] = []  # by parameter
        self._grad_layout: Optional[Tuple[ParamLayout, int]] = None  # where each part of it lies
        self._has_grad = [False] * len(self.slots)  # a backward gave it one since the user last dropped it
        self._hooks_due: Sequence[bool] = ()  # whose post-accumulate-grad hooks the next show_grads runs
        # Each original Parameter the DTensors replaced, by id, held weakly (its storage must go) with
        # where it was registered: a tied registration elsewhere still holds it.
        self.replaced: Dict[int, Tuple["weakref.ref[nn.Parameter]", nn.Module, str]] = {}
        self._installed: Optional[List[torch.Tensor]] = None  # what install() registered; None: the DTensors
        self._awaiting_values: Set[int] = set()  # materialised off the meta device for others, never given values
        self._member_paths: Dict[int, str] = {}  # a group of several modules: each one's modules' path, by id
        self._made_for_compute: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # by parameter: (view, its DTensor)
        # The unsharded Parameters the unit rests gathered with, and the buffer they view: the same
        # objects every time, so that autograd accumulates every forward's gradient on them.
        self._resting: Optional[Tuple[torch.Tensor, List[nn.Parameter]]] = None
        self._shows_resting = False  # the modules hold them now
        self.grad_dtype_of_resting: Callable[[], Optional[torch.dtype]] = lambda: None  # set with the handle's precision
        self._shown_unreduced: List[Optional[torch.Tensor]] = []  # by parameter: the views of the unreduced sum on their .grad

    def install_initial(self, flat_param: nn.Parameter, shard: torch.Tensor, unsharded: torch.Tensor, layout: ParamLayout) -> None:
        """Each original becomes a DTensor viewing its part of the shard; one whose tensor defines an
        all-gather extension keeps its values in its own tensor, sharded as torch's shards it."""
        for index, (slot, view) in enumerate(zip(self.slots, layout.local_views(shard))):
            self.replaced[id(slot.live_param)] = (weakref.ref(slot.live_param), slot.module, slot.attr)
            setattr(slot.live_param, FLATTENED, True)
            local = self.shardings[index].local_of_computing(slot.live_param)
            if has_extension(local):
                view = _sharded_part(local.detach(), layout, index)
            self._replace_param(index, self.shardings[index].parameter(view, slot.live_param.requires_grad))
        self._resting_views = [_local_of(param) for param in self.orig_params()]
        self._manage()
        self._show_originals()

    def repoint(self, shard: torch.Tensor, layout: ParamLayout) -> None:
        """The same Parameter objects (an optimizer holds them) now view the new shard, in its dtype
        and on its device."""
        for slot, view, sharding in zip(self.slots, layout.local_views(shard), self.shardings):
            param = slot.live_param
            if has_extension(_local_of(param)):  # its values are in its own tensor, not in the shard
                continue
            if param.is_meta and not view.is_meta:  # to_empty(): swapped, as nn.Module swaps DTensors
                fqn = self._managed_params.pop(id(param))[1]  # swap_tensors refuses weakly held tensors
                torch.utils.swap_tensors(param, sharding.parameter(view, param.requires_grad))
                self._managed_params[id(param)] = (weakref.ref(param), fqn)
                setattr(param, FLATTENED, True)
                continue
            moved = sharding.dtensor(view)
            if (param.dtype, param.device) != (view.dtype, view.device):
                param.data = moved  # the wrapper's own dtype and device
            _point(param, moved)
        self._resting_views = [_local_of(param) for param in self.orig_params()]

    @contextlib.contextmanager
    def flat_param_registered(self, flat_param: nn.Parameter, shard: torch.Tensor, layout: ParamLayout) -> Iterator[None]:
        """Within, the owner holds the FlatParameter, and a parameter gathered by its all-gather
        extension stays registered beside it: its values are its own tensor, which a conversion
        (``to_empty()`` off the meta device, ``.to()``) must convert too."""
        extended = [(slot, slot.module._parameters[slot.attr]) for slot, local in zip(self.slots, self._resting_views)
                    if has_extension(local)]
        names = [self._managed_params.pop(id(param))[1] for _, param in extended]  # swap_tensors refuses weakly held ones
        try:
            with super().flat_param_registered(flat_param, shard, layout):
                for slot, param in extended:
                    slot.module._parameters[slot.attr] = param
                yield
        finally:
            for (slot, _), fqn in zip(extended, names):
                self._managed_params[id(slot.live_param)] = (weakref.ref(slot.live_param), fqn)

    def name_member(self, member: nn.Module, path: str) -> None:
        """``member``, one module of a group of several, is ``path`` from the root: its parameters'
        names (relative to it) are named from there."""
        for module in member.modules():
            self._member_paths[id(module)] = path

    def clean_fqn(self, slot: ParamSlot) -> str:
        member_path = self._member_paths.get(id(slot.module))
        if member_path is None:
            return super().clean_fqn(slot)
        return f"{member_path}.{slot.fqn}" if member_path else slot.fqn

    def register(self, params: Sequence[Optional[nn.Parameter]]) -> None:
        """Put back what ``registered`` returned; the parameters nobody replaced then await values
        (their shard was materialised for the others)."""
        super().register(params)
        self._awaiting_values = {index for index, (slot, param) in enumerate(zip(self.slots, params)) if param is slot.live_param}

    def replacement(self) -> Optional[torch.Tensor]:
        for slot in self.slots:
            current = slot.module._parameters.get(slot.attr)
            if current is not None and current is not slot.live_param and not current.is_meta:
                return current
        return None

    def still_on_meta(self) -> List[str]:
        if not self._awaiting_values and not self._resting_views[0].is_meta:
            return []
        return [self.clean_fqn(slot) for index, (slot, view) in enumerate(zip(self.slots, self._resting_views))
                if view.is_meta or index in self._awaiting_values]

    def replaced_registration(self, param: nn.Parameter) -> Optional[Tuple[nn.Module, str]]:
        """Where ``param`` was registered if it is an original Parameter these DTensors replaced."""
        ref, module, attr = self.replaced.get(id(param), (None, None, ""))
        return (module, attr) if ref is not None and module is not None and ref() is param else None

    def initial_values(self) -> List[torch.Tensor]:
        """The local tensors; zeros for one gathered by its extension, whose place in the shard only
        takes its gradient."""
        values = [sharding.local_of_computing(param) for sharding, param in zip(self.shardings, self.orig_params())]
        return [torch.zeros(value.shape, dtype=value.dtype, device=value.device) if has_extension(value) else value
                for value in values]

    def install(self, tensors: Sequence[torch.Tensor], as_parameters: bool, through_setattr: bool = False) -> None:
        """A forward's views become what the module computes on (tensor-parallel DTensors over them,
        under autograd, for parameters that were DTensors); DTensors are registered as they are."""
        super().install([self._computing(index, tensor) for index, tensor in enumerate(tensors)], as_parameters, through_setattr)
        # what the modules hold now (a frozen parameter's view was detached on the way in)
        self._installed = [cast(torch.Tensor, slot.module._parameters[slot.attr]) for slot in self.slots]
        resting = self._resting[1] if self._resting is not None else []
        self._shows_resting = len(resting) == len(tensors) and all(a is b for a, b in zip(tensors, resting))

    def _computing(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """What the module computes on for ``tensor``, a view the forward tied to autograd. The same
        view installed again (backward, for activation checkpointing's recomputation) gets the same
        DTensor the forward made: one made now, in backward, would be made without grad, so a
        recomputation would save other tensors than the forward did and compute no gradient."""
        extension = self._extension(index)
        if extension is not None:
            return extension.computing(tensor)
        if isinstance(tensor, DTensor) or self.shardings[index].computing is None:
            return tensor
        made = self._made_for_compute.get(index)
        if made is None or made[0] is not tensor:
            made = (tensor, self.shardings[index].for_compute(tensor))
            self._made_for_compute[index] = made
        return made[1]

    def _extension(self, index: int) -> Optional[ExtensionGather]:
        """The gathers of parameter ``index`` if its local tensor defines an all-gather extension
        (asked at every gather: torch's tests set one on a local tensor after ``fully_shard``)."""
        local = self._resting_views[index]
        if not has_extension(local):
            self._extensions.pop(index, None)
            return None
        extension = self._extensions.get(index)
        if extension is None or extension.local is not local:
            extension = ExtensionGather(local, self.shapes[index], self.shardings[index].shard_dim, self.slots[index].module,
                                        self._gather_context)
            self._extensions[index] = extension
        return extension

    def gather_extras(self) -> Optional[GatherExtras]:
        """The tensors the pre-hooks give, sent in the unit's gather in place of those parameters'
        places in the shard (which only take their gradients); the post-hooks run once it arrived."""
        gathers = [(index, extension) for index in range(len(self.slots)) if (extension := self._extension(index)) is not None]
        if not gathers:
            return None
        inputs = [tensor for _, extension in gathers for tensor in extension.prepare()]
        outputs = [output for _, extension in gathers for output in extension.outputs]

        def finish() -> None:
            for _, extension in gathers:
                extension.finish()

        return GatherExtras(frozenset(index for index, _ in gathers), inputs, outputs, finish)

    def show_sharded(self, shard: torch.Tensor, layout: ParamLayout) -> None:
        for extension in self._extensions.values():
            extension.free()
        super().show_sharded(shard, layout)

    def _show_originals(self) -> None:
        super()._show_originals()
        self._installed = None
        self._shows_resting = False

    def show_resting(self, unsharded: torch.Tensor, layout: ParamLayout) -> None:
        """Gathered outside a computation (``unshard()``, ``set_reshard_after_backward(False)``): the
        unsharded parameters, as Parameters outside autograd, as torch's FSDP2 registers them; the
        same objects each time where the next forward may compute on them (``resting_params_shown``)."""
        if self.computes_on_resting_params():
            self.install(self._resting_params(unsharded, layout), as_parameters=True)
        else:
            self._install_full(layout.unflatten(unsharded.detach()))

    def show_kept_gathered(self) -> None:
        """After a forward the unit stays gathered for: the unsharded parameters as leaf Parameters
        outside autograd (the forward's views saved what backward needs), as torch's FSDP2 registers
        them, so that ``requires_grad_`` and optimizers see Parameters. A forward that computed on the
        resting Parameters leaves them."""
        assert self._installed is not None, "a forward installed its views"
        if not self._shows_resting:
            self._install_full([view.detach() for view in self._installed])

    def computes_on_resting_params(self) -> bool:
        """Whether a forward may compute on the resting Parameters themselves: not where it computes on
        a tensor-parallel DTensor made over a gathered view, nor on what an all-gather extension made."""
        return all(sharding.computing is None for sharding in self.shardings) and not any(
            has_extension(local) for local in self._resting_views)

    def _resting_params(self, unsharded: torch.Tensor, layout: ParamLayout) -> List[nn.Parameter]:
        """The resting Parameters over ``unsharded``: made once (again when the buffer or what is
        trainable changed); the buffer's storage is freed and refilled under them."""
        params = self._resting_over(unsharded)
        if params is None:
            views = layout.unflatten(unsharded.detach())
            params = [_param_over(view, trainable) for view, trainable in zip(views, self.requires_grad)]
            grad_dtype = self.grad_dtype_of_resting()
            for param in params:
                if grad_dtype is not None and param.requires_grad:
                    param.grad_dtype = grad_dtype
            self._resting = (unsharded, params)
        return params

    def _resting_over(self, unsharded: torch.Tensor) -> Optional[List[nn.Parameter]]:
        """The resting Parameters, where they view ``unsharded`` and are trainable as the parameters
        are now (frozen or unfrozen since, the forward's views follow what is trainable now)."""
        if self._resting is None or self._resting[0] is not unsharded:
            return None
        params = self._resting[1]
        return params if [param.requires_grad for param in params] == list(self.requires_grad) else None

    def resting_params_shown(self, unsharded: torch.Tensor) -> Optional[List[nn.Parameter]]:
        return self._resting_over(unsharded) if self._shows_resting else None

    def new_resting_grads(self) -> Optional[List[Optional[torch.Tensor]]]:
        """What is on the resting Parameters' ``.grad`` but not a view of the unreduced sum shown there
        (autograd accumulated into those in place)."""
        if self._resting is None:
            return None
        shown = self._shown_unreduced or [None] * len(self._resting[1])
        return [None if param.grad is None or param.grad is view else param.grad
                for param, view in zip(self._resting[1], shown)]

    def drop_resting_grads(self) -> None:
        self._shown_unreduced = []
        if self._resting is not None:
            for param in self._resting[1]:
                param.grad = None

    def take_user_changes(self, is_gathered_for_backward: bool, layout: ParamLayout) -> bool:
        """A DTensor Parameter assigned in an original's place (``load_state_dict(assign=True)``,
        ``module.weight = ...``, a loader filling a model sharded on the meta device) becomes the
        original: its values (this rank's rows) are copied into the shard, which it then views. A
        plain tensor of the full shape gives this rank's rows, and a DTensor Parameter takes its
        place (a new object: build the optimizer after the first forward). Anything of another
        shape is refused."""
        written = False
        for index, (slot, view) in enumerate(zip(self.slots, self._resting_views)):
            current = slot.module._parameters.get(slot.attr)
            if current is None or (self._installed is not None and current is self._installed[index]):
                continue  # deregistered for a while, or the unit's own unsharded view
            if current is slot.param and isinstance(current, DTensor) and _local_of(current) is view:
                continue
            where = self.clean_fqn(slot)
            if getattr(current, FLATTENED, False) and id(current) not in self._managed_params:
                raise ValueError(  # torch's phrase (its fully_shard trains this case on the two groups' shared storage)
                    f"Parameter '{where}' is shared with a parameter already managed by another FSDP group. For "
                    "shared/tied parameters, use fully_shard([module_a, module_b]) to place them in the same FSDP group. "
                    f"fsdp1: '{where}' was registered, after sharding, as a parameter another fully_shard group holds "
                    "(weights tied after fully_shard, as Transformers' loading ties the embedding and the head). Tie the "
                    "weights before fully_shard and shard the modules that share them as one group (or leave them to "
                    "a module holding both), or untie them."
                )
            if current.shape != slot.live_param.shape or current.dtype != view.dtype:
                raise RuntimeError(
                    f"fsdp1: '{where}' of a fully_shard module was replaced by a {type(current).__name__} of shape "
                    f"{tuple(current.shape)} and dtype {current.dtype}; its group holds shape "
                    f"{tuple(slot.live_param.shape)} in {view.dtype}. Assign values of that shape and dtype, or convert "
                    "the module first (module.to(dtype)); or load them with load_state_dict(), which converts."
                )
            sharding = self.shardings[index]
            local = current.to_local() if isinstance(current, DTensor) else layout.held_part(index, sharding.local_of_full(current))
            with torch.no_grad():  # through ``.data``: the shard's version counter is the flat parameter's
                view.data.copy_(local.reshape(view.shape))
            if not isinstance(current, DTensor):
                current = sharding.parameter(view, current.requires_grad)
                slot.module._parameters[slot.attr] = current
            if current is not slot.param:
                self._adopt_param(index, current)
            _point(current, sharding.dtensor(view))
            self._resting_views[index] = _local_of(current)
            self._awaiting_values.discard(index)
            written = True
        return written

    holds_grad = True
    tracks_arrivals = True
    writes_show_in_shard = True  # the DTensors' local tensors are views of the shard

    def grads_arrived(self, arrived: Sequence[bool]) -> None:
        if self.held_grad() is None:  # none was kept: every .grad was dropped (zero_grad), which freed it
            self._has_grad = [False] * len(self.slots)
        self._has_grad = [had or now for had, now in zip(self._has_grad, arrived)]
        self._hooks_due = arrived

    def held_grad(self) -> Optional[torch.Tensor]:
        return None if self._grad is None else self._grad()

    def show_grads(self, grad: Optional[torch.Tensor], layout: ParamLayout, start: int) -> None:
        """DTensor gradients viewing ``grad`` (over the shard from element ``start``) for every
        trainable parameter some backward gave a gradient, as torch's FSDP2 (None for the others: a
        module of the group that never ran); every rank gets one, an empty local one where it holds
        no rows, so that collectives over the gradients (``clip_grad_norm_``) run alike on every
        rank. Then the post-accumulate-grad hooks of those the last backward reached run, with the
        reduced gradient in place (optimizer-in-backward)."""
        assert grad is None or not is_view(grad), "the DTensor gradients' views keep their base alive"
        if self._shown_unreduced:  # that sum was reduced: its views would keep it alive
            self.drop_resting_grads()
        self._grad = None if grad is None else weakref.ref(grad)
        self._grad_layout = (layout, start)
        self._grads_shown = []
        if grad is None:
            self._has_grad = [False] * len(self.slots)
        for index, (slot, requires_grad) in enumerate(zip(self.slots, self.requires_grad)):
            param, shown = slot.live_param, None
            if grad is not None and requires_grad and self._has_grad[index]:
                shown = _grad_of(param, self._local_grad(grad, index))
            self._grads_shown.append(None if shown is None else weakref.ref(shown))
            param.grad = shown
        due, self._hooks_due = self._hooks_due, ()
        for slot, is_due in zip(self.slots, due):
            if is_due and slot.live_param.grad is not None:
                for hook in post_accumulate_grad_hooks(slot.live_param):
                    hook(slot.live_param)

    def _local_grad(self, grad: torch.Tensor, index: int) -> torch.Tensor:
        assert self._grad_layout is not None, "set with the gradient"
        layout, start = self._grad_layout
        if layout.shard_infos[index].in_shard:
            return layout.local_view(grad, index, start)
        return grad.new_empty((0, *self.shapes[index][1:]))

    def show_unreduced_grads(self, flat_grad: Optional[torch.Tensor], layout: ParamLayout) -> None:
        """An unsynchronised backward leaves no ``.grad`` on the sharded parameters, as torch's FSDP2:
        the unreduced sum stays with the unit until a backward synchronises it, and shows on the
        unsharded parameters if the unit stays gathered. On resting Parameters autograd then adds the
        next micro-batch's gradient onto those views in place, so into the sum, in torch's order."""
        self._grad, self._grads_shown = None, []
        for slot in self.slots:
            slot.live_param.grad = None
        self._shown_unreduced = []
        if self._installed is not None:
            grads = layout.unflatten(flat_grad) if flat_grad is not None else [None] * len(self.slots)
            for param, grad, requires_grad, sharding in zip(self._installed, grads, self.requires_grad, self.shardings):
                param.grad = sharding.shown_unsharded(grad) if requires_grad and grad is not None else None
            if self._shows_resting:  # autograd adds the next micro-batch onto these views, in place
                self._shown_unreduced = [param.grad for param in self._installed]

    def every_grad_dropped(self) -> bool:
        return False  # a zero_grad() between unsynchronised backwards leaves their sum, as torch's FSDP2

    def take_user_grads(self) -> bool:
        """The user's changes of the ``.grad`` DTensors: None zeroes that part (once every one is None
        the gradient is already freed), another tensor is copied in."""
        held = self.held_grad()
        if held is None:
            return False
        any_grad = False
        with torch.no_grad():
            for index, (slot, shown_ref) in enumerate(zip(self.slots, self._grads_shown)):
                if shown_ref is None:
                    continue
                grad = slot.live_param.grad
                if grad is None:
                    self._local_grad(held, index).zero_()
                    self._has_grad[index] = False
                    continue
                any_grad = True
                if grad is not shown_ref():
                    self._local_grad(held, index).copy_(grad.to_local() if isinstance(grad, DTensor) else grad)
        return any_grad

    def expose_full(self, flat_param: nn.Parameter, views: List[torch.Tensor]) -> List[nn.Parameter]:
        """Plain full Parameters under the original names; the DTensor originals come back on exit."""
        return self._install_full(views)

    def _install_full(self, views: Sequence[torch.Tensor]) -> List[nn.Parameter]:
        """Full Parameters viewing ``views``, outside autograd, under the original names."""
        full = [nn.Parameter(sharding.shown_unsharded(view), requires_grad=requires_grad)
                for view, requires_grad, sharding in zip(views, self.requires_grad, self.shardings)]
        self.install(full, as_parameters=True)
        return full

    def registered_full_params(self, exposed: List[nn.Parameter]) -> List[nn.Parameter]:
        """What the modules hold, as tensors of the gathered buffer's shapes (the local tensors of
        tensor-parallel DTensors), whose values are written back."""
        registered = super().registered_full_params(exposed)
        return [cast(nn.Parameter, sharding.local_of_computing(param)) for sharding, param in zip(self.shardings, registered)]

    def global_shape(self, index: int) -> torch.Size:
        return self.shardings[index].shape

    def sharded_of_full(self, index: int, full: torch.Tensor, layout: ParamLayout) -> DTensor:
        """This rank's part of a plain full value of parameter ``index``, as its DTensor at rest."""
        sharding = self.shardings[index]
        return sharding.dtensor(layout.held_part(index, sharding.local_of_full(full)))

    def hide_full(self, flat_param: nn.Parameter, shard: torch.Tensor, layout: ParamLayout) -> None:
        self._show_originals()

    def adopt_replaced(self, exposed: List[nn.Parameter], registered: List[nn.Parameter]) -> None:
        pass  # the values were written back; the originals stay the DTensors the optimizer holds


def _param_over(view: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """A Parameter viewing ``view``'s storage with a version counter of its own, as the flat parameter
    has: a gather refilling the buffer (the same values) must not look to autograd like a change of
    what a forward saved."""
    param = nn.Parameter(view.new_empty(0), requires_grad=requires_grad)
    param.data = view
    return param


def _sharded_part(value: torch.Tensor, layout: ParamLayout, index: int) -> torch.Tensor:
    """This rank's part of ``value`` as torch's FSDP2 makes it for a tensor of its own (a subclass's
    operations do the work, the ones torch's calls: ``chunk``, ``new_zeros``, a copy into the part
    from its start): a zero tensor of the padded chunk's size, this rank's chunk copied in, viewed
    without the padding. (torchao's NF4 weights slice only from a start of 0.)"""
    dim = layout.shard_dims[index]
    start, end = layout.held_slices(index)
    chunks = torch.chunk(value, layout.world_size, dim=dim)
    padded = list(value.shape)
    padded[dim] = chunks[0].shape[dim]
    part = value.new_zeros(padded)
    if end > start:
        held = chunks[start // padded[dim]]
        assert held.shape[dim] == end - start, "torch.chunk splits as the chunk layout does"
        part.narrow(dim, 0, end - start).copy_(held)
    return part.narrow(dim, 0, end - start)


def _local_of(param: torch.Tensor) -> torch.Tensor:
    """A DTensor Parameter's local tensor: the view of the shard it was built on."""
    assert isinstance(param, DTensor), "fully_shard's parameters at rest are DTensors"
    return local_tensor(param)


def _grad_of(param: nn.Parameter, local: torch.Tensor) -> DTensor:
    """A gradient for ``param`` with ``local`` as its local tensor: the parameter's placement, shape
    and dtype, built directly (``from_local`` costs an autograd function and a new spec per call,
    which was a third of the step's Python time). Built on ``local`` itself, as ``from_local``
    builds and as the parameters are, so that ``torch.compile`` can trace it (a compiled optimizer
    step: torchao's); one built on an empty stand-in fails there."""
    return dtensor(local.view_as(local), spec_of(param))


def _point(param: nn.Parameter, like: DTensor) -> None:
    """``param`` (a DTensor Parameter) takes ``like``'s local tensor and placement metadata in place."""
    rebind(param, local_tensor(like), spec_of(like))
