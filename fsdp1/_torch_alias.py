"""``use_as_torch_fsdp``: fsdp1's class under torch's names, for clients that construct FSDP units by
torch's class (HF Accelerate, the Transformers Trainer, Lightning), and fsdp1's ``fully_shard``,
``FSDPModule`` and policies where torch's FSDP2 names are (Accelerate's FSDP2 mode, the Trainer's
default FSDP path and torchtitan-style scripts import them when they shard).

Those clients import ``FullyShardedDataParallel`` from ``torch.distributed.fsdp`` or from
``torch.distributed.fsdp.fully_sharded_data_parallel`` when they need it, and test
``isinstance(model, FSDP)`` or even ``type(model) is FSDP``; a subclass of torch's class would fail
the latter. So both module attributes are pointed at fsdp1's class, and put back on undo; likewise
``ShardedGradScaler``, which Lightning and Accelerate import from
``torch.distributed.fsdp.sharded_grad_scaler`` for fp16, so that what such a client builds is
fsdp1's throughout. torch's own helpers that recognise FSDP modules (the pipeline schedules, the
``torch.distributed.checkpoint.state_dict`` helpers) need no alias: ``import fsdp1`` gives them
stand-ins that recognise both kinds (``_torch_recognition``), which read torch's originals through
``torch_original`` where this alias put fsdp1's in their place.
torch's ``wrap`` module is left alone: fsdp1 plans torch's policies as torch does, and torch's
``enable_wrap`` / ``wrap`` take any wrapper class, while torch's activation checkpointing imports
its private helpers from there. This is the one place the library imports ``torch.distributed.fsdp``,
and only when asked: importing fsdp1 does not import it.
"""

import importlib
import sys
from types import ModuleType
from typing import Any, List, Optional, Tuple

from ._fully_shard import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from .api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from .fully_sharded_data_parallel import FullyShardedDataParallel
from .sharded_grad_scaler import ShardedGradScaler

TORCH_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed.fsdp.fully_sharded_data_parallel")
"""Where clients import torch's FSDP1 class from."""

TORCH_SCALER_MODULES = ("torch.distributed.fsdp.sharded_grad_scaler", "torch.distributed.fsdp")
"""Where clients import torch's ShardedGradScaler from (the package only in the versions that export it)."""

TORCH_FSDP2_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
"""Where clients import torch's FSDP2 names from (the second is the older path)."""

TORCH_PATHS_OF_OWN_MODULES = {
    "torch.distributed.fsdp.fully_sharded_data_parallel": "fsdp1.fully_sharded_data_parallel",
    "torch.distributed.fsdp.sharded_grad_scaler": "fsdp1.sharded_grad_scaler",
}
"""fsdp1's modules at torch's paths, which stand in for torch's where a release has dropped them."""

_ABSENT = object()
"""The original of a name torch's module did not have (put there by the alias, taken away on undo)."""

FSDP2_NAMES = {
    "fully_shard": fully_shard, "FSDPModule": FSDPModule, "UnshardHandle": UnshardHandle,
    "register_fsdp_forward_method": register_fsdp_forward_method, "MixedPrecisionPolicy": MixedPrecisionPolicy,
    "OffloadPolicy": OffloadPolicy, "CPUOffloadPolicy": CPUOffloadPolicy, "share_comm_ctx": share_comm_ctx,
    "DataParallelMeshDims": DataParallelMeshDims, "GradientReductionHandle": GradientReductionHandle,
}
"""fsdp1's FSDP2 names, each put where torch's of that name is (where the module has it)."""


class use_as_torch_fsdp:  # noqa: N801 - used as a function, as torch's own context-manager functions are
    """Make ``torch.distributed.fsdp.FullyShardedDataParallel`` (at both of its import paths) be
    fsdp1's class, torch's ``ShardedGradScaler`` fsdp1's, and ``torch.distributed.fsdp.fully_shard``
    / ``FSDPModule`` / the FSDP2 policies fsdp1's, so that a client that builds and recognises FSDP
    units by torch's name uses fsdp1.

    Call it once before the client builds its model (``fsdp1.use_as_torch_fsdp()``), or use it as a
    context manager, which puts torch's names back on exit. A client module that bound torch's class
    to a name of its own when it was imported keeps that binding: call this before importing it.
    Keep it in effect while a model built under it lives: the clients test the class of the model.
    Several may be in effect at once (a library and its user each calling it): torch's names come
    back when the last one still in effect is undone, in whatever order they are.
    """

    _in_effect: List["use_as_torch_fsdp"] = []
    _torch_names: List[Tuple[Any, str, Any]] = []  # (module, attribute, torch's value) while any is in effect
    _stood_in: List[str] = []  # torch's module paths where fsdp1's modules stand, while any is in effect

    def __init__(self) -> None:
        if not self._in_effect:
            fsdp_modules = [self._torch_module(name) for name in TORCH_FSDP_MODULES]
            replacements: List[Tuple[Any, str, Any]] = [
                (module, "FullyShardedDataParallel", FullyShardedDataParallel) for module in fsdp_modules if module is not None
            ]
            replacements += [(module, "ShardedGradScaler", ShardedGradScaler)
                             for module in map(self._torch_module, TORCH_SCALER_MODULES)
                             if module is not None and "ShardedGradScaler" in vars(module)]
            replacements += [(module, name, value) for module in map(self._torch_module, TORCH_FSDP2_MODULES)
                             if module is not None for name, value in FSDP2_NAMES.items() if name in vars(module)]
            for module, attribute, value in replacements:
                self._torch_names.append((module, attribute, vars(module).get(attribute, _ABSENT)))
                setattr(module, attribute, value)
        self._in_effect.append(self)

    @classmethod
    def _torch_module(cls, name: str) -> Optional[ModuleType]:
        """torch's module ``name``; where this torch has none (FSDP1's files gone from a later release),
        fsdp1's module of that path stands there while the alias is in effect, and nothing for the
        older FSDP2 path."""
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            stand_in = TORCH_PATHS_OF_OWN_MODULES.get(name)
            if stand_in is None:
                return None
            sys.modules[name] = importlib.import_module(stand_in)
            cls._stood_in.append(name)
            return None

    @classmethod
    def in_effect(cls) -> bool:
        return bool(cls._in_effect)

    @classmethod
    def torch_original(cls, module: Any, name: str) -> Any:
        """What ``module`` binds as ``name``, or torch's object in its place where that is one this alias
        put in torch's (a module imported while it was in effect bound fsdp1's)."""
        value = getattr(module, name)
        for replaced, attribute, original in cls._torch_names:
            if getattr(replaced, attribute) is value:
                return original
        return value

    def __enter__(self) -> "use_as_torch_fsdp":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def undo(self) -> None:
        """End this one; torch's names come back once none is in effect. Undoing twice does nothing."""
        if self not in self._in_effect:
            return
        self._in_effect.remove(self)
        if not self._in_effect:
            while self._torch_names:
                module, attribute, original = self._torch_names.pop()
                if original is _ABSENT:
                    delattr(module, attribute)
                else:
                    setattr(module, attribute, original)
            while self._stood_in:
                sys.modules.pop(self._stood_in.pop(), None)
