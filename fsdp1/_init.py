"""Construction-time decisions: the process group, the strategy, which parameters each unit
flattens, and validating all of it before anything is changed.

Validation runs over the whole auto-wrap plan first, so bad input raises with the clean FQN of the
offending parameter and leaves the user's module exactly as it was.
"""

import dataclasses
import functools
import os
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from . import _collectives as comm
from ._common import HYBRID_STRATEGIES
from ._flat_param import FLATTENED, FlatParameter
from ._mixed_precision import plan_full_precision_modules
from ._traversal import (
    ParamSlot,
    clean_fqn,
    is_fsdp_unit,
    iter_outermost_units,
    iter_param_slots,
    iter_unit_submodules,
    unit_name,
    unit_named_buffers,
    unit_named_modules,
    unit_paths,
)
from .api import ShardingStrategy, coerce_enum
from .wrap import AutoWrapPolicy, apply_wrap, children_first, plan_auto_wrap


@dataclasses.dataclass(frozen=True)
class ProcessGroups:
    """The groups a unit communicates over: it shards over ``shard`` and, under a hybrid strategy,
    all-reduces its sharded gradient over ``replicate`` (None when there is no replica to sync)."""

    shard: comm.ProcessGroup
    replicate: Optional[comm.ProcessGroup]


def resolve_process_groups(process_group: Any, device_mesh: Any, strategy: ShardingStrategy) -> ProcessGroups:
    """Where a unit shards and replicates: the default group, ``process_group``, a 1-D ``device_mesh``,
    or for the hybrid strategies a 2-D mesh (dimension 0 replicates, 1 shards, as torch's) or a
    ``(shard_group, replicate_group)`` pair."""
    if process_group is None and device_mesh is None and not comm.is_initialized():
        raise RuntimeError(
            "fsdp1: torch.distributed is not initialized. Call torch.distributed.init_process_group() "
            "(e.g. under torchrun) before wrapping the model."
        )
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "fsdp1: pass process_group or device_mesh, not both: each says which ranks this unit shards "
            "over. Keep device_mesh (it also names the replicate dimension for HYBRID_SHARD)."
        )
    hybrid = strategy in HYBRID_STRATEGIES
    groups: Tuple[Any, ...]
    if device_mesh is not None:
        if not isinstance(device_mesh, comm.DeviceMesh):
            raise ValueError(f"fsdp1: device_mesh must be a torch.distributed DeviceMesh, got {type(device_mesh).__name__}.")
        wanted = 2 if hybrid else 1
        if device_mesh.ndim != wanted:
            shape = "a 2-D mesh (replicate, shard)" if hybrid else "a 1-D mesh"
            raise ValueError(
                f"fsdp1: sharding_strategy={strategy} needs {shape}, but device_mesh is {device_mesh.ndim}-D "
                f"(shape {tuple(device_mesh.shape)}). Build it with init_device_mesh(device_type, "
                f"{'(replicas, shard_size)' if hybrid else '(world_size,)'})."
            )
        groups = tuple(reversed(comm.mesh_groups(device_mesh)))  # (shard, replicate) for 2-D
    elif isinstance(process_group, tuple):
        groups = process_group
        if hybrid and len(groups) == 2 and not all(comm.is_process_group(g) for g in groups):
            raise ValueError(
                "fsdp1: process_group=(shard_group, replicate_group) must hold two torch.distributed "
                f"ProcessGroups, got ({', '.join(type(g).__name__ for g in groups)})."
            )
        if not hybrid or len(groups) != 2:
            raise ValueError(
                "fsdp1: a tuple process_group means (shard_group, replicate_group) and is only for "
                f"HYBRID_SHARD and _HYBRID_SHARD_ZERO2; got a tuple of {len(groups)} with sharding_strategy={strategy}. "
                "Pass one ProcessGroup, or set the hybrid strategy."
            )
    elif process_group is not None and not comm.is_process_group(process_group):
        raise ValueError(
            f"fsdp1: process_group must be a torch.distributed ProcessGroup, or for the hybrid strategies a "
            f"tuple (shard_group, replicate_group); got {type(process_group).__name__}."
        )
    else:
        groups = (process_group if process_group is not None else comm.default_group(),)
    if hybrid and len(groups) != 2:
        raise ValueError(
            f"fsdp1: sharding_strategy={strategy} shards inside one group of ranks and replicates across "
            "another, and needs both: pass device_mesh=init_device_mesh(device_type, (replicas, "
            "shard_size)) or process_group=(shard_group, replicate_group), or neither (one node of "
            "LOCAL_WORLD_SIZE ranks shards, nodes replicate)."
        )
    replicate = groups[1] if len(groups) == 2 and comm.group_size(groups[1]) > 1 else None
    return ProcessGroups(groups[0], replicate)


