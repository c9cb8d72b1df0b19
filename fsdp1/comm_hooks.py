"""torch's default FSDP1 communication hooks at a public path (torch keeps its own under
``torch.distributed.algorithms._comm_hooks.default_hooks``); they belong to the FSDP1 front, which
alone registers comm hooks."""

from ._wrapper.comm_hooks import (
    LOW_PRECISION_HOOKS,
    DefaultState,
    LowPrecisionState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    reduce_scatter_hook,
)

__all__ = [
    "DefaultState",
    "LowPrecisionState",
    "allreduce_hook",
    "reduce_scatter_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "LOW_PRECISION_HOOKS",
]
