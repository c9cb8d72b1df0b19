"""FSDP1's ``MixedPrecision`` argument: its dtypes checked, and the full-precision units of
``_module_classes_to_ignore`` (BatchNorm by default) that auto-wrapping plans with their casts."""

import warnings
from typing import Any, Dict, Iterable, Optional, Set, Tuple, Type

import torch
from torch import nn

from .._engine.mixed_precision import cast_floating_tensors
from .._engine.traversal import iter_tensors
from ..api import MixedPrecision


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
