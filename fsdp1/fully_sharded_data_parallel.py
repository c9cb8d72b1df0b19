"""torch's path of the FSDP1 module, ``torch.distributed.fsdp.fully_sharded_data_parallel``: the class
the FSDP1 front (``_wrapper``) defines, and the names torch's module offers too (the configuration,
``FlatParameter``), so that an import from torch's path ports by swapping the prefix."""

from ._engine.flat_parameter import FlatParameter  # noqa: F401 - importable from here, as from torch's module
from ._wrapper.fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType
from .api import (  # noqa: F401 - importable from here, as from torch's module
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

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]
