"""The values a unit starts from: meta-device modules given real storage (``MetaInit``),
``sync_module_states`` (every rank takes the first rank's values), the check that ranks built the
same values when they are not synced, and the move to the compute device.

Ranks that built different values are warned about, not refused: torch's FSDP1 accepts them and
scripts rely on it (workers seeded differently), so the check names the first differing parameter
on every rank; ``FSDP1_REQUIRE_SAME_VALUES=1`` refuses instead. Shapes and dtypes that differ are
refused always.
"""

import os
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._engine import collectives as comm
from .._engine.traversal import (
    ParamSlot,
    clean_fqn,
    iter_param_slots,
    iter_unit_submodules,
    unit_named_buffers,
    unit_named_modules,
)
from .process_groups import ProcessGroups
from .unit_plan import IgnoredStates, is_flattened


def check_param_init_fn(param_init_fn: Any) -> None:
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(
            f"fsdp1: Expected {param_init_fn} to be callable but got {type(param_init_fn)}: param_init_fn must be "
            "callable (it is called with each module to initialise)."
        )


def _own_states(module: nn.Module) -> List[Any]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


class MetaInit:
    """Gives the modules of this unit (not those of nested units, which did so as they were built,
    nor ignored ones) real storage, so that no rank ever holds more of a meta-built model unsharded
    than one unit. Every module is checked at construction, before any is touched.

    With ``param_init_fn`` it is called on every module of the unit, breadth first (before
    flattening: the user's function decides where storage comes from). Otherwise each module owning
    parameters or buffers is reset with ``reset_parameters()`` as torch's does after ``to_empty``, but
    its parameters are already views of the unit's flat buffer (``reset_in_place``, called by the
    handle), so the unit is never held twice.
    """

    def __init__(self, module: nn.Module, param_init_fn: Optional[Callable[[nn.Module], None]], device: torch.device,
                 ignored: IgnoredStates) -> None:
        named = unit_named_modules(module, ignored.modules)
        self._modules = [m for _, m in named]
        self._param_init_fn = param_init_fn
        self.device = device
        self.is_needed = any(t.is_meta for m in self._modules for t in _own_states(m))
        if self.is_needed and param_init_fn is None:
            for name, m in named:
                if _own_states(m) and not callable(getattr(m, "reset_parameters", None)):
                    where = f"module '{clean_fqn(name)}'" if name else "the module"
                    raise ValueError(
                        f"fsdp1: {where} ({type(m).__name__}) is on the meta device but has no reset_parameters() to "
                        "initialise it. Pass param_init_fn=..., called with each module, e.g. "
                        "lambda m: m.to_empty(device=torch.device('cpu'), recurse=False) followed by your own init."
                    )

    @property
    def is_in_place(self) -> bool:
        return self.is_needed and self._param_init_fn is None

    def run_param_init_fn(self) -> None:
        """Only with a ``param_init_fn`` (``is_needed and not is_in_place``)."""
        param_init_fn = self._param_init_fn
        assert param_init_fn is not None, "run_param_init_fn() without a param_init_fn"
        with torch.no_grad():
            for m in self._modules:
                param_init_fn(m)

    def reset_in_place(self) -> None:
        """The unit's parameters already have storage: give meta buffers theirs, then reset."""
        with torch.no_grad():
            for m in self._modules:
                if not _own_states(m):
                    continue
                for attr, buffer in m._buffers.items():
                    if buffer is not None and buffer.is_meta:
                        m._buffers[attr] = torch.empty_like(buffer, device=self.device)
                m.reset_parameters()  # type: ignore[operator]  # checked callable in __init__; mypy sees Tensor | Module


def sync_module_states(module: nn.Module, slots: Sequence[ParamSlot], ignored: IgnoredStates, groups: ProcessGroups) -> None:
    """Every rank takes the first rank's values of this unit's parameters and of the buffers of its
    modules (not ignored ones). Shapes and dtypes are compared first, so a mismatch raises the same
    error on every rank instead of hanging in a broadcast of the wrong size. Under a hybrid strategy
    the replicas then take their first replica's."""
    named = [(slot.fqn, slot.live_param) for slot in slots] + [
        (fqn, buffer) for fqn, _, _, buffer in unit_named_buffers(module, ignored.modules)
    ]
    unique = list({id(tensor): (fqn, tensor) for fqn, tensor in named}.values())
    for group in (groups.shard, groups.replicate):
        if group is not None:
            _check_same_shapes(unique, group)
            with torch.no_grad():
                works = [comm.broadcast_from_first(tensor.data, group) for _, tensor in unique]
                for work in works:
                    work.wait()


REQUIRE_SAME_VALUES = "FSDP1_REQUIRE_SAME_VALUES"
"""Set to 1 to refuse, instead of warn about, ranks that built the model with different values."""


