"""State dicts: which form every unit saves and loads (``state_dict_type``), and the FULL / SHARDED /
LOCAL save and load, always under the clean names of the unwrapped model. The only module that
registers state-dict hooks.

Saving runs inside ``saving(unit)``: with use_orig_params=False the module keeps only the flat
parameter, so a name-only placeholder is put under every original name for the duration, and
``nn.Module.state_dict`` emits the keys where the plain model would. The unit's post-hook then strips
wrapper names and fills the keys: FULL gathers one unit at a time; SHARDED redistributes the flat
shards into dim-0 chunks (DTensor ``Shard(0)``) with one all-to-all and never unshards; LOCAL is the
flat shard itself. NO_SHARD units always save and load FULL, as torch's.

Loading: the first unit the load reaches checks its whole subtree (keys, shapes) and agrees the
verdict across its ranks before anything is written, so a failed load leaves the model as it was
and raises on every rank. Each unit then writes its own parameters into its shard and hands the
rest on under the wrapped names; its post-hook reports missing and unexpected keys by clean name.

A SHARDED save never unshards a unit (torch's all-gathers each, then keeps its rows): a rank's
rows of a parameter lie in the flat shards of one or two ranks, so one all-to-all per unit moves
about one shard of bytes and holds about one shard extra (half the largest unit on 2 ranks, where
torch's holds the whole unit). Saving the flat shards themselves (LOCAL's form) was rejected: it
neither reshards nor loads into torch's FSDP1.
"""

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .._engine import collectives as comm
from .._engine.common import TrainingState
from .._engine.dtensors import MeshPlacements
from .._engine.handle import FlatParamHandle
from .._engine.traversal import FSDP_PREFIX, FSDP_WRAPPED_MODULE, clean_fqn, fsdp_units
from .._engine.unit_state import adopt_replaced_flat_params, state_of
from .._engine.views import FLAT_PARAM
from .._torch_internals import register_state_dict_hook
from ..api import (
    STATE_DICT_CONFIG_TYPES,
    FullStateDictConfig,
    StateDictSettings,
    StateDictType,
    coerce_config,
    coerce_enum,
)
from .load_checks import agree_on, check_subtree
from .settings import STATE_DICT_STATE, UnitStateDicts, state_dicts_of

_NAME_ONLY = torch.empty(0)
"""Stands under an original parameter's name while the module saves, so that its key comes out where
the plain model's would; the post-hook replaces it before anyone sees it."""


# ---------------------------------------------------------------------------------------- settings
def register_hooks(unit: nn.Module, saves_full_only: bool) -> None:
    """The unit's state-dict settings, and the hooks that translate between the wrapped module's
    keys and the clean ones."""
    unit.__dict__[STATE_DICT_STATE] = UnitStateDicts(saves_full_only)
    register_state_dict_hook(unit, _post_state_dict)
    unit.register_load_state_dict_pre_hook(_pre_load_state_dict)  # given the module, as torch's private one with_module
    unit.register_load_state_dict_post_hook(_post_load_state_dict)


