"""``use_as_torch_fsdp``: fsdp1's class under torch's names, for clients that construct and recognise
FSDP units by torch's class (HF Accelerate, the Transformers Trainer, Lightning, torch's own
``torch.distributed.checkpoint.state_dict`` helpers), and fsdp1's ``fully_shard``, ``FSDPModule``
and policies where torch's FSDP2 names are (Accelerate's FSDP2 mode, the Trainer's default FSDP
path and torchtitan-style scripts import them when they shard), torch's pipeline schedules
included, which recognise a stage module by torch's ``FSDPModule``.

Those clients import ``FullyShardedDataParallel`` from ``torch.distributed.fsdp`` or from
``torch.distributed.fsdp.fully_sharded_data_parallel`` when they need it, and test
``isinstance(model, FSDP)`` or even ``type(model) is FSDP``; a subclass of torch's class would fail
the latter. So both module attributes are pointed at fsdp1's class, and put back on undo; likewise
``ShardedGradScaler``, which Lightning and Accelerate import from
``torch.distributed.fsdp.sharded_grad_scaler`` for fp16, so that what such a client builds is
fsdp1's throughout. torch's ``torch.distributed.checkpoint.state_dict`` binds the class when it is
imported and asks a private helper for each unit's FSDP state; both names there are replaced too.
torch's ``wrap`` module is left alone: fsdp1 plans torch's policies as torch does, and torch's
``enable_wrap`` / ``wrap`` take any wrapper class, while torch's activation checkpointing imports
its private helpers from there. This is the one place the library touches
``torch.distributed.fsdp``, and only when asked: importing fsdp1 does not import it.
"""

import importlib
from typing import Any, Callable, List, Optional, Tuple

from torch import nn

from ._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx
from .api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from .fully_sharded_data_parallel import FullyShardedDataParallel
from .sharded_grad_scaler import ShardedGradScaler

TORCH_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed.fsdp.fully_sharded_data_parallel")
"""Where clients import torch's FSDP1 class from."""

TORCH_SCALER_MODULES = ("torch.distributed.fsdp.sharded_grad_scaler", "torch.distributed.fsdp")
"""Where clients import torch's ShardedGradScaler from (the package only in the versions that export it)."""

TORCH_FSDP2_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
"""Where clients import torch's FSDP2 names from (the second is the older path)."""

FSDP2_NAMES = {
    "fully_shard": fully_shard, "FSDPModule": FSDPModule, "UnshardHandle": UnshardHandle,
    "register_fsdp_forward_method": register_fsdp_forward_method, "MixedPrecisionPolicy": MixedPrecisionPolicy,
    "OffloadPolicy": OffloadPolicy, "CPUOffloadPolicy": CPUOffloadPolicy, "share_comm_ctx": share_comm_ctx,
    "DataParallelMeshDims": DataParallelMeshDims,
}
"""fsdp1's FSDP2 names, each put where torch's of that name is (where the module has it)."""

TORCH_STATE_DICT_HELPERS = "torch.distributed.checkpoint.state_dict"
"""torch's ``get_state_dict`` / ``set_state_dict`` family, which binds the class at import."""

TORCH_PIPELINING_MODULES = ("torch.distributed.pipelining.stage", "torch.distributed.pipelining.schedules")
"""torch's pipeline stages and schedules, which bind ``FSDPModule``, ``UnshardHandle`` and
``fully_shard`` when imported, to recognise a stage module as sharded and drive it (keep it gathered
and its gradients unreduced across micro-batches, reduce them once at the end of the step)."""


def _unit_state_or(torch_lookup: Callable[[nn.Module], Optional[Any]]) -> Callable[[nn.Module], Optional[Any]]:
    """torch's "FSDP state of this fully sharded module" lookup, answering for fsdp1's units too:
    a unit is its own state, as torch's wrapper is."""

    def lookup(module: nn.Module) -> Optional[Any]:
        return module if isinstance(module, FullyShardedDataParallel) else torch_lookup(module)

    return lookup


class use_as_torch_fsdp:  # noqa: N801 - used as a function, as torch's own context-manager functions are
    """Make ``torch.distributed.fsdp.FullyShardedDataParallel`` (at both of its import paths, and in
    ``torch.distributed.checkpoint.state_dict``) be fsdp1's class, torch's ``ShardedGradScaler``
    fsdp1's, and ``torch.distributed.fsdp.fully_shard`` / ``FSDPModule`` / the FSDP2 policies
    fsdp1's, so that a client that builds and recognises FSDP units by torch's name uses fsdp1.

    Call it once before the client builds its model (``fsdp1.use_as_torch_fsdp()``), or use it as a
    context manager, which puts torch's names back on exit. A client module that bound torch's class
    to a name of its own when it was imported keeps that binding: call this before importing it.
    Keep it in effect while a model built under it lives: the clients test the class of the model.
    Several may be in effect at once (a library and its user each calling it): torch's names come
    back when the last one still in effect is undone, in whatever order they are.
    """

    _in_effect: List["use_as_torch_fsdp"] = []
    _torch_names: List[Tuple[Any, str, Any]] = []  # (module, attribute, torch's value) while any is in effect

    def __init__(self) -> None:
        if not self._in_effect:
            helpers = importlib.import_module(TORCH_STATE_DICT_HELPERS)  # first: it binds the class it finds
            replacements: List[Tuple[Any, str, Any]] = [
                (importlib.import_module(name), "FullyShardedDataParallel", FullyShardedDataParallel)
                for name in TORCH_FSDP_MODULES
            ]
            lookup = "_get_module_fsdp_state_if_fully_sharded_module"
            replacements += [(module, "ShardedGradScaler", ShardedGradScaler)
                             for module in map(importlib.import_module, TORCH_SCALER_MODULES)
                             if hasattr(module, "ShardedGradScaler")]
            replacements += [(module, name, value) for module in map(importlib.import_module, TORCH_FSDP2_MODULES)
                             for name, value in FSDP2_NAMES.items() if hasattr(module, name)]
            replacements += [(module, name, value) for module in map(importlib.import_module, TORCH_PIPELINING_MODULES)
                             for name, value in FSDP2_NAMES.items() if hasattr(module, name)]
            replacements += [(helpers, "FSDP", FullyShardedDataParallel),
                             (helpers, lookup, _unit_state_or(getattr(helpers, lookup)))]
            for module, attribute, value in replacements:
                self._torch_names.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, value)
        self._in_effect.append(self)

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
                setattr(module, attribute, original)
