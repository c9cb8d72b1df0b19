"""Which parameters each unit flattens, decided and validated before anything is changed: what the
user keeps out of FSDP (``IgnoredStates``), the auto-wrap plan (a parameter tied across planned
units goes to their closest common unit), and the checks that a unit's parameters can form one
FlatParameter.

Validation runs over the whole auto-wrap plan first, so bad input raises with the clean FQN of the
offending parameter and leaves the user's module exactly as it was.

A copy of a tied weight in each unit was rejected: each copy would get only its own modules'
share of the gradient, and the copies would drift apart.
"""

import dataclasses
import functools
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, cast

from torch import nn

from .._engine.flat_parameter import FlatParameter
from .._engine.handle import FlatParamHandle
from .._engine.traversal import (
    ParamSlot,
    clean_fqn,
    first_fully_shard_module,
    is_fsdp_unit,
    iter_outermost_units,
    iter_param_slots,
    unit_name,
    unit_paths,
)
from .._engine.views import FLATTENED
from ..wrap import AutoWrapPolicy, apply_wrap, children_first, plan_auto_wrap
from .mixed_precision_argument import plan_full_precision_modules


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


def refuse_fully_shard_modules(module: nn.Module) -> None:
    """A model is wrapped by FullyShardedDataParallel or sharded by fully_shard, not both."""
    sharded = first_fully_shard_module(module)
    if sharded is not None:
        raise ValueError(
            f"fsdp1: cannot wrap a module that contains the fully_shard module '{sharded or type(module).__name__}' in "
            "FullyShardedDataParallel: a model uses FullyShardedDataParallel or fully_shard, not both. Build the "
            "model again and use one (fully_shard the root too, instead of wrapping it)."
        )


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
        (p for p in given_params if not is_flattened(p)),
    )
    for unit in module.modules():
        if is_fsdp_unit(unit) and unit is not module:
            # A unit's own; mypy types attributes that nn.Module does not declare as Tensor | Module.
            by_unit = cast(IgnoredStates, unit._ignored)
            ignored.include(by_unit.modules, by_unit.params)
    ignored.include(params=[p for m in ignored.modules for p in m.parameters() if not is_flattened(p)])
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
            raise ValueError(  # torch's phrase
                f"fsdp1: FSDP auto wrapping requires modules to not already have FSDP applied but found {name} in "
                f"{type(module).__name__}: '{name}' is already a FullyShardedDataParallel unit. Pass the "
                "unwrapped module with auto_wrap_policy, or wrap every unit by hand without it."
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
            self._own_slots[unit] = [s for s in iter_param_slots(unit, prefix, stop) if not ignored.has_param(s.live_param)]
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
                if slot.live_param.is_meta and not used_by_owner:
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
            id(slot.param): slot.live_param
            for member in within
            for slot in self._own_slots[member]
            if self._owner[id(slot.param)] not in within
        }
        return list(left.values())


def is_flattened(param: nn.Parameter) -> bool:
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
        if excluded.has_param(slot.live_param):
            continue
        if id(slot.module) not in inside_nested:
            own.append(slot)
            slots.append(slot)
        elif not is_flattened(slot.live_param):  # a tied parameter a nested unit left to this one
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
        param = slot.live_param
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
        if param.dtype != first.live_param.dtype:
            raise ValueError(
                f"fsdp1: {unit} must flatten parameters of one dtype, but '{first.fqn}' is {first.live_param.dtype} "
                f"and '{slot.fqn}' is {param.dtype}. Cast the module to one dtype before wrapping "
                "(e.g. module.float()), or wrap the submodule of the other dtype as its own unit."
            )
        if param.device != first.live_param.device:
            raise ValueError(
                f"fsdp1: {unit} must flatten parameters on one device, but '{first.fqn}' is on "
                f"{first.live_param.device} and '{slot.fqn}' is on {param.device}. Pass device_id=... or move the "
                "module to one device before wrapping."
            )
        if not use_orig_params and param.requires_grad != first.live_param.requires_grad:
            trainable = _names(s.fqn for s in slots if s.live_param.requires_grad)
            frozen = _names(s.fqn for s in slots if not s.live_param.requires_grad)
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
    handles = [  # cast: a unit's handle, which mypy types as nn.Module's unknown attribute (Tensor | Module)
        (clean_fqn(f"{name}.{path}" if path else name), cast(FlatParamHandle, unit._handle))
        for name, outer in nested
        for unit, path in unit_paths(outer).items()
        if unit._handle is not None
    ]
    for slot in slots:
        for unit_path, handle in handles:
            fqn = handle.views.fqn_of(slot.live_param)
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

