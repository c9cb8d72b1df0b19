"""fsdp1: a standalone re-implementation of PyTorch's classic FullyShardedDataParallel (FSDP1).

``import fsdp1 as fsdp`` offers the names of ``torch.distributed.fsdp``: FSDP1's wrapper and its
configuration, and FSDP2's ``fully_shard`` with its policies, on the same engine.
"""

from . import comm_hooks, sharded_grad_scaler  # noqa: F401 - fsdp1.comm_hooks, fsdp1.sharded_grad_scaler
from ._engine.collectives import ProcessGroupBroken  # noqa: F401 - fsdp1's own, so not in torch's __all__
from ._engine.flat_parameter import FlatParameter  # noqa: F401 - importable, not in __all__, as in torch
from ._fully_shard import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from ._torch_alias import use_as_torch_fsdp  # noqa: F401 - fsdp1's own, so not in torch's __all__
from ._torch_recognition import recognise_fsdp1_in_torch
from ._torch_version import warn_if_untested
from .api import (
    BackwardPrefetch,
    BlockQuantization,  # noqa: F401 - fsdp1's own, so not in torch's __all__
    CPUOffload,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType
from .plan import plan  # noqa: F401 - fsdp1's own, so not in torch's __all__ (and fsdp1.plan the package stays importable)

warn_if_untested()
recognise_fsdp1_in_torch()

__version__ = "0.5.0"

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "GradientReductionHandle",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
