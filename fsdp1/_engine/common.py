"""What a unit is doing (``TrainingState``), which the runtime, the state dicts and both fronts read.

A leaf of the engine: it imports nothing of fsdp1.
"""

from enum import Enum, auto


class TrainingState(Enum):
    """What a unit is doing, named as torch's ``TrainingState``."""

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()