def node_local_groups() -> Tuple[comm.ProcessGroup, comm.ProcessGroup]:
    """(shard group, replicate group) for a hybrid strategy given neither ``device_mesh`` nor
    ``process_group``, as torch's builds them: shard over the ranks of this node, replicate across
    nodes. A node is ``LOCAL_WORLD_SIZE`` consecutive ranks (set by torchrun); without it the job is
    one node, which then behaves as FULL_SHARD over its ranks (torch's FSDP1 counts CUDA devices
    instead, and on a CPU-only job falls back to NO_SHARD with gradients left unsynced)."""
    world_size = comm.group_size(comm.default_group())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local < 1 or world_size % local:
        raise ValueError(
            f"fsdp1: HYBRID_SHARD without device_mesh shards within each node of LOCAL_WORLD_SIZE={local} ranks, "
            f"which does not divide the world size {world_size}. Pass device_mesh=init_device_mesh(device_type, "
            "(replicas, shard_size)) instead."
        )
    shard = comm.subgroup_of_this_rank([list(range(start, start + local)) for start in range(0, world_size, local)])
    replicate = comm.subgroup_of_this_rank([list(range(first, world_size, local)) for first in range(local)])
    return shard, replicate


def coerce_sharding_strategy(strategy: Optional[ShardingStrategy]) -> ShardingStrategy:
    return ShardingStrategy.FULL_SHARD if strategy is None else coerce_enum(strategy, ShardingStrategy, "sharding_strategy")


def resolve_sharding_strategy(strategy: ShardingStrategy, groups: ProcessGroups) -> ShardingStrategy:
    """NO_SHARD when no rank has anything to split or sync with (as torch). A hybrid strategy whose
    shard group is one rank stays hybrid: its replicas still average gradients (torch's switches to
    NO_SHARD there and stops syncing them, pytorch#154888)."""
    world_size = comm.group_size(groups.shard)
    if world_size == 1 and groups.replicate is None and strategy is not ShardingStrategy.NO_SHARD:
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


class IgnoredStates:
    """What the user keeps out of FSDP (``ignored_modules`` with everything below them, or
    ``ignored_states``), plus what nested units ignore, as torch's: ignored parameters stay
    unflattened, unsharded and not averaged across ranks; ignored modules are neither wrapped,
    materialised, synchronised nor moved. Parameters are held by identity."""

    def __init__(self, modules: Iterable[nn.Module] = (), params: Iterable[nn.Parameter] = ()) -> None:
        self.modules: Set[nn.Module] = set(modules)
        self._params: Dict[int, nn.Parameter] = {id(p): p for p in params}

    @property
    def params(self) -> List[nn.Parameter]:
        return list(self._params.values())

    def has_param(self, param: nn.Parameter) -> bool:
        return self._params.get(id(param)) is param

    def include(self, modules: Iterable[nn.Module] = (), params: Iterable[nn.Parameter] = ()) -> None:
        self.modules.update(modules)
        self._params.update((id(p), p) for p in params)


