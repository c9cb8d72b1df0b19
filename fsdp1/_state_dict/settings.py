"""``UnitStateDicts``: one unit's state-dict settings (the type and configs that ``state_dict_type``
sets) and what a save or load under way needs. It is kept under a key of the unit module's
``__dict__``, as the unit's runtime state is, so that the state-dict code reads and writes this
object and never the module's attributes."""

from typing import Optional, Set

from torch import nn

from .._engine import collectives as comm
from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

STATE_DICT_STATE = "_fsdp_state_dicts"


class UnitStateDicts:
    """The state-dict settings of one unit, FULL by default as torch's. ``saves_full_only``: the
    unit saves and loads FULL whatever the setting (a NO_SHARD unit on several ranks, torch's rule)."""

    def __init__(self, saves_full_only: bool) -> None:
        self.type = StateDictType.FULL_STATE_DICT
        self.config: StateDictConfig = FullStateDictConfig()
        self.optim_config: OptimStateDictConfig = FullOptimStateDictConfig()
        self.saves_full_only = saves_full_only
        self.mesh: Optional[comm.DeviceMesh] = None  # the shard group's, made at the first SHARDED save
        self.keys_loaded_by_hook: Set[str] = set()  # by the load pre-hook, for the post-hook's report
        self.load_is_strict: Optional[bool] = None  # known while a load called on a unit runs

    @property
    def settings(self) -> StateDictSettings:
        return StateDictSettings(self.type, self.config, self.optim_config)

    def use(self, settings: StateDictSettings) -> None:
        self.type, self.config, self.optim_config = (settings.state_dict_type, settings.state_dict_config,
                                                     settings.optim_state_dict_config)

    @property
    def effective_type(self) -> StateDictType:
        """The form the unit saves and loads in."""
        return StateDictType.FULL_STATE_DICT if self.saves_full_only else self.type


def state_dicts_of(unit: nn.Module) -> UnitStateDicts:
    """The state-dict settings of a unit module."""
    return unit.__dict__[STATE_DICT_STATE]