def set_state_dict_type(
    module: nn.Module, state_dict_type: Any, state_dict_config: Any = None, optim_state_dict_config: Any = None
) -> StateDictSettings:
    """Set the type and configs on every unit in ``module`` (which need not be a unit); return the
    previous settings. torch's enum members and config objects are accepted as well as fsdp1's."""
    kind = coerce_enum(state_dict_type, StateDictType, "state_dict_type")
    config_cls, optim_config_cls = STATE_DICT_CONFIG_TYPES[kind]
    config = config_cls() if state_dict_config is None else coerce_config(state_dict_config, config_cls, "state_dict_config", " for this state-dict type")
    optim_config = (
        optim_config_cls()
        if optim_state_dict_config is None
        else coerce_config(optim_state_dict_config, optim_config_cls, "optim_state_dict_config", " for this state-dict type")
    )
    units = _units_of(module, "set_state_dict_type")
    previous = state_dicts_of(units[0]).settings
    for unit in units:
        state_dicts_of(unit).use(StateDictSettings(kind, config, optim_config))
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings every unit in ``module`` shares; an error names two units that disagree."""
    units = _units_of(module, "get_state_dict_type")
    first = state_dicts_of(units[0]).settings
    for unit in units[1:]:
        if state_dicts_of(unit).settings != first:
            raise RuntimeError(
                f"fsdp1: the units of this model have different state-dict settings ({first} and "
                f"{state_dicts_of(unit).settings}); set them together with FullyShardedDataParallel.set_state_dict_type(model, ...)."
            )
    return first


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module, state_dict_type: Any, state_dict_config: Any = None, optim_state_dict_config: Any = None
) -> Iterator[None]:
    """``set_state_dict_type`` for the duration of the block; the previous settings come back after."""
    previous = {unit: state_dicts_of(unit).settings for unit in _units_of(module, "state_dict_type")}
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for unit, settings in previous.items():
            state_dicts_of(unit).use(settings)


def _units_of(module: nn.Module, api: str) -> List[nn.Module]:
    units = fsdp_units(module)
    if not units:
        raise ValueError(
            f"fsdp1: {api}() found no FullyShardedDataParallel unit in {type(module).__name__}; pass the "
            "wrapped model (or a module that contains its units)."
        )
    return units


def _check_idle(unit: nn.Module, api: str) -> None:
    if state_of(unit).training_state is not TrainingState.IDLE:
        where = "inside summon_full_params()" if state_of(unit).training_state is TrainingState.SUMMON_FULL_PARAMS else "during forward or backward"
        raise RuntimeError(
            f"fsdp1: {api}() was called {where}; call it between training steps, outside summon_full_params()."
        )


# ---------------------------------------------------------------------------------------- saving
@contextlib.contextmanager
def saving(unit: nn.Module) -> Iterator[None]:
    """Around ``nn.Module.state_dict`` of ``unit``: every original parameter's name is registered
    (use_orig_params=False) so that its key comes out in the plain model's order, and removed again
    whatever happens."""
    if _in_summon_full_params(unit):  # the module shows its full parameters already (PEFT saves so)
        yield
        return
    _check_idle(unit, "state_dict")
    adopt_replaced_flat_params(unit)
    handle = state_of(unit).handle
    if handle is None or handle.use_orig_params or state_dicts_of(unit).effective_type is StateDictType.LOCAL_STATE_DICT:
        yield
        return
    with handle.views.names_registered(_NAME_ONLY):
        yield


def _in_summon_full_params(unit: nn.Module) -> bool:
    """A FULL state dict inside ``summon_full_params``, as torch's allows: the values are the
    summoned parameters, copied; other types there are refused by ``_check_idle``."""
    return state_of(unit).training_state is TrainingState.SUMMON_FULL_PARAMS and state_dicts_of(unit).effective_type is StateDictType.FULL_STATE_DICT


def _post_state_dict(unit: nn.Module, destination: Dict[str, Any], prefix: str, local_metadata: Any) -> Dict[str, Any]:
    _strip_wrapper_names(destination, prefix)
    kind = state_dicts_of(unit).effective_type
    settings = state_dicts_of(unit)
    config = settings.config if kind is settings.type else FullStateDictConfig()
    keep = not (kind is StateDictType.FULL_STATE_DICT and getattr(config, "rank0_only", False) and comm.global_rank() != 0)
    handle = state_of(unit).handle
    if handle is not None and _in_summon_full_params(unit):
        destination.pop(prefix + FLAT_PARAM, None)
        for fqn, _ in handle.views.slot_fqns():
            key = prefix + clean_fqn(fqn)
            if key in destination:
                value = destination[key].detach()
                destination[key] = value.to("cpu", copy=True) if config.offload_to_cpu else value.clone()
    elif handle is not None:
        _save_params(unit, handle, destination, prefix, kind, config.offload_to_cpu, keep)
    if state_of(unit).has_root_state:  # buffers are cast at the root's lazy init, not before
        state_of(unit).root_state.buffers.restore_dtypes(unit, destination, prefix)
    for key in [prefix + clean_fqn(name) for name, _ in unit.named_buffers()]:
        if key not in destination:
            continue
        if not keep:
            del destination[key]
        elif config.offload_to_cpu:
            destination[key] = destination[key].cpu()
    return destination


def _save_params(unit: nn.Module, handle: FlatParamHandle, destination: Dict[str, Any], prefix: str,
                 kind: StateDictType, offload_to_cpu: bool, keep: bool) -> None:
    """Fill the keys of the unit's parameters (placeholders or shard views until now) in ``kind``'s
    form; LOCAL puts the flat shard in their place."""
    flat_key = prefix + FLAT_PARAM
    keys = [(prefix + clean_fqn(fqn), index) for fqn, index in handle.views.slot_fqns()]
    if kind is StateDictType.LOCAL_STATE_DICT:
        for key, _ in keys:
            destination.pop(key, None)
        destination[flat_key] = _local_dtensor(unit, handle, offload_to_cpu)
        return
    destination.pop(flat_key, None)
    if kind is StateDictType.FULL_STATE_DICT:
        values = _full_values(handle, keep, offload_to_cpu)
    else:
        values = _sharded_values(unit, handle, offload_to_cpu)
    seen: Set[int] = set()
    for key, index in keys:
        if values is None:
            destination.pop(key, None)
        elif kind is StateDictType.FULL_STATE_DICT and index in seen:
            destination[key] = values[index].clone()  # each name of a tied weight its own tensor, as torch's
        else:
            destination[key] = values[index]
        seen.add(index)


def _strip_wrapper_names(destination: Dict[str, Any], prefix: str) -> None:
    """Keys below ``prefix`` as the unwrapped model names them. They are the last ones added (this
    unit's part of the traversal), so re-inserting them in order keeps the order."""
    below = [key for key in destination if key.startswith(prefix)]
    if all(clean_fqn(key[len(prefix) :]) == key[len(prefix) :] for key in below):
        return
    for key in below:
        destination[prefix + clean_fqn(key[len(prefix) :])] = destination.pop(key)


def _full_values(handle: FlatParamHandle, keep: bool, offload_to_cpu: bool) -> Optional[Sequence[torch.Tensor]]:
    """Every parameter's full value, copied out of the gathered buffer (collective on every rank);
    None on a rank that keeps nothing, which frees the gathered unit at once."""
    with handle.gathered_views() as views:
        if not keep:
            return None
        return [view.to("cpu", copy=True) if offload_to_cpu else view.clone() for view in views]


def _sharded_values(unit: nn.Module, handle: FlatParamHandle, offload_to_cpu: bool) -> List[DTensor]:
    """One DTensor per parameter, split along dim 0 over the unit's shard group (torch's layout)."""
    return rows_as_dtensors(unit, handle.conversions.dim0_chunks(), offload_to_cpu)


def rows_as_dtensors(unit: nn.Module, rows: List[torch.Tensor], offload_to_cpu: bool) -> List[DTensor]:
    """Each parameter's rows of this rank (``handle.conversions.dim0_chunks()`` or ``held_slices_of`` a state) as the
    DTensor of the whole parameter, ``Shard(0)`` over the unit's shard group."""
    handle = state_of(unit).handle
    assert handle is not None, "rows of a unit without parameters"
    sharding = MeshPlacements(_mesh_of(unit), (Shard(0),))
    return [sharding.dtensor(chunk.cpu() if offload_to_cpu else chunk, shape) for chunk, shape in zip(rows, handle.layout.shapes)]


def _local_dtensor(unit: nn.Module, handle: FlatParamHandle, offload_to_cpu: bool) -> DTensor:
    """The unit's unpadded flat parameter as a DTensor whose local part is this rank's shard (a view)."""
    local = handle.conversions.local_flat_shard()
    local = local.cpu() if offload_to_cpu else local
    return MeshPlacements(_mesh_of(unit), (Shard(0),)).dtensor(local, torch.Size([handle.layout.unpadded_numel]))


def _mesh_of(unit: nn.Module) -> comm.DeviceMesh:
    state_dicts, state = state_dicts_of(unit), state_of(unit)
    if state_dicts.mesh is None:
        state_dicts.mesh = comm.device_mesh_of(state.process_group, state.compute_device.type)
    return state_dicts.mesh


# ---------------------------------------------------------------------------------------- loading
@contextlib.contextmanager
def loading(unit: nn.Module, strict: bool) -> Iterator[None]:
    """Around ``nn.Module.load_state_dict`` of ``unit``: its hooks learn ``strict`` (``nn.Module``
    passes them True whatever it is), so that missing and unexpected keys are refused before anything
    is written, not after."""
    adopt_replaced_flat_params(unit)
    units = fsdp_units(unit)
    for member in units:
        state_dicts_of(member).load_is_strict = strict
    try:
        yield
    finally:
        for member in units:
            state_dicts_of(member).load_is_strict = None


def _pre_load_state_dict(
    unit: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
    missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str],
) -> None:
    _check_idle(unit, "load_state_dict")
    if FSDP_WRAPPED_MODULE not in prefix.split("."):  # the first unit of this load: check its subtree
        comm.check_every_rank_calls(state_of(unit).process_group, "load_state_dict()")
        problem = check_subtree(unit, state_dict, prefix, bool(state_dicts_of(unit).load_is_strict))
        agree_on(unit, prefix, problem)
    loaded: Set[str] = set()
    handle = state_of(unit).handle
    clean_prefix = clean_fqn(prefix)
    if handle is not None:
        kind = state_dicts_of(unit).effective_type
        if kind is StateDictType.LOCAL_STATE_DICT:
            value = state_dict.pop(prefix + FLAT_PARAM, None)
            if value is None:
                missing_keys.append(clean_prefix + FLAT_PARAM)
            else:
                handle.conversions.load_local_flat_shard(_local_part(_materialized(value)))
                loaded.add(clean_prefix + FLAT_PARAM)
                loaded.update(clean_prefix + clean_fqn(fqn) for fqn, _ in handle.views.slot_fqns())
        else:
            loaded.add(clean_prefix + FLAT_PARAM)
            values: List[Optional[Any]] = [None] * len(handle.layout.shapes)
            for fqn, index in handle.views.slot_fqns():
                name = clean_fqn(fqn)
                value = state_dict.pop(prefix + name, None)
                if value is None:
                    missing_keys.append(clean_prefix + name)
                    continue
                loaded.add(clean_prefix + name)
                values[index] = _materialized(value)  # of a tied parameter's names, the last one wins, as in nn.Module
            if kind is StateDictType.FULL_STATE_DICT:
                handle.conversions.load_full_params([None if v is None else _full_value(v) for v in values])
            else:
                handle.conversions.load_dim0_chunks([None if v is None else dim0_chunk(unit, handle, i, v) for i, v in enumerate(values)])
    state_dicts_of(unit).keys_loaded_by_hook = loaded
    for key in [key for key in state_dict if key.startswith(prefix)]:
        state_dict[prefix + FSDP_PREFIX + key[len(prefix) :]] = state_dict.pop(key)


