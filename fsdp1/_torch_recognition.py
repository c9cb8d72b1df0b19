"""torch's own helpers recognise fsdp1's modules once ``import fsdp1`` has run, with no alias.

torch's pipeline stages and schedules and its ``torch.distributed.checkpoint.state_dict`` helpers
(and ``_NamedOptimizer``) decide what to do with a module by testing it against torch's FSDP
classes, which they bind when imported; a module they do not recognise is treated as a plain one,
silently: a pipeline gathers and reduces it once per micro-batch and a split backward computes no
weight gradient for it; the state-dict helpers return full tensors and the wrapper's prefixes in the
optimizer's keys. So each of those names, in each of those modules, is replaced by one that answers
for torch's objects and fsdp1's alike: a class whose ``isinstance`` accepts either, whose static
methods hand a model to the class whose units it holds; ``fully_shard.state`` and the state-dict
helpers' per-unit lookup likewise. torch's modules keep working with torch's FSDP as before, whatever
the order of imports: a module already imported is changed at once, one imported later right after
its import (``_AfterImport``). Nothing of ``torch.distributed.fsdp`` is imported here: only the
modules that import it themselves are touched, and torch's originals are read from their bindings.

The split-backward schedules get one more thing at their first action: the refusal, on every rank
of the pipeline at once, of a weight pass that would miss fsdp1's parameters
(``refuse_split_backward_that_misses``).
"""

import functools
import importlib.abc
import importlib.util
import sys
import weakref
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from torch import nn

from ._engine.traversal import fsdp_units
from ._fully_shard import FSDPModule, fully_shard
from ._fully_shard.pipeline import refuse_split_backward_that_misses
from ._torch_alias import use_as_torch_fsdp
from ._torch_internals import runtime_schedule_class, schedule_has_backward, schedule_stages
from .fully_sharded_data_parallel import FullyShardedDataParallel


class _EitherClass(type):
    """The metaclass of a stand-in for one of torch's classes: ``isinstance`` and ``issubclass``
    accept torch's class or fsdp1's; any other attribute is torch's class's."""

    _classes: Tuple[type, type]

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._classes)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, cls._classes)

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls._classes[0], name)


def _owner(model: Any, torch_class: type) -> type:
    """The FSDP1 class whose units ``model`` holds. torch's class's own code looks fsdp1's up in its
    place while ``use_as_torch_fsdp`` is in effect, and a model of both kinds has no one owner:
    those are refused, on every rank alike, before anything is read or written."""
    if not isinstance(model, nn.Module):
        return torch_class
    ours = any(isinstance(each, FullyShardedDataParallel) for each in model.modules())
    torchs = any(isinstance(each, torch_class) for each in model.modules())
    if torchs and (ours or use_as_torch_fsdp.in_effect()):
        raise RuntimeError(
            "fsdp1: this model holds torch's FullyShardedDataParallel units"
            + (" and fsdp1's" if ours else " while fsdp1.use_as_torch_fsdp() is in effect, which puts fsdp1's "
               "class where torch's own code looks for torch's")
            + ", so torch's state-dict helpers cannot handle it. Build the model with one of the two classes, and use "
            "torch's class only with use_as_torch_fsdp() undone (or fsdp1's, which needs no alias).")
    return FullyShardedDataParallel if ours else torch_class