def check_same_values(module: nn.Module, ignored: IgnoredStates, groups: ProcessGroups) -> None:
    """Without ``sync_module_states`` the ranks should have built the same values: each keeps its own
    shard of what it built, so ranks seeded differently train a mix of their models (pytorch#75870),
    which torch's FSDP1 accepts silently and scripts rely on (a tutorial whose workers are not seeded
    alike, a DDP script that seeds each rank for its data order). So different values are warned
    about on every rank, naming the first parameter and the fixes, and refused only when
    ``FSDP1_REQUIRE_SAME_VALUES=1``; different shapes or dtypes, which no training survives, are
    refused. Before anything is wrapped, each parameter's shape, dtype, sum and norm (reductions in
    its own dtype, so no copy is made; equal values give equal results bitwise) are compared across
    the ranks in one object all-gather. Parameters on the meta device have no values yet, and
    flattened ones (a unit's shards) differ by design."""
    slots = [slot for slot in iter_param_slots(module) if not ignored.has_param(slot.live_param)
             and slot.live_param.is_floating_point() and not slot.live_param.is_meta and not is_flattened(slot.live_param)]
    unique = list({id(slot.param): slot for slot in slots}.values())
    if not unique:
        return
    params = [slot.live_param for slot in unique]
    with torch.no_grad():
        sums = torch.stack([v.double() for param in params for v in (param.sum(), torch.linalg.vector_norm(param))])
    values = [value.hex() for value in sums.tolist()]  # hex: exact, and a NaN equals a NaN
    mine = [(tuple(param.shape), str(param.dtype), values[2 * i], values[2 * i + 1]) for i, param in enumerate(params)]
    for group in (groups.shard, groups.replicate):
        if group is None or comm.group_size(group) == 1 or not comm.communicates(group):
            continue
        every = comm.all_gather_object(mine, group)
        for rank, theirs in enumerate(every):
            here, first = comm.global_rank_of(group, rank), comm.global_rank_of(group, 0)
            if len(theirs) != len(every[0]):
                raise ValueError(
                    f"fsdp1: the module has {len(theirs)} floating-point parameters on rank {here} but "
                    f"{len(every[0])} on rank {first}; build the same model on every rank."
                )
            for slot, (shape, dtype, _, _), (first_shape, first_dtype, _, _) in zip(unique, theirs, every[0]):
                if (shape, dtype) != (first_shape, first_dtype):
                    raise ValueError(
                        f"fsdp1: '{clean_fqn(slot.fqn)}' is {dtype} of shape {shape} on rank {here} but "
                        f"{first_dtype} of shape {first_shape} on rank {first}; build the same model on every rank."
                    )
            differing = next((slot for slot, a, b in zip(unique, theirs, every[0]) if a != b), None)
            if differing is not None:
                _report_different_values(clean_fqn(differing.fqn), here, first)
                return


def _report_different_values(fqn: str, rank: int, first: int) -> None:
    message = (
        f"fsdp1: '{fqn}' has other values on rank {rank} than on rank {first}: the ranks built the model "
        "differently (other seeds?), and each keeps its own shard of what it built, so they train a mix of "
        "their models. Seed every rank alike before building the model, or pass sync_module_states=True "
        f"to take the first rank's values ({REQUIRE_SAME_VALUES}=1 makes this an error)."
    )
    if os.environ.get(REQUIRE_SAME_VALUES) == "1":
        raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=4)


def _check_same_shapes(named: Sequence[Tuple[str, torch.Tensor]], group: comm.ProcessGroup) -> None:
    mine = [(fqn, tuple(t.shape), str(t.dtype)) for fqn, t in named]
    for rank, theirs in enumerate(comm.all_gather_object(mine, group)):
        for (fqn, shape, dtype), (_, their_shape, their_dtype) in zip(mine, theirs):
            if (shape, dtype) != (their_shape, their_dtype):
                raise ValueError(
                    f"fsdp1: sync_module_states: '{fqn}' is {dtype} of shape {shape} on rank {comm.group_rank(group)} "
                    f"but {their_dtype} of shape {their_shape} on rank {rank}; build the same model on every rank."
                )
        if len(theirs) != len(mine):
            raise ValueError(
                f"fsdp1: sync_module_states: rank {comm.group_rank(group)} has {len(mine)} parameters and buffers "
                f"here but rank {rank} has {len(theirs)}; build the same model on every rank."
            )


def move_to_compute_device(module: nn.Module, device: torch.device, ignored: IgnoredStates) -> None:
    """``module.to(device)`` except ignored modules and parameters, which stay where the user put them."""
    with torch.no_grad():
        for m in (module, *iter_unit_submodules(module, ignored.modules)):
            for attr, param in m._parameters.items():
                if param is not None and not ignored.has_param(param) and param.device != device:
                    param.data = param.data.to(device)
            for attr, buffer in m._buffers.items():
                if buffer is not None and buffer.device != device:
                    m._buffers[attr] = buffer.to(device)
