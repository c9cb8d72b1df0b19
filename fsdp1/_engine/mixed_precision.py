"""Mixed precision in the engine: which dtype each unit gathers, computes, reduces and keeps its
gradient in (``HandlePrecision``), how forward inputs are cast, and its buffers' dtypes
(``BufferPrecision``).

Decisions only, plus the casts of inputs and buffers: the handle owns the casts of the flat
parameter and its gradient. The sharded parameters and the optimizer stay in their own dtype; only
the gathered copy is low precision, so nothing a checkpoint or ``summon_full_params`` reads changes.
"""

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Collection, Dict, Iterable, List, Optional, Protocol, Tuple

import torch
from torch import nn

from ..api import MixedPrecision
from .device import map_tensors
from .traversal import unit_named_buffers

FULL_PRECISION_IN_EVAL_ENV = "FSDP_USE_FULL_PREC_IN_EVAL"


@dataclass(frozen=True)
class HandlePrecision:
    """The dtypes of one unit's flat parameter: ``param_dtype`` is what the all-gather and the
    computation use, ``reduce_dtype`` what the gradient is reduced in (``param_dtype`` when only
    that is given, as torch's, unless ``follows_grad_dtype``), ``orig_dtype`` what the shard, the optimizer and ``.grad`` keep,
    unless ``keep_low_precision_grads`` leaves ``.grad`` in ``param_dtype``. A dtype left unset
    follows ``orig_dtype``, also after ``.double()`` and friends."""

    orig_dtype: torch.dtype
    param_dtype_set: Optional[torch.dtype] = None
    reduce_dtype_set: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    full_precision_in_eval: bool = False
    accumulates_in_reduce_dtype: bool = False
    """Whether gradients kept unreduced across backwards (``no_sync``) add up in ``reduce_dtype``
    (torch's FSDP2) rather than in ``param_dtype`` on the flat parameter (torch's FSDP1)."""
    follows_grad_dtype: bool = False
    """``fully_shard`` from torch 2.15 on: an unset ``reduce_dtype`` reduces in ``orig_dtype`` (not in
    ``param_dtype``, as FSDP1 and ``fully_shard`` before 2.15), and the unsharded parameters' gradients
    add up in ``reduce_dtype`` (their ``grad_dtype``)."""

    @classmethod
    def of(cls, mixed_precision: Optional[MixedPrecision], orig_dtype: torch.dtype) -> "HandlePrecision":
        if mixed_precision is None:
            return cls(orig_dtype)
        return cls(orig_dtype, mixed_precision.param_dtype, mixed_precision.reduce_dtype,
                   mixed_precision.keep_low_precision_grads, os.environ.get(FULL_PRECISION_IN_EVAL_ENV, "") == "1")

    @property
    def param_dtype(self) -> torch.dtype:
        return self.param_dtype_set or self.orig_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        if self.reduce_dtype_set is not None:
            return self.reduce_dtype_set
        return (None if self.follows_grad_dtype else self.param_dtype_set) or self.orig_dtype

    @property
    def unsharded_grad_dtype(self) -> Optional[torch.dtype]:
        """The ``grad_dtype`` of Parameters over the unsharded buffer (None: their own dtype)."""
        return self.reduce_dtype if self.follows_grad_dtype else None

    @property
    def is_mixed(self) -> bool:
        return self.param_dtype != self.orig_dtype or self.reduce_dtype != self.orig_dtype

    @property
    def gathers_low_precision(self) -> bool:
        return self.param_dtype != self.orig_dtype

    def with_orig_dtype(self, orig_dtype: torch.dtype) -> "HandlePrecision":
        """After ``.double()`` and friends the new dtype is the full precision."""
        return dataclasses.replace(self, orig_dtype=orig_dtype)


def cast_floating_tensors(dtype: Optional[torch.dtype], obj: Any) -> Any:
    """``obj`` with every floating-point tensor inside tuples, lists, dicts and dataclasses cast to
    ``dtype`` (integer tensors, token ids say, stay as they are)."""
    if dtype is None:
        return obj
    return map_tensors(lambda t: t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t, obj)


class UnitBuffers(Protocol):
    """What ``BufferPrecision`` reads of a unit: its module, the module its buffers are found from
    (nested units and ignored modules left out), and its mixed precision."""

    owner: nn.Module
    hooked: nn.Module
    ignored_modules: Collection[nn.Module]
    mixed_precision: Optional[MixedPrecision]


class BufferPrecision:
    """The buffers of a root's units in their ``buffer_dtype`` for computation, and back in their own
    dtype for evaluation in full precision; the state dict always shows their own dtype.

    Casting happens only when the mode changes (the first forward, entering or leaving full-precision
    evaluation), so a training step does no per-buffer work.
    """

    def __init__(self, units: Iterable["UnitBuffers"]) -> None:
        self._entries: List[Tuple[nn.Module, str, torch.dtype, torch.dtype]] = []  # module, attr, own, compute
        self._own_dtypes: Dict[nn.Module, Dict[str, torch.dtype]] = {}  # unit module -> clean name -> dtype
        for unit in units:
            mixed_precision = unit.mixed_precision
            buffer_dtype = mixed_precision.buffer_dtype if mixed_precision is not None else None
            if buffer_dtype is None:
                continue
            own = self._own_dtypes[unit.owner] = {}
            for name, module, attr, buffer in unit_named_buffers(unit.hooked, unit.ignored_modules):
                if torch.is_floating_point(buffer):
                    own[name] = buffer.dtype
                    self._entries.append((module, attr, buffer.dtype, buffer_dtype))
        self._in_full_precision: Optional[bool] = None

    def use(self, full_precision: bool) -> None:
        if self._in_full_precision is full_precision:
            return
        self._in_full_precision = full_precision
        for module, attr, orig_dtype, compute_dtype in self._entries:
            buffer = module._buffers.get(attr)
            if buffer is not None:
                module._buffers[attr] = buffer.to(orig_dtype if full_precision else compute_dtype)

    def restore_dtypes(self, unit: nn.Module, destination: Dict[str, Any], prefix: str) -> None:
        """A state dict shows each buffer ``unit`` cast for computation in its own dtype (a copy), as torch's."""
        for name, dtype in self._own_dtypes.get(unit, {}).items():
            value = destination.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                destination[prefix + name] = value.to(dtype)
