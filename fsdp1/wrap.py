"""Auto-wrap policies, manual wrapping, and the post-order planner that decides which submodules
become units.

Planning is separate from wrapping: ``plan_auto_wrap`` only reads the tree, so the caller can
validate every planned unit before changing anything, and ``apply_wrap`` then replaces the planned
submodules children-first. Two kinds of policy exist, as in torch: callables
``(module, recurse, nonwrapped_numel) -> bool`` (``always_wrap_policy``, ``lambda_auto_wrap_policy``,
``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy``, with their extra arguments bound by
``functools.partial``), planned by a depth-first recursion that counts the numel not yet wrapped; and
``_Policy`` objects (``ModuleWrapPolicy``, ``CustomPolicy``, or torch's own) that map modules to unit
kwargs directly. ``enable_wrap`` and ``wrap`` annotate modules by hand. The private helpers of torch's
wrap module that clients import (``_or_policy``, ``_module_wrap_policy``,
``_wrap_module_cls_individually``, ``_recursive_wrap``) exist here with torch's signatures.
"""

import contextlib
import copy
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, Optional, Protocol, Sequence, Set, Tuple, Type, Union

from torch import nn

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
    "CustomPolicy",
    "ModuleWrapPolicy",
]


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
        return _module_wrap_policy(module, recurse, -1, self._module_classes)

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._module_classes_str})"


class CustomPolicy(_Policy):
    """Wrap where ``lambda_fn(module)`` says so: ``True`` with the root's kwargs, a non-empty dict with
    the root's kwargs updated by it (a per-unit ``sharding_strategy``, say), ``False`` or ``{}`` not."""

    def __init__(self, lambda_fn: Callable[[nn.Module], Union[bool, Dict[str, Any]]]):
        self._lambda_fn = lambda_fn

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        targets: Dict[nn.Module, Dict[str, Any]] = {}
        for name, module in root_module.named_modules():
            if module in ignored_modules:
                continue
            decision = self._lambda_fn(module)
            if not isinstance(decision, (bool, dict)):
                raise ValueError(
                    f"fsdp1: CustomPolicy's lambda_fn returned {decision!r} for module '{name}'; it must return "
                    "True, False or a dict of FullyShardedDataParallel keyword arguments for that unit."
                )
            if decision:
                targets[module] = {**root_kwargs, **decision} if isinstance(decision, dict) else copy.copy(root_kwargs)
        return targets


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Every module becomes a unit."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Recurse everywhere; wrap the modules for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def _module_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, module_classes: Iterable[Type[nn.Module]]
) -> bool:
    """Recurse everywhere; wrap instances of ``module_classes``: the callable form of
    ``ModuleWrapPolicy``, which clients combine with others through ``_or_policy``."""
    return True if recurse else isinstance(module, tuple(module_classes))


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, transformer_layer_cls: Set[Type[nn.Module]]
) -> bool:
    """Recurse everywhere; wrap instances of ``transformer_layer_cls`` (the layers, leaving shared
    embeddings to their common parent)."""
    return _module_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls)


def _wrap_module_cls_individually(module: nn.Module, module_classes: Sequence[type], recurse: bool, *args: Any,
                                  **kwargs: Any) -> bool:
    """``_module_wrap_policy`` with torch's other argument order (classes second), kept because
    clients bind ``module_classes`` by keyword and pass it to ``_or_policy``."""
    return _module_wrap_policy(module, recurse, -1, module_classes)


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: Iterable[Callable[..., bool]]) -> bool:
    """Recurse, or wrap, where any of the callable ``policies`` says so: how PEFT and llama-cookbook
    wrap both the transformer layers and the trainable leaves of a LoRA model."""
    return any(policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for policy in policies)


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Optional[Set[Type[nn.Module]]] = None,
    exclude_wrap_modules: Optional[Set[Type[nn.Module]]] = None,
) -> bool:
    """Wrap a module once the numel not yet wrapped below it reaches ``min_num_params``. Modules of
    ``force_leaf_modules`` are not recursed into and those of ``exclude_wrap_modules`` never wrapped
    (defaults: the function's ``FORCE_LEAF_MODULES`` and ``EXCLUDE_WRAP_MODULES``, as torch's)."""
    defaults: Any = size_based_auto_wrap_policy  # its attributes, set below
    leaves = defaults.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    excluded = defaults.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules
    if nonwrapped_numel < min_num_params:
        return False
    return not isinstance(module, tuple(leaves if recurse else excluded))


