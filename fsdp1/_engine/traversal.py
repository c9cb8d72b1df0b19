"""Finding units and parameter registrations (``ParamSlot``), naming things by their clean FQN, and
walking nested outputs.

Read-only: nothing here changes a module. A module counts as an FSDP unit when its class says so
(``_is_fsdp_unit``) or it holds a unit state, which keeps this module free of an import of the
wrapper class.
"""

import dataclasses
from collections import deque
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."
_WRAPPER_NAMES = (FSDP_WRAPPED_MODULE, CHECKPOINT_PREFIX[:-1])


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One place a parameter is registered: ``module.<attr>``, reached as ``fqn`` from the unit.

    ``param`` is the original Parameter. Without use_orig_params the handle drops it once flattened
    (``param`` becomes None), so that its full-size storage is freed.
    """

    fqn: str
    module: nn.Module
    attr: str
    param: Optional[nn.Parameter]

    @property
    def live_param(self) -> nn.Parameter:
        """``param`` where it must still be held: before the handle flattens it (construction), or
        with use_orig_params."""
        assert self.param is not None, f"the parameter '{self.fqn}' was dropped when its unit flattened it"
        return self.param


def clean_fqn(fqn: str) -> str:
    """``fqn`` as the user's unwrapped model names it (a unit's own path may end in a wrapper name)."""
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_NAMES)


def unit_name(path: str) -> str:
    """A unit as messages name it: by its clean path, or as the root."""
    return f"unit '{path}'" if path else "the root unit"


FSDP_STATE = "_fsdp_state"
"""The attribute under which a unit module holds its ``UnitState`` (in its ``__dict__``)."""


def is_fsdp_unit(module: nn.Module) -> bool:
    """A ``FullyShardedDataParallel`` (its class says so), or any module that holds a unit state."""
    return getattr(type(module), "_is_fsdp_unit", False) or FSDP_STATE in module.__dict__


def first_fully_shard_module(module: nn.Module) -> Optional[str]:
    """The path of the first module in ``module``'s tree that ``fully_shard`` made a unit (it holds a
    unit state without being a ``FullyShardedDataParallel``), if any."""
    return next((name for name, m in module.named_modules()
                 if FSDP_STATE in m.__dict__ and not getattr(type(m), "_is_fsdp_unit", False)), None)


def fsdp_units(module: nn.Module, root_only: bool = False) -> List[nn.Module]:
    """Every unit in ``module``'s tree (``module.modules()`` order); only the outermost with ``root_only``."""
    units = [m for m in module.modules() if is_fsdp_unit(m)]
    if not root_only:
        return units
    nested = {id(m) for unit in units for m in unit.modules() if m is not unit and is_fsdp_unit(m)}
    return [unit for unit in units if id(unit) not in nested]


def unit_paths(root: nn.Module) -> Dict[nn.Module, str]:
    """Clean path of every unit below ``root`` ('' for the root itself)."""
    return {m: clean_fqn(name) for name, m in root.named_modules() if is_fsdp_unit(m)}


def iter_param_slots(
    module: nn.Module, prefix: str = "", stop: Callable[[nn.Module], bool] = is_fsdp_unit
) -> Iterator[ParamSlot]:
    """Every registration of a parameter in ``module``'s tree, in ``module.parameters()`` order and
    with repeats, not descending into modules for which ``stop`` holds (nested units)."""
    for attr, param in module._parameters.items():
        if param is not None:
            yield ParamSlot(prefix + attr, module, attr, param)
    for name, child in module._modules.items():
        if child is not None and not stop(child):
            yield from iter_param_slots(child, f"{prefix}{name}.", stop)


Registrations = Tuple[Tuple[ParamSlot, ...], Tuple[Tuple[ParamSlot, int], ...], Tuple[Tuple[str, int], ...]]


def split_registrations(slots: Sequence[ParamSlot]) -> Registrations:
    """First occurrence of each parameter; every later registration of it with its first's index;
    and the other names of a registration already seen: a module registered under two names
    (``m.b = m.a``) is reached twice with the same attribute, one registration whose second name
    only state dicts list."""
    first_index: Dict[int, int] = {}  # id(param) -> index in unique: identity, never tensor ==
    registrations = set()
    unique: List[ParamSlot] = []
    shared: List[Tuple[ParamSlot, int]] = []
    aliases: List[Tuple[str, int]] = []
    for slot in slots:
        index = first_index.get(id(slot.param))
        if (id(slot.module), slot.attr) in registrations:
            aliases.append((slot.fqn, index))  # type: ignore[arg-type]  # a registration seen before has an index
            continue
        registrations.add((id(slot.module), slot.attr))
        if index is not None:
            shared.append((slot, index))
        else:
            first_index[id(slot.param)] = len(unique)
            unique.append(slot)
    return tuple(unique), tuple(shared), tuple(aliases)


def iter_outermost_units(module: nn.Module, prefix: str = "", stop: Callable[[nn.Module], bool] = lambda m: False) -> Iterator[Tuple[str, nn.Module]]:
    """The units below ``module`` that no other unit below it encloses, with their paths from it;
    modules for which ``stop`` holds are not searched."""
    for name, child in module._modules.items():
        if child is None or stop(child):
            continue
        if is_fsdp_unit(child):
            yield prefix + name, child
        else:
            yield from iter_outermost_units(child, f"{prefix}{name}.", stop)


def iter_unit_submodules(module: nn.Module, ignored: Collection[nn.Module] = ()) -> Iterator[nn.Module]:
    """Every module below ``module`` (not itself) that belongs to the same unit, breadth first (the
    order torch's FSDP1 initialises meta modules in): nested units, ``ignored`` modules and what
    lies below them are left out, and a module reachable twice comes once."""
    seen = {id(module)}
    queue = deque([module])
    while queue:
        for child in queue.popleft()._modules.values():
            if child is not None and not is_fsdp_unit(child) and child not in ignored and id(child) not in seen:
                seen.add(id(child))
                queue.append(child)
                yield child


def unit_named_modules(module: nn.Module, ignored: Collection[nn.Module] = ()) -> List[Tuple[str, nn.Module]]:
    """``module`` and the modules of its unit with their names from it, breadth first (torch's order)."""
    names = {id(m): name for name, m in module.named_modules()}
    return [(names[id(m)], m) for m in (module, *iter_unit_submodules(module, ignored))]


def unit_named_buffers(module: nn.Module, ignored: Collection[nn.Module] = ()) -> Iterator[Tuple[str, nn.Module, str, torch.Tensor]]:
    """The buffers of ``module``'s unit (not of nested units or ``ignored`` modules) as (clean name
    from ``module``, owning module, attribute, buffer)."""
    for name, owner in unit_named_modules(module, ignored):
        for attr, buffer in owner._buffers.items():
            if buffer is not None:
                yield clean_fqn(f"{name}.{attr}" if name else attr), owner, attr, buffer


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside tuples, lists, sets, dicts and dataclasses (a module's output)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))
