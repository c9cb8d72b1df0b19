"""torch FSDP1's optimizer-state-dict methods, static methods of the unit class (a base class of
``FullyShardedDataParallel``), each a thin entry to ``_state_dict.optim_state_dict``."""

from enum import Enum, auto
from typing import Any, Dict, Optional

import torch
from torch import nn

from .._engine import collectives as comm
from .._state_dict import optim_state_dict as _optim_state_dict
from ..api import coerce_enum


class OptimStateKeyType(Enum):
    """How ``rekey_optim_state_dict`` keys optimizer state: by parameter name or by position."""

    PARAM_NAME = auto()
    PARAM_ID = auto()


class OptimStateDictAPI:
    """The optimizer-state-dict static methods of ``FullyShardedDataParallel``, with torch's
    signatures (``group`` and ``optim_input`` are accepted as torch's and not needed)."""

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Optional[Dict[str, Any]] = None,
                         group: Optional[comm.ProcessGroup] = None) -> Dict[str, Any]:
        """The optimizer's state by clean parameter name, in the form ``state_dict_type`` set (FULL:
        full tensors; SHARDED: DTensor rows for DCP; LOCAL: as the optimizer keeps it). A fresh
        optimizer gets its state first, so the result is a complete template. Collective."""
        return _optim_state_dict.optim_state_dict(model, optim, optim_state_dict)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Dict[str, Any],
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group: Optional[comm.ProcessGroup] = None) -> Dict[str, Any]:
        """What ``optim.load_state_dict`` takes, from what ``optim_state_dict`` gave (on any world
        size, for SHARDED). Collective."""
        return _optim_state_dict.optim_state_dict_to_load(model, optim, optim_state_dict, load_directly)

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None,
                              rank0_only: bool = True, group: Optional[comm.ProcessGroup] = None) -> Dict[str, Any]:
        """The older API: ``optim_state_dict`` under FULL (on rank 0 only, by default)."""
        return _optim_state_dict.full_optim_state_dict(model, optim, rank0_only)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                 group: Optional[comm.ProcessGroup] = None) -> Dict[str, Any]:
        """The older API: ``optim_state_dict`` under SHARDED."""
        return _optim_state_dict.sharded_optim_state_dict(model, optim)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: Dict[str, Any], model: nn.Module, optim_input: Any = None,
                                    optim: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """The older API: each rank's part of a FULL dict that every rank holds, for ``optim.load_state_dict``
        of ``optim`` (or, as torch's, of an optimizer built on ``model.parameters()``, or on ``optim_input``)."""
        return _optim_state_dict.shard_full_optim_state_dict(full_optim_state_dict, model, optim, optim_input)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: Dict[str, Any], model: nn.Module,
                                         optim: torch.optim.Optimizer) -> Dict[str, Any]:
        """The older API: ``optim_state_dict_to_load`` under SHARDED."""
        return _optim_state_dict.flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: Optional[Dict[str, Any]], model: nn.Module,
                                      optim_input: Any = None, optim: Optional[torch.optim.Optimizer] = None,
                                      group: Optional[Any] = None) -> Dict[str, Any]:
        """The older API: rank 0 holds the FULL dict (the others pass None) and sends each rank its part
        (for ``optim``, or as ``shard_full_optim_state_dict`` without it)."""
        return _optim_state_dict.scatter_full_optim_state_dict(full_optim_state_dict, model, optim, optim_input)

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict: Dict[str, Any], optim_state_key_type: "OptimStateKeyType",
                               model: nn.Module, optim_input: Any = None,
                               optim: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """The same state keyed by clean parameter name or by position (as a model without FSDP numbers
        its parameters), to move optimizer state between wrapped and unwrapped models."""
        by_name = coerce_enum(optim_state_key_type, OptimStateKeyType, "optim_state_key_type") is OptimStateKeyType.PARAM_NAME
        return _optim_state_dict.rekey_optim_state_dict(optim_state_dict, by_name, model, optim)
