"""Mixed precision: which dtype each unit gathers, computes, reduces and keeps its gradient in, how
forward inputs and buffers are cast, and the full-precision units of ``_module_classes_to_ignore``.

Decisions only, plus the casts of inputs and buffers: the handle owns the casts of the flat
parameter and its gradient. The sharded parameters and the optimizer stay in their own dtype; only
the gathered copy is low precision, so nothing a checkpoint or ``summon_full_params`` reads changes.
"""

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any, Collection, Dict, Iterable, List, Optional, Protocol, Set, Tuple, Type

import torch
from torch import nn

from ..api import MixedPrecision
from .device import map_tensors
from .traversal import iter_tensors, unit_named_buffers

FULL_PRECISION_IN_EVAL_ENV = "FSDP_USE_FULL_PREC_IN_EVAL"


@dataclass(frozen=True)
class HandlePrecision:
    """The dtypes of one unit's flat parameter: ``param_dtype`` is what the all-gather and the
    computation use, ``reduce_dtype`` what the gradient is reduced in (``param_dtype`` when only
    that is given, as torch's), ``orig_dtype`` what the shard, the optimizer and ``.grad`` keep,
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
        return self.reduce_dtype_set or self.param_dtype_set or self.orig_dtype

    @property
    def is_mixed(self) -> bool:
        return self.param_dtype != self.orig_dtype or self.reduce_dtype != self.orig_dtype

    @property
    def gathers_low_precision(self) -> bool:
        return self.param_dtype != self.orig_dtype

    def with_orig_dtype(self, orig_dtype: torch.dtype) -> "HandlePrecision":
        """After ``.double()`` and friends the new dtype is the full precision."""
        return dataclasses.replace(self, orig_dtype=orig_dtype)


def checked_precision(mixed_precision: MixedPrecision) -> MixedPrecision:
    """``mixed_precision`` if each dtype it sets is a floating-point ``torch.dtype``, else an error
    naming the field."""
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        dtype = getattr(mixed_precision, field)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"fsdp1: MixedPrecision.{field}={dtype!r} is not a floating-point torch.dtype; pass e.g. "
                f"torch.bfloat16, torch.float16 or torch.float32, or None to keep the parameters' own dtype."
            )
    return mixed_precision


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


def plan_full_precision_modules(root: nn.Module, mixed_precision: Optional[MixedPrecision],
                                ignored: Iterable[nn.Module], planned: Dict[nn.Module, Dict[str, Any]],
                                root_kwargs: Dict[str, Any]) -> None:
    """With mixed precision and an auto-wrap policy, every module of a class in
    ``_module_classes_to_ignore`` (``_BatchNorm`` by default) becomes its own unit without mixed
    precision, and computes in float32 on inputs cast up, its outputs cast back (as torch's)."""
    if mixed_precision is None:
        return
    classes = tuple(set(mixed_precision._module_classes_to_ignore))
    ignored = set(ignored)
    found: Set[Type[nn.Module]] = set()
    for module in root.modules():
        if not classes or not isinstance(module, classes) or module in ignored or module is root:
            continue
        found.add(type(module))
        kwargs = planned.setdefault(module, dict(root_kwargs))
        kwargs["mixed_precision"] = None
        _FullPrecisionCast(module)
    if found:
        warnings.warn(
            "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped module has "
            f"submodules of type:\n{found}\nThese modules will be wrapped as separate FSDP instances with mixed "
            "precision disabled.",
            stacklevel=4,
        )


class _FullPrecisionCast:
    """Hooks that run ``module`` in float32: inputs cast up, outputs cast back to the inputs' dtype.
    Appended after the unit's own hooks, so they see what the unit's forward sees."""

    def __init__(self, module: nn.Module) -> None:
        self._input_dtype: Optional[torch.dtype] = None
        module.register_forward_pre_hook(self._cast_inputs)
        module.register_forward_hook(self._cast_outputs)

    def _cast_inputs(self, module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        self._input_dtype = None  # per call: float32 inputs (full-precision evaluation) get float32 back
        for tensor in _floating_tensors(args):
            if tensor.dtype != torch.float32:
                self._input_dtype = tensor.dtype
        return cast_floating_tensors(torch.float32, args)

    def _cast_outputs(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
        return output if self._input_dtype is None else cast_floating_tensors(self._input_dtype, output)


def _floating_tensors(obj: Any) -> Iterable[torch.Tensor]:
    return (t for t in iter_tensors(obj) if torch.is_floating_point(t))
