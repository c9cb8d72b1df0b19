"""A FullyShardedDataParallel unit's handle: its parameters materialised, moved and synchronised in
torch FSDP1's order, then flattened into FSDP1's layout on the compute device."""

from typing import Callable, Iterable, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .._engine import collectives as comm
from .._engine.collectives import ProcessGroups
from .._engine.device import materialization_device, resolve_compute_device
from .._engine.handle import FlatParamHandle
from .._engine.mixed_precision import HandlePrecision
from .._engine.orig_views import OrigParamViews
from .._engine.traversal import ParamSlot
from ..api import BlockQuantization, MixedPrecision
from .flat_shard_layout import FlatShardLayout
from .flat_views import FlatParamViews
from .initial_values import MetaInit, move_to_compute_device
from .initial_values import sync_module_states as sync_states_from_first
from .unit_plan import IgnoredStates, unit_param_slots


class UnitHandleBuilder:
    """What one unit's construction does with its module's parameters once its children are units:
    meta-device materialisation (``param_init_fn`` or the default reset), the move to ``device_id``,
    ``sync_module_states``, and the handle over what is left."""

    def __init__(self, module: nn.Module, ignored: IgnoredStates, param_init_fn: Optional[Callable[[nn.Module], None]],
                 device_id: Optional[Union[int, torch.device]]) -> None:
        self._module, self._ignored, self._device_id = module, ignored, device_id
        self._meta_init = MetaInit(module, param_init_fn, materialization_device(device_id), ignored)

    def build(self, groups: ProcessGroups, is_sharded: bool, mixed_precision: Optional[MixedPrecision],
              use_orig_params: bool, offload_params: bool, sync_module_states: bool,
              params_of_outer_units: Iterable[nn.Parameter],
              quantization: Optional[BlockQuantization]) -> Tuple[Optional[FlatParamHandle], torch.device]:
        """The handle (None without parameters) and the unit's compute device. Meta parameters reset by
        the default init get their storage in the flat buffer itself, so that their unit is never held
        twice."""
        module, meta_init = self._module, self._meta_init
        in_place = meta_init.is_in_place  # meta parameters get their storage in the flat buffer itself
        if meta_init.is_needed and not in_place:
            meta_init.run_param_init_fn()
        slots = unit_param_slots(module, use_orig_params, self._ignored, params_of_outer_units)

        def initialize(slots: Sequence[ParamSlot]) -> None:
            if in_place:
                meta_init.reset_in_place()
            if sync_module_states:
                sync_states_from_first(module, slots, self._ignored, groups)

        compute_device = meta_init.device if in_place else resolve_compute_device(module, self._device_id, self._ignored.params)
        if self._device_id is not None:
            move_to_compute_device(module, compute_device, self._ignored)
        if not slots or not in_place:  # in place with parameters: the handle initialises them in its buffer
            initialize(slots)  # on the compute device: NCCL broadcasts no CPU tensor
        if not slots:
            return None, compute_device
        views = OrigParamViews(slots, module) if use_orig_params else FlatParamViews(slots, module)
        precision = HandlePrecision.of(mixed_precision, slots[0].live_param.dtype)
        layout = FlatShardLayout(views.shapes, views.aligned_numel(precision.param_dtype), comm.group_rank(groups.shard),
                                 comm.group_size(groups.shard), is_sharded)
        handle = FlatParamHandle(
            views, layout, groups, precision, offload_params,
            materialize_in_place=initialize if in_place else None, device=compute_device, quantization=quantization,
        )
        return handle, compute_device
