"""Names that several layers share: what a unit is doing, and which strategies shard or reshard.

A leaf: it imports nothing of fsdp1 but ``api``, so that construction, the runtime and the
state-dict paths can all read these without reaching up to the module that drives them.
"""

from enum import Enum, auto

from ..api import ShardingStrategy


class TrainingState(Enum):
    """What a unit is doing, named as torch's ``TrainingState``."""

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
SHARDED_STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) + HYBRID_STRATEGIES
# Strategies that free the unsharded parameters after forward; the others keep them for backward.
RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
