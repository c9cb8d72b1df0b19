"""Construction-time decisions: the process group, the strategy, which parameters each unit
flattens, and validating all of it before anything is changed.

Validation runs over the whole auto-wrap plan first, so bad input raises with the clean FQN of the
offending parameter and leaves the user's module exactly as it was.
"""

import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _collectives as comm
from ._flat_param import FLATTENED, FlatParameter, ParamSlot
from ._traversal import clean_fqn, is_fsdp_unit, iter_param_slots, iter_unit_submodules
from .api import CPUOffload, ShardingStrategy, coerce_enum
from .wrap import AutoWrapPolicy, apply_wrap, plan_auto_wrap

SHARDED_STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)


def reject_unsupported(**arguments: Any) -> None:
    """Constructor arguments torch accepts whose features fsdp1 does not have yet: refuse them loudly
    rather than train differently from what the script asked for."""
    defaults = {
        "mixed_precision": None,
        "ignored_modules": None,
        "ignored_states": None,
        "device_mesh": None,
    }
    for name, value in arguments.items():
        if name == "cpu_offload":
            if value is not None and getattr(value, "offload_params", False):
                raise NotImplementedError(
                    "fsdp1: cpu_offload=CPUOffload(offload_params=True) is not supported yet; "
                    "remove the argument to keep parameters on the compute device."
                )
        elif value:  # None, False and empty iterables all mean "not used", as in torch
            raise NotImplementedError(
                f"fsdp1: {name}= is not supported yet; remove the argument (its default is {defaults[name]!r})."
            )


def resolve_process_group(process_group: Optional[comm.ProcessGroup]) -> comm.ProcessGroup:
    if not comm.is_initialized():
        raise RuntimeError(
            "fsdp1: torch.distributed is not initialized. Call torch.distributed.init_process_group() "
            "(e.g. under torchrun) before wrapping the model."
        )
    if process_group is not None and not isinstance(process_group, comm.ProcessGroup):
        raise ValueError(
            f"fsdp1: process_group must be a torch.distributed ProcessGroup, got {type(process_group).__name__}; "
            "hybrid strategies with a (shard, replicate) tuple are not supported yet."
        )
    return process_group if process_group is not None else comm.default_group()


def resolve_sharding_strategy(strategy: Optional[ShardingStrategy], world_size: int) -> ShardingStrategy:
    """FULL_SHARD by default; NO_SHARD on one rank, where sharding has nothing to split (as torch)."""
    strategy = ShardingStrategy.FULL_SHARD if strategy is None else coerce_enum(strategy, ShardingStrategy, "sharding_strategy")
    if strategy not in SHARDED_STRATEGIES + (ShardingStrategy.NO_SHARD,):
        raise NotImplementedError(
            f"fsdp1: sharding_strategy={strategy} is not supported yet; use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD."
        )
    if world_size == 1 and strategy is not ShardingStrategy.NO_SHARD:
        warnings.warn(
            "FSDP is switching to use `NO_SHARD` instead of "
            f"{strategy} since the world size is 1.",
            stacklevel=3,
        )
        return ShardingStrategy.NO_SHARD
    if strategy is ShardingStrategy.NO_SHARD and world_size > 1:
        warnings.warn(
            "The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
            "`DistributedDataParallel` instead.",
            FutureWarning,
            stacklevel=3,
        )
    return strategy


def resolve_cpu_offload(cpu_offload: Optional[CPUOffload]) -> CPUOffload:
    return CPUOffload(offload_params=False) if cpu_offload is None else cpu_offload


def auto_wrap(
    module: nn.Module,
    policy: AutoWrapPolicy,
    child_kwargs: Dict[str, Any],
    wrapper_cls: type,
    use_orig_params: bool,
) -> None:
    """Validate every unit the policy plans, then wrap the planned submodules children-first."""
    for name, submodule in module.named_modules():
        if is_fsdp_unit(submodule):
            raise ValueError(
                "fsdp1: auto_wrap_policy needs a module without FSDP units inside, but "
                f"'{name}' is already a FullyShardedDataParallel unit. Pass the unwrapped module "
                "with auto_wrap_policy, or wrap every unit by hand without it."
            )
    planned = plan_auto_wrap(module, policy, set(), child_kwargs)
    paths = {m: name for name, m in module.named_modules()}
    owners: Dict[nn.Parameter, str] = {}
    for unit in list(planned) + [module]:
        stop = lambda m, unit=unit: m is not unit and (m in planned or is_fsdp_unit(m))  # noqa: E731
        prefix = paths[unit] + "." if paths[unit] else ""
        slots = list(iter_param_slots(unit, prefix, stop))
        validate_unit_params(paths[unit], slots, use_orig_params)
        _check_not_shared_across_units(paths[unit], slots, owners)
        _check_not_flattened(paths[unit], slots)
    apply_wrap(module, planned, wrapper_cls)