# Attributes of the function, as torch's: read at each call, so a client may change them (setattr: mypy
# does not type attributes of a function).
setattr(size_based_auto_wrap_policy, "EXCLUDE_WRAP_MODULES", {nn.ModuleList, nn.ModuleDict})
setattr(size_based_auto_wrap_policy, "FORCE_LEAF_MODULES", {nn.MultiheadAttention})


class _ManualWrapContext:
    """The one piece of global state the public API forces: what ``wrap()`` does inside ``enable_wrap``."""

    wrapper_cls: Optional[Callable[..., nn.Module]] = None
    kwargs: Dict[str, Any] = {}


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Iterator[None]:
    """Within, ``wrap(module)`` returns ``wrapper_cls(module, **wrapper_kwargs)``."""
    if _ManualWrapContext.wrapper_cls is not None:
        raise NotImplementedError(
            "fsdp1: enable_wrap() contexts cannot be nested; leave the outer one first, or pass the "
            "differing arguments to wrap(module, **overrides)."
        )
    _ManualWrapContext.wrapper_cls, _ManualWrapContext.kwargs = wrapper_cls, wrapper_kwargs
    try:
        yield
    finally:
        _ManualWrapContext.wrapper_cls, _ManualWrapContext.kwargs = None, {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Inside ``enable_wrap``, ``module`` wrapped with the context's kwargs updated by ``wrap_overrides``
    (and by ``module._wrap_overrides``, if set); outside, ``module`` itself."""
    if _ManualWrapContext.wrapper_cls is None:
        return module
    kwargs = {**_ManualWrapContext.kwargs, **wrap_overrides, **getattr(module, "_wrap_overrides", {})}
    return _ManualWrapContext.wrapper_cls(module, **kwargs)


AutoWrapPolicy = Union[_Policy, Callable[..., bool]]


def plan_auto_wrap(
    root: nn.Module,
    policy: AutoWrapPolicy,
    ignored_modules: Set[nn.Module],
    root_kwargs: Dict[str, Any],
    ignored_params: Iterable[nn.Parameter] = (),
) -> Dict[nn.Module, Dict[str, Any]]:
    """The submodules of ``root`` (never ``root`` itself) to wrap, children before parents, with
    the kwargs of each unit. Reads the tree only. ``ignored_params`` do not count towards the numel
    a callable policy is shown, as in torch."""
    if not _is_policy_object(policy) and not callable(policy):
        raise ValueError(
            f"fsdp1: auto_wrap_policy must be a policy object (ModuleWrapPolicy, CustomPolicy) or a callable "
            f"(module, recurse, nonwrapped_numel) -> bool such as functools.partial(transformer_auto_wrap_policy, "
            f"transformer_layer_cls={{Block}}), got {type(policy).__name__}."
        )
    if _is_policy_object(policy):
        targets = policy._run_policy(root, ignored_modules, root_kwargs)
        targets.pop(root, None)
        return children_first(root, targets)
    planned: Dict[nn.Module, Dict[str, Any]] = {}
    ignored_ids = {id(p) for p in ignored_params}
    _plan_legacy(root, policy, ignored_modules, ignored_ids, planned, root_kwargs, may_wrap=False)
    return planned


class _PolicyObject(Protocol):
    """What the planner asks of a policy object: fsdp1's ``_Policy``, or torch's."""

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: Set[nn.Module], root_kwargs: Dict[str, Any]
    ) -> Dict[nn.Module, Dict[str, Any]]: ...


def _is_policy_object(policy: Any) -> "TypeIs[_PolicyObject]":
    """fsdp1's ``_Policy``, or torch's (same ``_run_policy``), so that a client's
    ``torch.distributed.fsdp.wrap.CustomPolicy`` plans under ``use_as_torch_fsdp`` as under torch."""
    return isinstance(policy, _Policy) or callable(getattr(policy, "_run_policy", None))


def _plan_legacy(module: nn.Module, policy: Callable[..., bool], ignored_modules: Set[nn.Module], ignored_ids: Set[int],
                 planned: Dict[nn.Module, Dict[str, Any]], root_kwargs: Dict[str, Any], may_wrap: bool) -> int:
    """Numel that ``module`` contributes to units planned at or below it (legacy recursion);
    ``module`` itself is planned only if ``may_wrap``."""
    nonwrapped_numel = sum(p.numel() for p in module.parameters() if id(p) not in ignored_ids)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        return 0
    wrapped_numel = 0
    for child in module.children():
        if child not in ignored_modules and child not in planned:
            wrapped_numel += _plan_legacy(child, policy, ignored_modules, ignored_ids, planned, root_kwargs, True)
    remainder = nonwrapped_numel - wrapped_numel
    if may_wrap and policy(module=module, recurse=False, nonwrapped_numel=remainder):
        planned[module] = copy.copy(root_kwargs)
        return nonwrapped_numel
    return wrapped_numel


def _recursive_wrap(
    module: nn.Module,
    auto_wrap_policy: Callable[..., bool],
    wrapper_cls: Callable[..., nn.Module],
    ignored_modules: Set[nn.Module],
    ignored_params: Set[nn.Parameter],
    only_wrap_children: bool = False,
    **kwargs: Any,
) -> Tuple[nn.Module, int]:
    """torch's recursive wrapper, which clients call to wrap with a wrapper of their own (activation
    checkpointing, an FSDP subclass): each submodule the callable ``auto_wrap_policy`` picks, and
    ``module`` itself unless ``only_wrap_children``, becomes ``wrapper_cls(submodule, **kwargs)``.
    Returns ``module`` or its wrapper, and the numel wrapped."""
    if isinstance(wrapper_cls, type):
        for name, child in module.named_modules():
            if child not in ignored_modules and isinstance(child, wrapper_cls):
                where = f"submodule '{name}'" if name else "the module"
                raise AssertionError(
                    f"fsdp1: _recursive_wrap: {where} is already wrapped by {wrapper_cls.__name__}; "
                    "pass the module before wrapping any of it."
                )
    planned: Dict[nn.Module, Dict[str, Any]] = {}
    ignored_ids = {id(p) for p in ignored_params}
    numel = _plan_legacy(module, auto_wrap_policy, ignored_modules, ignored_ids, planned, kwargs, not only_wrap_children)
    wraps_module = planned.pop(module, None) is not None
    apply_wrap(module, children_first(module, planned), wrapper_cls)
    if wraps_module:
        return wrapper_cls(module, **{**kwargs, **getattr(module, "_wrap_overrides", {})}), numel
    return module, numel


def children_first(root: nn.Module, planned: Dict[nn.Module, Dict[str, Any]]) -> Dict[nn.Module, Dict[str, Any]]:
    """``planned`` ordered as its modules appear in a post-order walk of ``root``."""
    return {m: planned[m] for m in _post_order(root) if m in planned}


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
    """Replace each planned submodule of ``root`` by ``wrapper_cls(submodule, **kwargs)`` (updated by the
    submodule's ``_wrap_overrides``, as torch's), children first; a submodule reachable from two
    parents is wrapped once and both see the same unit."""
    wrapped: Dict[nn.Module, nn.Module] = {}

    def visit(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if child not in wrapped:
                visit(child)
                if child in planned:
                    wrapped[child] = wrapper_cls(child, **{**planned[child], **getattr(child, "_wrap_overrides", {})})
                else:
                    wrapped[child] = child
            if wrapped[child] is not child:
                setattr(module, name, wrapped[child])

    visit(root)
