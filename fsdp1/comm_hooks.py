"""Gradient communication hooks for ``FullyShardedDataParallel.register_comm_hook``, with torch's
contract: a unit that shards calls ``hook(state, grad, output)`` with its unsharded gradient and a
shard-sized output to fill; a unit that does not shard calls ``hook(state, grad)`` to reduce ``grad``
in place. A hook replaces fsdp1's own reduction (pre-divide, reduce-scatter or all-reduce,
post-divide); the low-precision hooks also replace its casts to and from ``reduce_dtype``.

Torch's hooks return ``None`` once done. A hook may instead return what is still in flight (an
object with ``wait()``), as the hooks here do, and the unit finishes it as late as it finishes its
own reduction, so a registered hook overlaps the rest of backward as the default path does.
"""

from typing import Callable, Optional

import torch

from ._engine import collectives as comm
from ._engine.shard_math import gradient_divide_factors
from ._torch_internals import torch_low_precision_hooks

__all__ = [
    "DefaultState",
    "LowPrecisionState",
    "allreduce_hook",
    "reduce_scatter_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "LOW_PRECISION_HOOKS",
]


class DefaultState:
    """The group a hook reduces over and the two factors whose product is its size: gradients are
    divided before the collective and after it, so that their sum neither overflows nor underflows."""

    __slots__ = ["process_group", "world_size", "gradient_predivide_factor", "gradient_postdivide_factor"]

    def __init__(self, process_group: comm.ProcessGroup) -> None:
        if process_group is None:
            raise ValueError(f"fsdp1: {type(self).__name__} needs an explicit ProcessGroup (e.g. dist.group.WORLD).")
        self.process_group = process_group
        self.world_size = comm.group_size(process_group)
        pre, post = gradient_divide_factors(self.world_size)
        self.gradient_predivide_factor, self.gradient_postdivide_factor = float(pre), float(post)


class LowPrecisionState(DefaultState):
    """``DefaultState`` plus the dtype gradients are cast back to after a low-precision reduction."""

    __slots__ = ["parameter_type"]

    def __init__(self, process_group: comm.ProcessGroup, parameter_type: torch.dtype = torch.float32) -> None:
        super().__init__(process_group)
        self.parameter_type = parameter_type


class _InFlight:
    """A reduction a hook started: ``wait()`` finishes the collective, then what follows it."""

    def __init__(self, work: comm.Waitable, then: Callable[[], None]) -> None:
        self._work, self._then = work, then

    def wait(self) -> None:
        self._work.wait()
        self._then()


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> _InFlight:
    """Average ``grad`` over the group in place (units that do not shard)."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    return _InFlight(comm.all_reduce(grad, state.process_group), lambda: _divide(grad, state.gradient_postdivide_factor))


def reduce_scatter_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> _InFlight:
    """Average ``grad`` over the group and keep this rank's shard in ``output`` (sharded units)."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    work = comm.reduce_scatter_into(output, grad, state.process_group)
    return _InFlight(work, lambda: _divide(output, state.gradient_postdivide_factor))


def _divide(tensor: torch.Tensor, factor: float) -> None:
    if factor > 1:
        tensor.div_(factor)


def _compressed(dtype: torch.dtype, state: LowPrecisionState, grad: torch.Tensor,
                output: Optional[torch.Tensor]) -> _InFlight:
    """Reduce in ``dtype`` and cast the result back to ``state.parameter_type``. The tensors handed in
    keep their identity: their data is swapped, as torch's hooks do."""
    if grad.dtype != dtype:
        grad.data = grad.data.to(dtype)
    target = grad if output is None else output
    if target.dtype != dtype:
        target.data = target.data.to(dtype)
    inner = allreduce_hook(state, grad) if output is None else reduce_scatter_hook(state, grad, output)

    def decompress() -> None:
        target.data = target.data.to(state.parameter_type)

    return _InFlight(inner, decompress)


def fp16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> _InFlight:
    """Reduce in float16 (half the bytes of float32), then cast back to ``state.parameter_type``."""
    return _compressed(torch.float16, state, grad, output)


def bf16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> _InFlight:
    """Reduce in bfloat16 (half the bytes of float32), then cast back to ``state.parameter_type``."""
    return _compressed(torch.bfloat16, state, grad, output)


LOW_PRECISION_HOOKS = [fp16_compress_hook, bf16_compress_hook]
"""The hooks that cast the gradient themselves, so the unit leaves it in its own dtype."""


def is_low_precision_hook(hook: Callable[..., object]) -> bool:
    """fsdp1's low-precision hooks or torch's (which scripts written for torch's FSDP1 register)."""
    return hook in LOW_PRECISION_HOOKS or hook in torch_low_precision_hooks()