def unit_param_slots(module: nn.Module, use_orig_params: bool) -> List[ParamSlot]:
    """The parameters this unit flattens: those below it and not inside a nested unit, validated.
    A unit around a unit (``FSDP(FSDP(m))``) flattens nothing: the inner one owns them all."""
    if is_fsdp_unit(module):
        return []
    slots = list(iter_param_slots(module))
    validate_unit_params("", slots, use_orig_params)
    owners = {
        slot.param: clean_fqn(name)
        for name, nested in module.named_modules()
        if is_fsdp_unit(nested) and nested._handle is not None
        for slot in slots
        if nested._handle.manages(slot.param)
    }
    _check_not_shared_across_units("", slots, owners)
    _check_not_flattened("", slots)
    return slots


def validate_unit_params(unit_path: str, slots: Sequence[ParamSlot], use_orig_params: bool) -> None:
    """Raise if the unit's parameters cannot form one FlatParameter, naming the parameter and the fix."""
    unit = f"unit '{unit_path}'" if unit_path else "the root unit"
    first: Optional[ParamSlot] = None
    for slot in slots:
        param = slot.param
        if not (param.is_floating_point() or param.is_complex()):
            raise ValueError(
                f"fsdp1: parameter '{slot.fqn}' has dtype {param.dtype}; FSDP can only shard floating-point "
                "parameters, since integer tensors have no gradient. Register it as a buffer "
                "(module.register_buffer) instead."
            )
        if param.dim() == 0:
            raise ValueError(
                f"fsdp1: parameter '{slot.fqn}' is a 0-dim (scalar) tensor, which FSDP cannot flatten. "
                "Make it a 1-D tensor, e.g. nn.Parameter(value.reshape(1))."
            )
        if first is None:
            first = slot
            continue
        if param.dtype != first.param.dtype:
            raise ValueError(
                f"fsdp1: {unit} must flatten parameters of one dtype, but '{first.fqn}' is {first.param.dtype} "
                f"and '{slot.fqn}' is {param.dtype}. Cast the module to one dtype before wrapping "
                "(e.g. module.float()), or wrap the submodule of the other dtype as its own unit."
            )
        if param.device != first.param.device:
            raise ValueError(
                f"fsdp1: {unit} must flatten parameters on one device, but '{first.fqn}' is on "
                f"{first.param.device} and '{slot.fqn}' is on {param.device}. Pass device_id=... or move the "
                "module to one device before wrapping."
            )
        if not use_orig_params and param.requires_grad != first.param.requires_grad:
            trainable = _names(s.fqn for s in slots if s.param.requires_grad)
            frozen = _names(s.fqn for s in slots if not s.param.requires_grad)
            raise ValueError(
                f"fsdp1: {unit} mixes trainable parameters ({trainable}) and frozen ones ({frozen}), but with "
                "use_orig_params=False a unit's one FlatParameter has one requires_grad. Pass "
                "use_orig_params=True, or wrap the frozen submodules as units of their own."
            )


def _names(fqns: Iterable[str], most: int = 6) -> str:
    """Quoted names, the first ``most`` of them and how many more."""
    fqns = list(dict.fromkeys(fqns))
    shown = ", ".join(f"'{fqn}'" for fqn in fqns[:most])
    return shown if len(fqns) <= most else f"{shown} and {len(fqns) - most} more"


def _check_not_shared_across_units(unit_path: str, slots: Sequence[ParamSlot], owners: Dict[nn.Parameter, str]) -> None:
    for slot in slots:
        owner = owners.setdefault(slot.param, unit_path)
        if owner != unit_path:
            where = f"unit '{owner}'" if owner else "the root unit"
            here = f"unit '{unit_path}'" if unit_path else "the root unit"
            raise ValueError(
                f"fsdp1: parameter '{slot.fqn}' is shared between {here} and {where}; a parameter can "
                "belong to one unit only. Wrap the modules that share it in one unit (e.g. leave the "
                "tied embedding and output layer to their common parent)."
            )


