"""``FlatParamViews``: the views of ``use_orig_params=False``. The original Parameters leave the
modules and the FlatParameter joins the unit's module, so ``parameters()`` yields it alone; the
original names hold views of the unsharded buffer while it is alive, and placeholders that raise a
clear error on use while it is freed."""

import dataclasses
from typing import List, Sequence, Tuple

import torch
from torch import nn

from .._engine.layout import ParamLayout
from .._engine.traversal import ParamSlot
from .._engine.views import FLAT_PARAM, ParamViews
from .placeholder import ShardedParamPlaceholder


class FlatParamViews(ParamViews):
    """use_orig_params=False: the FlatParameter replaces the originals in ``parameters()``."""

    use_orig_params = False

    as_parameters = False

    def __init__(self, slots: Sequence[ParamSlot], owner: nn.Module) -> None:
        super().__init__(slots, owner)
        self._placeholders: List[torch.Tensor] = []

    def aligned_numel(self, dtype: torch.dtype) -> int:
        return 0

    @property
    def span_requires_grad(self) -> Tuple[bool, ...]:
        return (True,) * len(self.slots)  # one requires_grad for the whole flat parameter

    def install_initial(self, flat_param: nn.Parameter, shard: torch.Tensor, unsharded: torch.Tensor, layout: ParamLayout) -> None:
        self._manage()
        self.repoint(shard, layout)
        self._register_flat_param(flat_param)
        # the originals are dropped, so that their full-size storage is freed
        self.slots = tuple(dataclasses.replace(slot, param=None) for slot in self.slots)
        self.shared_slots = tuple((dataclasses.replace(slot, param=None), i) for slot, i in self.shared_slots)
        self.install(layout.unflatten(unsharded.detach()), as_parameters=False)

    def repoint(self, shard: torch.Tensor, layout: ParamLayout) -> None:
        self._shard = shard
        self._placeholders = [ShardedParamPlaceholder(self.clean_fqn(s), shape, shard) for s, shape in zip(self.slots, layout.shapes)]

    def set_path(self, path: str, layout: ParamLayout, is_resharded: bool) -> None:
        super().set_path(path, layout, is_resharded)
        self.repoint(self._shard, layout)  # the placeholders name the parameters by the new path
        if is_resharded and layout.is_sharded:
            self.install(self._placeholders, as_parameters=False)

    def show_resting(self, unsharded: torch.Tensor, layout: ParamLayout) -> None:
        self.install(layout.unflatten(unsharded.detach()), as_parameters=False)

    def show_sharded(self, shard: torch.Tensor, layout: ParamLayout) -> None:
        if layout.is_sharded:
            self.install(self._placeholders, as_parameters=False)
        else:  # views of the shard, which is the whole parameter (an offloaded one's device copy is freed)
            self.show_resting(shard, layout)

    def show_kept_gathered(self) -> None:
        pass  # the forward's views stay: their storage is alive

    def expose_full(self, flat_param: nn.Parameter, views: List[torch.Tensor]) -> List[nn.Parameter]:
        exposed = [nn.Parameter(view, requires_grad=flat_param.requires_grad) for view in views]
        del self.owner._parameters[FLAT_PARAM]
        for slot in self.all_slots():
            del slot.module.__dict__[slot.attr]
        self.install(exposed, as_parameters=True)
        return exposed

    def hide_full(self, flat_param: nn.Parameter, shard: torch.Tensor, layout: ParamLayout) -> None:
        self._register_flat_param(flat_param)
