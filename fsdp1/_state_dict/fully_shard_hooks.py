"""The state-dict hooks of a ``fully_shard`` module. Its parameters are DTensors already, so
``nn.Module``'s own state dict is the SHARDED one; the hooks keep the shard the one truth around it:
a save takes what was assigned since and reads resharded DTensors; a load accepts full tensors too.
"""

from typing import Any, Dict, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._engine.common import TrainingState
from .._engine.dtensors import viewing
from .._engine.handle import FlatParamHandle
from .._engine.layout import ParamLayout
from .._engine.traversal import is_fsdp_unit, iter_param_slots
from .._engine.unit_state import state_of
from .._torch_internals import local_tensor, spec_of


class ShardsFullValues(Protocol):
    """What the hooks ask of a ``fully_shard`` unit's views: each parameter's global shape, and a
    plain full value of it as this rank's sharded DTensor."""

    def global_shape(self, index: int) -> torch.Size: ...

    def sharded_of_full(self, index: int, full: torch.Tensor, layout: ParamLayout) -> DTensor: ...


def register_fully_shard_hooks(module: nn.Module, handle: FlatParamHandle, sharded: ShardsFullValues) -> None:
    """``state_dict()`` reads the sharded DTensors (a module kept gathered reshards first, as torch's;
    each wrapper is rebuilt so that ``torch.save`` takes it);
    ``load_state_dict()`` copies DTensors into them in place, also takes plain full tensors (each
    rank keeps its rows; torch's refuses them, pytorch#136336); what ``assign=True`` registers is
    taken at the next use (a forward, a state dict, a conversion), as torch's takes it at lazy init."""
    views, layout = handle.views, handle.layout
    index_of = {id(slot.live_param): index for index, slot in enumerate(views.slots)}
    own = [(slot.fqn, index_of[id(slot.param)]) for slot in iter_param_slots(module, stop=is_fsdp_unit) if id(slot.param) in index_of]
    state = state_of(module)

    def before_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if state.training_state is TrainingState.IDLE:
            state.materialize_replaced()
            handle.write_back_orig_params()
            handle.reshard()

    def before_load(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        handle.reshard()
        for fqn, index in own:
            key = prefix + fqn
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == sharded.global_shape(index):
                state_dict[key] = sharded.sharded_of_full(index, value, layout)

    def after_save(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for fqn, _ in own:  # ``state_dict()`` detached them, which gives each wrapper its view's offset
            value = state_dict.get(prefix + fqn)
            if isinstance(value, DTensor) and value.storage_offset() != 0:
                state_dict[prefix + fqn] = viewing(local_tensor(value), spec_of(value))

    module.register_state_dict_pre_hook(before_save)
    module.register_state_dict_post_hook(after_save)
    module.register_load_state_dict_pre_hook(before_load)