def resolve_ignored_states(module: nn.Module, ignored_modules: Any, ignored_states: Any) -> IgnoredStates:
    """Check and expand ``ignored_modules`` / ``ignored_states``, naming the offending entry."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "fsdp1: Cannot pass both ignored_modules and ignored_states at the same time; pass ignored_states, "
            "which takes modules and parameters alike (torch deprecates ignored_modules in its favour)."
        )
    argument = "ignored_states" if ignored_states is not None else "ignored_modules"
    try:
        given = list(ignored_states if ignored_states is not None else ignored_modules or ())
    except TypeError:
        raise TypeError(f"fsdp1: {argument} must be an iterable of modules or parameters, got {type(ignored_states or ignored_modules).__name__}.") from None
    given_params = [x for x in given if isinstance(x, nn.Parameter)]
    given_modules = [x for x in given if isinstance(x, nn.Module)]
    types = sorted({type(x) for x in given}, key=repr)  # torch's message lists them so
    if len(given_params) + len(given_modules) != len(given) or (given_params and argument == "ignored_modules"):
        fix = "modules or parameters" if argument == "ignored_states" else "modules (parameters go in ignored_states)"
        expected = "all nn.Parameter or all nn.Module" if argument == "ignored_states" else "nn.Module"
        raise ValueError(f"fsdp1: {argument} expects {expected} list elements but got types {types}; pass {fix}.")
    if given_params and given_modules:
        raise ValueError(
            f"fsdp1: ignored_states expects all nn.Parameter or all nn.Module list elements but got types {types}: "
            "it holds both. Ignore the modules' parameters instead (ignored_states=[*m.parameters(), p])."
        )
    names = {id(m): clean_fqn(name) for name, m in module.named_modules()}
    for m in given_modules:
        if m is module:  # torch's FSDP1 goes on with every parameter ignored: a unit that shards nothing
            warnings.warn(
                f"fsdp1: {argument} holds the module being wrapped itself. Trying to ignore the top-level module "
                "passed into the FSDP constructor itself will result in all parameters being ignored: they stay "
                "unsharded and their gradients are not averaged across ranks. Ignore its submodules instead, "
                "or do not wrap it.",
                stacklevel=3,
            )
        if is_fsdp_unit(m):
            where = f"'{names[id(m)]}'" if id(m) in names else "a module outside this model"
            raise ValueError(
                f"fsdp1: {argument} holds the FullyShardedDataParallel unit {where}; a unit cannot be ignored. "
                "Pass the module it wraps before wrapping it, or leave it out."
            )
    ignored = IgnoredStates(
        (sub for m in given_modules for sub in m.modules() if not is_fsdp_unit(sub)),
        (p for p in given_params if not _is_flattened(p)),
    )
    for unit in module.modules():
        if is_fsdp_unit(unit) and unit is not module:
            ignored.include(unit._ignored.modules, unit._ignored.params)
    ignored.include(params=[p for m in ignored.modules for p in m.parameters() if not _is_flattened(p)])
    return ignored


def auto_wrap(
    module: nn.Module,
    policy: AutoWrapPolicy,
    child_kwargs: Dict[str, Any],
    wrapper_cls: type,
    ignored: IgnoredStates,
) -> None:
    """Plan the units, give every parameter tied across planned units to their closest common unit
    (pytorch#77724), validate every unit's final parameters, and only then wrap children-first."""
    for name, submodule in module.named_modules():
        if is_fsdp_unit(submodule):
            raise ValueError(
                "fsdp1: FSDP auto wrapping requires modules to not already have FSDP applied, but "
                f"'{name}' is already a FullyShardedDataParallel unit. Pass the unwrapped module "
                "with auto_wrap_policy, or wrap every unit by hand without it."
            )
    planned = plan_auto_wrap(module, policy, ignored.modules, child_kwargs, ignored.params)
    plan_full_precision_modules(module, child_kwargs["mixed_precision"], ignored.modules, planned, child_kwargs)
    planned = children_first(module, planned)  # the modules it added where they belong
    plan = _UnitPlan(module, list(planned), ignored)
    for unit in plan.units:
        slots = plan.slots(unit)
        validate_unit_params(plan.path(unit), slots, child_kwargs["use_orig_params"])
        _check_not_flattened(plan.path(unit), slots)
    if child_kwargs["param_init_fn"] is None:
        plan.check_meta_ties_are_initialised()
    for unit, kwargs in planned.items():
        kwargs["_params_of_outer_units"] = plan.left_to_outer_units(unit)  # also: built by auto-wrap
    apply_wrap(module, planned, wrapper_cls)


class _UnitPlan:
    """Which unit flattens each parameter, before any is built. A parameter registered in modules of
    several planned units (an embedding tied to the output head, each matched by the policy) belongs
    to their closest common unit; the units below it leave it alone, so training is exactly DDP's."""

    def __init__(self, root: nn.Module, planned: List[nn.Module], ignored: IgnoredStates) -> None:
        self.units = planned + [root]  # children before parents
        self._paths = {m: name for name, m in root.named_modules()}
        self._parent: Dict[nn.Module, Optional[nn.Module]] = {root: None}
        self._own_slots: Dict[nn.Module, List[ParamSlot]] = {}
        is_planned = set(planned).__contains__
        for unit in reversed(self.units):
            prefix = self._paths[unit] + "." if self._paths[unit] else ""
            stop = lambda m, unit=unit: m is not unit and (is_planned(m) or m in ignored.modules)  # noqa: E731
            self._own_slots[unit] = [s for s in iter_param_slots(unit, prefix, stop) if not ignored.has_param(s.param)]
            for sub in unit.modules():  # parents come first, so the nearest unit is set last
                if sub is not unit and is_planned(sub):
                    self._parent[sub] = unit
        reached: Dict[int, List[nn.Module]] = {}
        for unit in self.units:
            for slot in self._own_slots[unit]:
                units = reached.setdefault(id(slot.param), [])
                if unit not in units:
                    units.append(unit)
        self._owner = {key: functools.reduce(self._common_unit, units) for key, units in reached.items()}

    def _ancestors(self, unit: Optional[nn.Module]) -> List[nn.Module]:
        chain = []
        while unit is not None:
            chain.append(unit)
            unit = self._parent[unit]
        return chain

    def _common_unit(self, a: nn.Module, b: nn.Module) -> nn.Module:
        above_b = set(self._ancestors(b))
        return next(unit for unit in self._ancestors(a) if unit in above_b)

    def path(self, unit: nn.Module) -> str:
        return clean_fqn(self._paths[unit])

    def slots(self, unit: nn.Module) -> List[ParamSlot]:
        """The unit's parameters once built: its own, minus those left to an outer unit, plus those
        left to it from below."""
        return [slot for member in self._units_within(unit) for slot in self._own_slots[member] if self._owner[id(slot.param)] is unit]

    def check_meta_ties_are_initialised(self) -> None:
        """The default meta init resets each unit's own modules; a tied meta parameter given to a unit
        none of whose own modules uses it would keep its buffer's fill values, so refuse it."""
        for unit in self.units:
            for slot in self._own_slots[unit]:
                owner = self._owner[id(slot.param)]
                used_by_owner = any(s.param is slot.param for s in self._own_slots[owner])
                if slot.param.is_meta and not used_by_owner:
                    where = unit_name(self.path(owner))
                    raise ValueError(
                        f"fsdp1: parameter '{slot.fqn}' is tied across units and on the meta device, and {where}, "
                        "which holds it, has no module of its own that uses it, so reset_parameters() would "
                        "never initialise it. Pass param_init_fn=..., or build the model with real weights "
                        "(on rank 0, with sync_module_states=True)."
                    )

    def _units_within(self, unit: nn.Module) -> List[nn.Module]:
        """``unit`` and the planned units below it."""
        return [u for u in self.units if unit in self._ancestors(u)]

    def left_to_outer_units(self, unit: nn.Module) -> List[nn.Parameter]:
        """Parameters in ``unit``'s subtree that a unit above it flattens."""
        within = self._units_within(unit)
        left = {
            id(slot.param): slot.param
            for member in within
            for slot in self._own_slots[member]
            if self._owner[id(slot.param)] not in within
        }
        return list(left.values())


def _is_flattened(param: nn.Parameter) -> bool:
    return isinstance(param, FlatParameter) or getattr(param, FLATTENED, False)


def unit_param_slots(
    module: nn.Module, use_orig_params: bool, ignored: IgnoredStates, left_to_outer: Iterable[nn.Parameter]
) -> List[ParamSlot]:
    """The parameters this unit flattens, validated: those below it and not inside a nested unit,
    plus those inside nested units that no unit manages or ignores (a tied parameter the planner
    left to this unit), minus the ignored ones and those left to an outer unit. A unit around a
    unit (``FSDP(FSDP(m))``) flattens nothing: the inner one owns them all."""
    if is_fsdp_unit(module):
        return []
    excluded = IgnoredStates(params=[*ignored.params, *left_to_outer])
    is_ignored = ignored.modules.__contains__
    nested = list(iter_outermost_units(module, stop=is_ignored))
    inside_nested = {id(m) for _, unit in nested for m in unit.modules()}
    slots, own = [], []
    for slot in iter_param_slots(module, stop=is_ignored):  # module order, as named_parameters()
        if excluded.has_param(slot.param):
            continue
        if id(slot.module) not in inside_nested:
            own.append(slot)
            slots.append(slot)
        elif not _is_flattened(slot.param):  # a tied parameter a nested unit left to this one
            slots.append(dataclasses.replace(slot, fqn=clean_fqn(slot.fqn)))
    _check_not_shared_across_units(own, nested)
    _check_not_flattened("", own)
    validate_unit_params("", slots, use_orig_params)
    return slots


def validate_unit_params(unit_path: str, slots: Sequence[ParamSlot], use_orig_params: bool) -> None:
    """Raise if the unit's parameters cannot form one FlatParameter, naming the parameter and the fix."""
    unit = unit_name(unit_path)
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


def _check_not_shared_across_units(slots: Sequence[ParamSlot], nested: Sequence[Tuple[str, nn.Module]]) -> None:
    """A parameter of this unit that a nested unit already flattened: modules tied by hand were
    wrapped into different units (auto-wrapping leaves such a parameter to their common unit)."""
    handles = [
        (clean_fqn(f"{name}.{path}" if path else name), unit._handle)
        for name, outer in nested
        for unit, path in unit_paths(outer).items()
        if unit._handle is not None
    ]
    for slot in slots:
        for unit_path, handle in handles:
            fqn = handle.fqn_of(slot.param)
            if fqn is not None:
                raise ValueError(
                    f"fsdp1: parameter '{slot.fqn}' is the same tensor as '{unit_path}.{fqn}', which the unit "
                    f"'{unit_path}' already flattened; a parameter can belong to one unit only. Wrap the "
                    "modules that share it in one unit, or pass auto_wrap_policy, which gives a tied "
                    "parameter to the closest unit that holds all the modules using it."
                )


def _check_not_flattened(unit_path: str, slots: Sequence[ParamSlot]) -> None:
    """A parameter some other unit already flattened: the same module object is being wrapped a
    second time, or it shares the parameter with a module wrapped before (flattening its shard views
    again would train silently wrong)."""
    module = f"module '{unit_path}'" if unit_path else "the module"
    for slot in slots:
        if isinstance(slot.param, FlatParameter):
            raise ValueError(
                f"fsdp1: {module} is already wrapped by a FullyShardedDataParallel unit (it holds that unit's "
                f"flat parameter '{slot.fqn}'). Wrap each module object once; to nest units, wrap the existing "
                "FullyShardedDataParallel instance instead of its module."
            )
        if getattr(slot.param, FLATTENED, False):
            raise ValueError(
                f"fsdp1: {module} holds parameter '{slot.fqn}', which another FullyShardedDataParallel unit already "
                "flattened: either this module is already wrapped (wrap each module object once; to nest "
                "units, wrap the existing FullyShardedDataParallel instance instead), or it shares the "
                "parameter with a module wrapped before (a tied weight: wrap the modules that share it in "
                "one unit, or wrap their parent with auto_wrap_policy, which gives the weight to it)."
            )


def check_param_init_fn(param_init_fn: Any) -> None:
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(
            f"fsdp1: param_init_fn must be callable (it is called with each module to initialise), got "
            f"{type(param_init_fn).__name__}."
        )


def _own_states(module: nn.Module) -> List[Any]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


class MetaInit:
    """Gives the modules of this unit (not those of nested units, which did so as they were built,
    nor ignored ones) real storage, so that no rank ever holds more of a meta-built model unsharded
    than one unit. Every module is checked at construction, before any is touched.

    With ``param_init_fn`` it is called on every module of the unit, breadth first (before
    flattening: the user's function decides where storage comes from). Otherwise each module owning
    parameters or buffers is reset with ``reset_parameters()`` as torch's does after ``to_empty``, but
    its parameters are already views of the unit's flat buffer (``reset_in_place``, called by the
    handle), so the unit is never held twice.
    """

    def __init__(self, module: nn.Module, param_init_fn: Optional[Callable[[nn.Module], None]], device: torch.device,
                 ignored: IgnoredStates) -> None:
        named = unit_named_modules(module, ignored.modules)
        self._modules = [m for _, m in named]
        self._param_init_fn = param_init_fn
        self.device = device
        self.is_needed = any(t.is_meta for m in self._modules for t in _own_states(m))
        if self.is_needed and param_init_fn is None:
            for name, m in named:
                if _own_states(m) and not callable(getattr(m, "reset_parameters", None)):
                    where = f"module '{clean_fqn(name)}'" if name else "the module"
                    raise ValueError(
                        f"fsdp1: {where} ({type(m).__name__}) is on the meta device but has no reset_parameters() to "
                        "initialise it. Pass param_init_fn=..., called with each module, e.g. "
                        "lambda m: m.to_empty(device=torch.device('cpu'), recurse=False) followed by your own init."
                    )

    @property
    def is_in_place(self) -> bool:
        return self.is_needed and self._param_init_fn is None

    def run_param_init_fn(self) -> None:
        with torch.no_grad():
            for m in self._modules:
                self._param_init_fn(m)

    def reset_in_place(self) -> None:
        """The unit's parameters already have storage: give meta buffers theirs, then reset."""
        with torch.no_grad():
            for m in self._modules:
                if not _own_states(m):
                    continue
                for attr, buffer in m._buffers.items():
                    if buffer is not None and buffer.is_meta:
                        m._buffers[attr] = torch.empty_like(buffer, device=self.device)
                m.reset_parameters()


def sync_module_states(module: nn.Module, slots: Sequence[ParamSlot], ignored: IgnoredStates, groups: ProcessGroups) -> None:
    """Every rank takes the first rank's values of this unit's parameters and of the buffers of its
    modules (not ignored ones). Shapes and dtypes are compared first, so a mismatch raises the same
    error on every rank instead of hanging in a broadcast of the wrong size. Under a hybrid strategy
    the replicas then take their first replica's."""
    named = [(slot.fqn, slot.param) for slot in slots] + [
        (fqn, buffer) for fqn, _, _, buffer in unit_named_buffers(module, ignored.modules)
    ]
    unique = list({id(tensor): (fqn, tensor) for fqn, tensor in named}.values())
    for group in (groups.shard, groups.replicate):
        if group is not None:
            _check_same_shapes(unique, group)
            with torch.no_grad():
                works = [comm.broadcast_from_first(tensor.data, group) for _, tensor in unique]
                for work in works:
                    work.wait()


REQUIRE_SAME_VALUES = "FSDP1_REQUIRE_SAME_VALUES"
"""Set to 1 to refuse, instead of warn about, ranks that built the model with different values."""


def check_same_values(module: nn.Module, ignored: IgnoredStates, groups: ProcessGroups) -> None:
    """Without ``sync_module_states`` the ranks should have built the same values: each keeps its own
    shard of what it built, so ranks seeded differently train a mix of their models (pytorch#75870),
    which torch's FSDP1 accepts silently and scripts rely on (a tutorial whose workers are not seeded
    alike, a DDP script that seeds each rank for its data order). So different values are warned
    about on every rank, naming the first parameter and the fixes, and refused only when
    ``FSDP1_REQUIRE_SAME_VALUES=1``; different shapes or dtypes, which no training survives, are
    refused. Before anything is wrapped, each parameter's shape, dtype, sum and norm (reductions in
    its own dtype, so no copy is made; equal values give equal results bitwise) are compared across
    the ranks in one object all-gather. Parameters on the meta device have no values yet, and
    flattened ones (a unit's shards) differ by design."""
    slots = [slot for slot in iter_param_slots(module) if not ignored.has_param(slot.param)
             and slot.param.is_floating_point() and not slot.param.is_meta and not _is_flattened(slot.param)]
    unique = list({id(slot.param): slot for slot in slots}.values())
    if not unique:
        return
    with torch.no_grad():
        sums = torch.stack([v.double() for slot in unique for v in (slot.param.sum(), torch.linalg.vector_norm(slot.param))])
    values = [value.hex() for value in sums.tolist()]  # hex: exact, and a NaN equals a NaN
    mine = [(tuple(slot.param.shape), str(slot.param.dtype), values[2 * i], values[2 * i + 1]) for i, slot in enumerate(unique)]
    for group in (groups.shard, groups.replicate):
        if group is None or comm.group_size(group) == 1 or comm.is_fake(group):
            continue
        every = comm.all_gather_object(mine, group)
        for rank, theirs in enumerate(every):
            here, first = comm.global_rank_of(group, rank), comm.global_rank_of(group, 0)
            if len(theirs) != len(every[0]):
                raise ValueError(
                    f"fsdp1: the module has {len(theirs)} floating-point parameters on rank {here} but "
                    f"{len(every[0])} on rank {first}; build the same model on every rank."
                )
            for slot, (shape, dtype, _, _), (first_shape, first_dtype, _, _) in zip(unique, theirs, every[0]):
                if (shape, dtype) != (first_shape, first_dtype):
                    raise ValueError(
                        f"fsdp1: '{clean_fqn(slot.fqn)}' is {dtype} of shape {shape} on rank {here} but "
                        f"{first_dtype} of shape {first_shape} on rank {first}; build the same model on every rank."
                    )
            differing = next((slot for slot, a, b in zip(unique, theirs, every[0]) if a != b), None)
            if differing is not None:
                _report_different_values(clean_fqn(differing.fqn), here, first)
                return


def _report_different_values(fqn: str, rank: int, first: int) -> None:
    message = (
        f"fsdp1: '{fqn}' has other values on rank {rank} than on rank {first}: the ranks built the model "
        "differently (other seeds?), and each keeps its own shard of what it built, so they train a mix of "
        "their models. Seed every rank alike before building the model, or pass sync_module_states=True "
        f"to take the first rank's values ({REQUIRE_SAME_VALUES}=1 makes this an error)."
    )
    if os.environ.get(REQUIRE_SAME_VALUES) == "1":
        raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=4)


def _check_same_shapes(named: Sequence[Tuple[str, torch.Tensor]], group: comm.ProcessGroup) -> None:
    mine = [(fqn, tuple(t.shape), str(t.dtype)) for fqn, t in named]
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


def move_to_compute_device(module: nn.Module, device: torch.device, ignored: IgnoredStates) -> None:
    """``module.to(device)`` except ignored modules and parameters, which stay where the user put them."""
    with torch.no_grad():
        for m in (module, *iter_unit_submodules(module, ignored.modules)):
            for attr, param in m._parameters.items():
                if param is not None and not ignored.has_param(param) and param.device != device:
                    param.data = param.data.to(device)
            for attr, buffer in m._buffers.items():
                if buffer is not None and buffer.device != device:
                    m._buffers[attr] = buffer.to(device)