def _post_load_state_dict(unit: nn.Module, incompatible_keys: Any) -> None:
    """Report missing and unexpected keys by clean name, once each; the ones this unit loaded itself
    (which the wrapped module, holding only shard views or the flat parameter, reports) are not."""
    loaded = state_dicts_of(unit).keys_loaded_by_hook
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        cleaned = [clean_fqn(key) for key in keys]
        keys[:] = list(dict.fromkeys(key for key in cleaned if key not in loaded))


def _materialized(value: Any) -> Any:
    """A tensor-like value that is no Tensor (Lightning's lazily loaded checkpoint tensors) as a
    Tensor, made by a torch function as ``nn.Module``'s own ``copy_`` would make it."""
    if isinstance(value, torch.Tensor) or not torch.overrides.is_tensor_like(value):
        return value
    return torch.detach(value)


def _full_value(value: Any) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def dim0_chunk(unit: nn.Module, handle: FlatParamHandle, index: int, value: Any) -> torch.Tensor:
    """This rank's dim-0 rows of ``value``: the local part of a DTensor or ShardedTensor laid out as
    this unit saves (the usual case: a template from ``state_dict()`` filled by DCP), else cut from
    the full value (a plain tensor, or any other layout gathered first)."""
    shape = handle.layout.shapes[index]
    first, last = handle.layout.held_slices(index)
    world = state_of(unit).world_size if handle.is_sharded else 1
    if isinstance(value, DTensor):
        if value.placements == (Shard(0),) and value.device_mesh.size() == world and value.to_local().shape[0] == last - first:
            return value.to_local()
        value = value.full_tensor()
    elif _is_sharded_tensor(value):
        shards = value.local_shards()
        offsets = [list(shard.metadata.shard_offsets) for shard in shards]
        if len(shards) == 1 and offsets[0][0] == first and shards[0].tensor.shape[0] == last - first:
            return shards[0].tensor
        if not shards and first == last:
            return torch.empty((0, *shape[1:]), dtype=value.dtype)
        raise RuntimeError(
            f"fsdp1: a ShardedTensor in the state dict is not split by rows over this unit's group as "
            f"SHARDED_STATE_DICT is (rank {comm.global_rank()} holds offsets {offsets}); load it through "
            "torch.distributed.checkpoint, which reshards."
        )
    return value[first:last]


def _local_part(value: Any) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.to_local()
    if _is_sharded_tensor(value):
        shards = value.local_shards()
        return shards[0].tensor if shards else torch.empty(0)
    return value


def _is_sharded_tensor(value: Any) -> bool:
    return type(value).__name__ == "ShardedTensor" and hasattr(value, "local_shards")