def _check_not_flattened(unit_path: str, slots: Sequence[ParamSlot]) -> None:
    """A parameter some other unit already flattened means the same module object is being wrapped a
    second time; flattening its shard views again would train silently wrong."""
    for slot in slots:
        if isinstance(slot.param, FlatParameter) or getattr(slot.param, FLATTENED, False):
            module = f"module '{unit_path}'" if unit_path else "the module"
            raise ValueError(
                f"fsdp1: {module} is already wrapped by another FullyShardedDataParallel instance (its "
                f"parameter '{slot.fqn}' was flattened by it). Wrap each module object once; to nest units, "
                "wrap the existing FullyShardedDataParallel instance instead of its module."
            )


def check_param_init_fn(param_init_fn: Any) -> None:
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(
            f"fsdp1: param_init_fn must be callable (it is called with each module to initialise), got "
            f"{type(param_init_fn).__name__}."
        )


def _own_states(module: nn.Module) -> List[Any]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def materialize_meta_modules(module: nn.Module, param_init_fn: Optional[Callable[[nn.Module], None]], device: Any) -> None:
    """Give the modules of this unit (not those of nested units, which did so as they were built)
    real storage, so that no rank ever holds more of a meta-built model unsharded than one unit.

    With ``param_init_fn`` it is called on every module of the unit, breadth first; otherwise each
    module owning parameters or buffers gets ``to_empty`` and ``reset_parameters()``, as torch's.
    Every module is checked before any is touched.
    """
    named = _unit_named_modules(module)
    modules = [m for _, m in named]
    if not any(t.is_meta for m in modules for t in _own_states(m)):
        return
    if param_init_fn is None:
        for name, m in named:
            if _own_states(m) and not callable(getattr(m, "reset_parameters", None)):
                where = f"module '{clean_fqn(name)}'" if name else "the module"
                raise ValueError(
                    f"fsdp1: {where} ({type(m).__name__}) is on the meta device but has no reset_parameters() to "
                    "initialise it. Pass param_init_fn=..., called with each module, e.g. "
                    "lambda m: m.to_empty(device=torch.device('cpu'), recurse=False) followed by your own init."
                )
    with torch.no_grad():
        for m in modules:
            if param_init_fn is not None:
                param_init_fn(m)
            elif _own_states(m):
                m.to_empty(device=device, recurse=False)
                m.reset_parameters()


def sync_module_states(module: nn.Module, group: comm.ProcessGroup) -> None:
    """Every rank takes the first rank's values of this unit's parameters and buffers. Shapes and
    dtypes are compared first, so a mismatch raises the same error on every rank instead of hanging
    in a broadcast of the wrong size."""
    named = [(clean_fqn(f"{name}.{attr}" if name else attr), tensor)
             for name, m in _unit_named_modules(module)
             for attr, tensor in (*m._parameters.items(), *m._buffers.items()) if tensor is not None]
    unique = list({id(tensor): (fqn, tensor) for fqn, tensor in named}.values())
    mine = [(fqn, tuple(t.shape), str(t.dtype)) for fqn, t in unique]
    for rank, theirs in enumerate(comm.all_gather_object(mine, group)):
        for (fqn, shape, dtype), (_, their_shape, their_dtype) in zip(mine, theirs):
            if (shape, dtype) != (their_shape, their_dtype):
                raise ValueError(
                    f"fsdp1: sync_module_states: '{fqn}' is {dtype} of shape {shape} on rank {comm.group_rank(group)} "
                    f"but {their_dtype} of shape {their_shape} on rank {rank}; build the same model on every rank."
                )
        if len(theirs) != len(mine):
            raise ValueError(
                f"fsdp1: sync_module_states: rank {comm.group_rank(group)} has {len(mine)} parameters and buffers "
                f"here but rank {rank} has {len(theirs)}; build the same model on every rank."
            )
    with torch.no_grad():
        works = [comm.broadcast_from_first(tensor.data, group) for _, tensor in unique]
        for work in works:
            work.wait()


def _unit_named_modules(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``module`` and the modules of its unit with their names, breadth first (torch's order)."""
    names = {id(m): name for name, m in module.named_modules()}
    return [(names[id(m)], m) for m in (module, *iter_unit_submodules(module))]
