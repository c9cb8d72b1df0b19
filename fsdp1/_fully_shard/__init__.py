"""The ``fully_shard`` front (torch's FSDP2 API): ``fully_shard``, ``FSDPModule`` and its methods,
``UnshardHandle``, ``GradientReductionHandle``; what turns a mesh and FSDP2's arguments into engine parts.

Its rule: it imports the engine, the state dicts, ``api`` and ``_torch_version`` (what the running
release's ``fully_shard`` does); never the FullyShardedDataParallel front."""

from .fully_shard import fully_shard
from .module import FSDPModule, GradientReductionHandle, UnshardHandle, register_fsdp_forward_method, share_comm_ctx

__all__ = ["FSDPModule", "GradientReductionHandle", "UnshardHandle", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]
