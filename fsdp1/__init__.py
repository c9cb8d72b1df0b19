"""fsdp1: a standalone re-implementation of PyTorch's classic FullyShardedDataParallel (FSDP1).

``import fsdp1 as fsdp`` offers the FSDP1 names of ``torch.distributed.fsdp``.
"""

from . import comm_hooks, sharded_grad_scaler  # noqa: F401 - fsdp1.comm_hooks, fsdp1.sharded_grad_scaler
from ._collectives import ProcessGroupBroken  # noqa: F401 - fsdp1's own, so not in torch's __all__
from ._flat_param import FlatParameter  # noqa: F401 - importable, not in __all__, as in torch
from ._torch_alias import use_as_torch_fsdp  # noqa: F401 - fsdp1's own, so not in torch's __all__
from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]