def _handing_to_owner(name: str, torch_class: type) -> Callable[..., Any]:
    """``name`` of the FSDP1 class whose units the model (the first argument, or ``module`` / ``model``) holds."""

    def call(*args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("module", kwargs.get("model"))
        return getattr(_owner(model, torch_class), name)(*args, **kwargs)

    return call


FSDP1_STATIC_METHODS = ("fsdp_modules", "state_dict_type", "optim_state_dict", "optim_state_dict_to_load")
"""What torch's state-dict helpers and ``_NamedOptimizer`` call on the FSDP1 class."""


def _either_fsdp1_class(torch_class: type, _: ModuleType) -> type:
    methods: Dict[str, Any] = {name: staticmethod(_handing_to_owner(name, torch_class)) for name in FSDP1_STATIC_METHODS}
    return _EitherClass("FullyShardedDataParallel", (), {"_classes": (torch_class, FullyShardedDataParallel), **methods})


def _either_fsdp_module(torch_class: type, _: ModuleType) -> type:
    return _EitherClass("FSDPModule", (), {"_classes": (torch_class, FSDPModule)})


class _SchedulesFSDPModule(_EitherClass):
    """``FSDPModule`` as torch's schedules see it. Their ``_perform_action`` tests the stage module of
    every action, sends and receives included, before doing it: the first test of a schedule that
    splits backward over fsdp1's stage modules, which every rank of the pipeline makes before any of
    its messages, checks that its weight passes reach their parameters (once per schedule, the
    answer kept). The schedule is the ``self`` of the calling frame; where a later torch names it
    otherwise, the refusal at the end of the step (``StageReduction.post_backward``) still comes."""

    _runtime_schedule: type
    _weight_pass: Any
    _checked: "weakref.WeakKeyDictionary[Any, Optional[BaseException]]"

    def __instancecheck__(cls, obj: Any) -> bool:
        schedule = sys._getframe(1).f_locals.get("self")
        if isinstance(schedule, cls._runtime_schedule) and schedule_has_backward(schedule):  # not eval()
            cls._check(schedule)
        return isinstance(obj, cls._classes)

    def _check(cls, schedule: Any) -> None:
        if schedule not in cls._checked:
            cls._checked[schedule] = None
            actions = getattr(schedule, "pipeline_order_with_comms", None) or {}
            stages = [(stage.stage_index, stage.submod) for stage in schedule_stages(schedule)]
            if (any(fsdp_units(module) for _, module in stages)  # a pipeline of torch's is torch's
                    and any(action.computation_type == cls._weight_pass for each in actions.values() for action in each)):
                try:
                    refuse_split_backward_that_misses(stages, schedule_stages(schedule)[0].group)
                except NotImplementedError as refused:
                    cls._checked[schedule] = refused
        refusal = cls._checked[schedule]
        if refusal is not None:
            raise NotImplementedError(*refusal.args)


def _schedules_fsdp_module(torch_class: type, schedules: ModuleType) -> type:
    return _SchedulesFSDPModule("FSDPModule", (), {
        "_classes": (torch_class, FSDPModule), "_runtime_schedule": runtime_schedule_class(),
        "_weight_pass": schedules.BACKWARD_WEIGHT, "_checked": weakref.WeakKeyDictionary()})


def _either_fully_shard(torch_fully_shard: Any, _: ModuleType) -> Any:
    """torch's ``fully_shard``, whose ``state(module)`` answers for fsdp1's modules too."""

    @functools.wraps(torch_fully_shard)
    def either(*args: Any, **kwargs: Any) -> Any:
        return torch_fully_shard(*args, **kwargs)

    either.state = lambda module: (fully_shard.state(module) if isinstance(module, FSDPModule)  # type: ignore[attr-defined]
                                   else torch_fully_shard.state(module))
    return either


def _either_unit_state(torch_lookup: Callable[[nn.Module], Any], _: ModuleType) -> Callable[[nn.Module], Any]:
    """The state-dict helpers' "FSDP state of this unit": an fsdp1 unit is its own, as torch's is."""

    def lookup(module: nn.Module) -> Any:
        return module if isinstance(module, FullyShardedDataParallel) else torch_lookup(module)

    return lookup


RECOGNISING_MODULES: Dict[str, Dict[str, Callable[[Any, ModuleType], Any]]] = {
    "torch.distributed.pipelining.stage": {"FSDPModule": _either_fsdp_module, "fully_shard": _either_fully_shard},
    "torch.distributed.pipelining.schedules": {"FSDPModule": _schedules_fsdp_module},
    "torch.distributed.checkpoint.state_dict": {
        "FSDP": _either_fsdp1_class, "_get_module_fsdp_state_if_fully_sharded_module": _either_unit_state},
    "torch.distributed.optim.named_optimizer": {"FSDP": _either_fsdp1_class},
}
"""Each module of torch that recognises FSDP modules by torch's classes, and for each name it bound,
what makes the stand-in from torch's value (and the module)."""

_MARK = "_fsdp1_recognises"


def _recognise_in(module: ModuleType) -> None:
    """Give ``module`` the stand-ins for the names it bound (once)."""
    if getattr(module, _MARK, False):
        return
    for name, stand_in in RECOGNISING_MODULES[module.__name__].items():
        if hasattr(module, name):
            setattr(module, name, stand_in(use_as_torch_fsdp.torch_original(module, name), module))
    setattr(module, _MARK, True)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Gives one of ``RECOGNISING_MODULES`` its stand-ins as soon as it is imported. It answers no
    import itself: it finds the spec as the other finders would and runs the module's own code first."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None) -> Any:
        if name not in RECOGNISING_MODULES or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            _recognise_in(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def recognise_fsdp1_in_torch() -> None:
    """The stand-ins in every recognising module imported now, and in the others once imported."""
    for name in RECOGNISING_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            _recognise_in(module)
    if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
