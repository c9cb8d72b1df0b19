"""Which optimizer parameter is which original parameter of the model: ``OptimizerParams`` numbers
the optimizer's parameters as ``optim.state_dict()`` does (by position over all param groups) and
names each by its clean FQN, unit by unit (``UnitEntry``), for saving, loading and rekeying
optimizer state.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from .._engine.handle import FlatParamHandle
from .._engine.traversal import clean_fqn, unit_paths
from .._engine.unit_state import state_of

State = Dict[str, Any]


@dataclass
class UnitEntry:
    """One unit's parameters as the optimizer holds them: the flat parameter at ``positions[0]``
    (use_orig_params=False), or each original parameter at its own position (None: not in the
    optimizer)."""

    unit: nn.Module
    handle: FlatParamHandle
    fqns: List[str]  # clean names from the model root, flat order
    positions: List[Optional[int]]

    @property
    def flat_position(self) -> int:
        """The flat parameter's position (use_orig_params=False): a unit is listed only when the
        optimizer holds one of its parameters, and then that is the flat parameter."""
        position = self.positions[0]
        assert position is not None, "a unit listed whose flat parameter the optimizer does not hold"
        return position


class OptimizerParams:
    """Which optimizer parameter (by position over all param groups, as ``optim.state_dict()``
    numbers them) is which original parameter of the model."""

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor]) -> None:
        position = {id(p): i for i, p in enumerate(params)}
        self.count = len(params)
        self.units: List[UnitEntry] = []
        self.fqns_at: Dict[int, List[str]] = {}
        covered: Set[int] = set()
        for unit, path in unit_paths(model).items():
            handle = state_of(unit).handle
            if handle is None:
                continue
            dot = f"{path}." if path else ""
            fqns = [dot + clean_fqn(fqn) for fqn in handle.fqns]
            members = [handle.flat_param] if not handle.use_orig_params else handle.views.orig_params()
            positions = [position.get(id(p)) for p in members]
            covered.update(id(p) for p in members)
            if all(p is None for p in positions):
                continue
            entry = UnitEntry(unit, handle, fqns, positions)
            self.units.append(entry)
            if handle.use_orig_params:
                self.fqns_at.update((pos, [fqn]) for pos, fqn in zip(positions, fqns) if pos is not None)
            else:
                self.fqns_at[entry.flat_position] = fqns
        self.plain: List[Tuple[int, str]] = []  # parameters outside every unit (ignored ones, a plain root's)
        for name, param in model.named_parameters():
            if id(param) in position and id(param) not in covered:
                self.plain.append((position[id(param)], clean_fqn(name)))
                self.fqns_at[position[id(param)]] = [clean_fqn(name)]
        missing = [i for i in range(self.count) if i not in self.fqns_at]
        if missing:
            raise ValueError(
                f"fsdp1: the optimizer holds {len(missing)} parameter(s) that are not in this model (first at "
                f"position {missing[0]}); build the optimizer from model.parameters() of the wrapped model."
            )


def params_of(optim: torch.optim.Optimizer) -> List[nn.Parameter]:
    """The optimizer's parameters, in the order of its positions."""
    return [p for group in optim.param_groups for p in group["params"]]


def params_in(optim_input: Any) -> List[torch.Tensor]:
    """What an optimizer built on ``optim_input`` (parameters, or param-group dicts) numbers, in order."""
    params: List[torch.Tensor] = []
    for item in optim_input:
        group = item["params"] if isinstance(item, dict) else [item]
        params.extend([group] if isinstance(group, torch.Tensor) else group)
    return params
