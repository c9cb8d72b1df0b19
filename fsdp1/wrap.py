"""Auto-wrap policies and the post-order planner that decides which submodules become units.

Planning is separate from wrapping: ``plan_auto_wrap`` only reads the tree, so the caller can
validate every planned unit before changing anything, and ``apply_wrap`` then replaces the planned
submodules children-first. Legacy callable policies ``(module, recurse, nonwrapped_numel)`` and
``_Policy`` objects are both accepted. The other named policies arrive in a later release.
"""

import copy
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, Iterable, Set, Tuple, Type, Union

from torch import nn

__all__ = ["ModuleWrapPolicy"]


class _Policy(ABC):
    """A policy that maps each submodule to wrap onto the constructor kwargs for its unit."""

    @abstractmethod
    def _run_policy(
        self, root_module: nn.Module, ignored_modules: Set[nn.Module], root_kwargs: Dict[str, Any]
    ) -> Dict[nn.Module, Dict[str, Any]]:
        ...


class ModuleWrapPolicy(_Policy):
    """Wrap every instance of the given module classes (e.g. a transformer block) as its own unit."""

    def __init__(self, module_classes: Iterable[Type[nn.Module]]):
        module_classes_set = set(module_classes)
        self._module_classes = tuple(module_classes_set)
        self._module_classes_str = str(module_classes_set)

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        return {
            module: copy.copy(root_kwargs)
            for module in root_module.modules()
            if module not in ignored_modules and isinstance(module, self._module_classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """The legacy callable form: recurse everywhere, wrap instances of the classes."""
        return True if recurse else isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._module_classes_str})"


AutoWrapPolicy = Union[_Policy, Callable[..., bool]]


def plan_auto_wrap(
    root: nn.Module, policy: AutoWrapPolicy, ignored_modules: Set[nn.Module], root_kwargs: Dict[str, Any]
) -> Dict[nn.Module, Dict[str, Any]]:
    """The submodules of ``root`` (never ``root`` itself) to wrap, children before parents, with
    the kwargs of each unit. Reads the tree only."""
    if isinstance(policy, _Policy):
        targets = policy._run_policy(root, ignored_modules, root_kwargs)
        targets.pop(root, None)
        order = [m for m in _post_order(root) if m in targets]
        return {m: targets[m] for m in order}
    planned: Dict[nn.Module, Dict[str, Any]] = {}
    _plan_legacy(root, policy, ignored_modules, planned, root_kwargs, is_root=True)
    return planned


def _plan_legacy(module, policy, ignored_modules, planned, root_kwargs, is_root) -> int:
    """Numel that ``module`` contributes to units planned at or below it (legacy recursion)."""
    nonwrapped_numel = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        return 0
    wrapped_numel = 0
    for child in module.children():
        if child not in ignored_modules and child not in planned:
            wrapped_numel += _plan_legacy(child, policy, ignored_modules, planned, root_kwargs, False)
    remainder = nonwrapped_numel - wrapped_numel
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=remainder):
        planned[module] = copy.copy(root_kwargs)
        return nonwrapped_numel
    return wrapped_numel


def _post_order(root: nn.Module) -> Tuple[nn.Module, ...]:
    order, seen = [], set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if child not in seen:
                seen.add(child)
                visit(child)
                order.append(child)

    visit(root)
    return tuple(order)


def apply_wrap(root: nn.Module, planned: Dict[nn.Module, Dict[str, Any]], wrapper_cls: Callable[..., nn.Module]) -> None:
    """Replace each planned submodule of ``root`` by ``wrapper_cls(submodule, **kwargs)``, children
    first; a submodule reachable from two parents is wrapped once and both see the same unit."""
    wrapped: Dict[nn.Module, nn.Module] = {}

    def visit(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if child not in wrapped:
                visit(child)
                wrapped[child] = wrapper_cls(child, **planned[child]) if child in planned else child
            if wrapped[child] is not child:
                setattr(module, name, wrapped[child])

    visit(root)
