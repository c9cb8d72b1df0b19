"""Optimizer state dicts: the optimizer's state of flat parameters (or of the original parameters'
shard slices, with use_orig_params) as one entry per original parameter under its clean name, and
back, in the form the model's ``state_dict_type`` sets: FULL (each state tensor gathered whole),
SHARDED (DTensor rows, for DCP, as the model's own SHARDED state) or LOCAL (the optimizer's own).

Per unit, every tensor state is first laid out as the unit's local shard, so that the handle's
conversions serve optimizer state exactly as they serve the parameters: one all-gather (FULL) or
one all-to-all (SHARDED) per unit and state name, never the whole model's state at once. Ranks
agree on each unit's state names first (a rank whose shard holds no element of a parameter keeps
no state for it), so every rank issues the same collectives.
"""

import contextlib
import warnings
from enum import Enum, auto
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._engine import collectives as comm
from .._engine.layout import piece_in_shard
from .._engine.traversal import fsdp_units
from .._engine.unit_state import state_of
from ..api import FullOptimStateDictConfig, StateDictType
from .optim_params import OptimizerParams, State, UnitEntry, params_in, params_of
from .settings import state_dicts_of
from .state_dict import dim0_chunk, get_state_dict_type, rows_as_dtensors, state_dict_type


def _check_every_rank_calls(model: nn.Module, api: str) -> None:
    units = fsdp_units(model)
    if units:
        comm.check_every_rank_calls(state_of(units[0]).process_group, api)


# ---------------------------------------------------------------------------------------- saving
def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Optional[State] = None) -> State:
    """The optimizer's state by clean parameter name in the model's state-dict type. Collective.
    For a fresh optimizer the result is still complete (``fresh_state_template``), a template for
    ``torch.distributed.checkpoint.load``, and the optimizer is left untouched."""
    settings = get_state_dict_type(model)
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        return fresh_state_template(optim) if optim_state_dict is None else optim_state_dict
    _check_every_rank_calls(model, "optim_state_dict()")
    params = OptimizerParams(model, params_of(optim))
    if optim_state_dict is None:
        optim_state_dict = optim.state_dict() if _stepped_on_any_rank(params, optim) else fresh_state_template(optim)
    config = settings.optim_state_dict_config
    sharded = settings.state_dict_type is StateDictType.SHARDED_STATE_DICT
    keep = sharded or not getattr(config, "rank0_only", False) or comm.global_rank() == 0
    saved = optim_state_dict["state"]
    state: Dict[str, State] = {}
    for entry in params.units:
        _unit_state_out(entry, saved, sharded, config.offload_to_cpu, keep, state)
    for position, fqn in params.plain:
        if position in saved:
            state[fqn] = dict(saved[position])
    if not keep:
        return {}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [f for i in group["params"] for f in params.fqns_at[i]]}
        for group in optim_state_dict["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _unit_state_out(entry: UnitEntry, saved: Dict[int, State], sharded: bool, offload: bool, keep: bool,
                    out: Dict[str, State]) -> None:
    handle = entry.handle
    sharded = sharded and state_dicts_of(entry.unit).effective_type is StateDictType.SHARDED_STATE_DICT  # NO_SHARD: full, as its parameters
    tensors, scalars, stateful = _agreed_state(entry, saved)
    for name, dtype in tensors.items():
        flat = _shard_laid_out(entry, saved, name, dtype)
        values: Sequence[torch.Tensor]
        if sharded:
            values = rows_as_dtensors(entry.unit, handle.conversions.held_slices_of(flat), offload)
        else:
            gathered = handle.conversions.full_values_of(flat)  # every rank takes part; only those that keep copy out
            values = [value.to("cpu", copy=True) if offload else value.clone() for value in gathered] if keep else []
        if keep:
            for index, fqn in enumerate(entry.fqns):
                if index in stateful or not handle.use_orig_params:
                    out.setdefault(fqn, {})[name] = values[index]
    if keep:
        for index, fqn in enumerate(entry.fqns):
            for name, value in scalars.get(index if handle.use_orig_params else 0, {}).items():
                out.setdefault(fqn, {})[name] = _copied(value)  # a step per name: optimizers add to it in place


def _agreed_state(entry: UnitEntry, saved: Dict[int, State]) -> Tuple[Dict[str, torch.dtype], Dict[int, State], Set[int]]:
    """The unit's tensor state names (with dtypes), its scalar states per parameter (per index of
    the flat order; index 0 for the flat parameter) and the indices that have any state, as the
    union over the ranks."""
    tensors: Dict[str, torch.dtype] = {}
    scalars: Dict[int, State] = {}
    stateful = set()
    for index, position in enumerate(entry.positions):
        for name, value in saved.get(position, {}).items() if position is not None else ():
            stateful.add(index)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[name] = value.dtype
            else:
                scalars.setdefault(index, {})[name] = value.clone() if isinstance(value, torch.Tensor) else value
    if state_of(entry.unit).world_size > 1:
        gathered = comm.all_gather_object((tensors, scalars, stateful), state_of(entry.unit).process_group)
        for other_tensors, other_scalars, other_stateful in gathered:
            tensors.update(other_tensors)
            stateful |= other_stateful
            for index, values in other_scalars.items():
                scalars.setdefault(index, values)
    return dict(sorted(tensors.items())), scalars, stateful


def _shard_laid_out(entry: UnitEntry, saved: Dict[int, State], name: str, dtype: torch.dtype) -> torch.Tensor:
    """State ``name`` of the unit as one tensor laid out as the local shard (zeros where no
    parameter of this rank has it)."""
    handle = entry.handle
    if not handle.use_orig_params:
        value = saved.get(entry.flat_position, {}).get(name)
        if value is not None:
            return value
        return torch.zeros(handle.layout.shard_numel, dtype=dtype, device=handle.flat_param.device)
    flat = torch.zeros(handle.layout.shard_numel, dtype=dtype, device=handle.flat_param.device)
    for info, position in zip(handle.layout.shard_infos, entry.positions):
        value = saved.get(position, {}).get(name) if position is not None else None
        if value is not None and info.in_shard:
            flat[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard] = value.reshape(-1)
    return flat


def _stepped_on_any_rank(params: "OptimizerParams", optim: torch.optim.Optimizer) -> bool:
    """Whether the optimizer has state (or gradients to make it from) on any rank of the units' group.
    A rank whose shards hold no trainable element (use_orig_params, frozen parameters laid out there)
    never gets state; it must then offer nothing, not a template whose ``step`` 0 would stand beside
    the other ranks' real steps."""
    stepped = _has_state_or_grads(optim)
    if not params.units or state_of(params.units[0].unit).world_size == 1:
        return stepped
    unit = params.units[0].unit
    flag = torch.tensor([float(stepped)], device=state_of(unit).compute_device)
    comm.all_reduce_with(flag, state_of(unit).process_group, maximum=True).wait()
    return bool(flag.item())


def _has_state_or_grads(optim: torch.optim.Optimizer) -> bool:
    """The optimizer has stepped here, or has gradients to step on: its ``state_dict()`` is the state."""
    return bool(optim.state) or any(p.grad is not None for p in params_of(optim))


def fresh_state_template(optim: torch.optim.Optimizer) -> State:
    """``optim.state_dict()``, complete even for an optimizer that has not stepped: its state is made
    as torch's DCP helpers make it (a step on zero gradients at learning rate 0, which changes no
    parameter), copied with every ``step`` at 0 (what a first step starts from), and then the
    optimizer is put back as it was, so that asking for a template changes no later step."""
    if _has_state_or_grads(optim):
        return optim.state_dict()
    params = params_of(optim)
    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    rates = [group.get("lr") for group in optim.param_groups]
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for group, rate in zip(optim.param_groups, rates):
            if rate is not None:
                group["lr"] = rate
        optim.zero_grad(set_to_none=True)
    template = optim.state_dict()
    template["state"] = {
        position: {n: torch.zeros_like(v) if n == "step" and isinstance(v, torch.Tensor) else _copied(v) for n, v in state.items()}
        for position, state in template["state"].items()
    }
    optim.state.clear()
    return template


# ---------------------------------------------------------------------------------------- loading
def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Optional[State],
                             load_directly: bool = False) -> State:
    """The inverse: what ``optim.load_state_dict`` takes, from a dict by clean names in the model's
    state-dict type. FULL needs no communication, or with ``rank0_only`` only rank 0 holds the dict
    and scatters each unit's state (one shard per rank); SHARDED moves rows back with one all-to-all
    per unit and state name. No rank ever holds a whole unit's state beyond what it was given."""
    settings = get_state_dict_type(model)
    kind = settings.state_dict_type
    if kind is StateDictType.LOCAL_STATE_DICT:
        if optim_state_dict is None:
            raise ValueError(
                "fsdp1: optim_state_dict_to_load() got None for the optimizer state dict; under LOCAL_STATE_DICT "
                "pass what FullyShardedDataParallel.optim_state_dict(model, optim) returned."
            )
        result = optim_state_dict
    else:
        _check_every_rank_calls(model, "optim_state_dict_to_load()")
        from_rank0 = kind is StateDictType.FULL_STATE_DICT and getattr(settings.optim_state_dict_config, "rank0_only", False)
        mode = _Given.SHARDED if kind is StateDictType.SHARDED_STATE_DICT else _Given.ON_RANK0 if from_rank0 else _Given.FULL
        group_sizes = [len(group["params"]) for group in optim.param_groups]
        result = _to_load(model, params_of(optim), group_sizes, optim_state_dict or {}, mode)
    if load_directly:
        optim.load_state_dict(result)
    return result


class _Given(Enum):
    """The form of the optimizer state a load is given."""

    FULL = auto()  # every rank holds every parameter's full state
    ON_RANK0 = auto()  # only rank 0 does (rank0_only): it checks, describes and scatters each unit's state
    SHARDED = auto()  # each rank holds its DTensor slices, as a SHARDED save wrote them


def _to_load(model: nn.Module, order: Sequence[torch.Tensor], group_sizes: Optional[List[int]], given: State,
             mode: _Given) -> State:
    """``given`` keyed by the positions of ``order`` (the optimizer's parameters). With the optimizer's
    ``group_sizes`` its groups are checked against the dict's; without (an older load given no
    optimizer) the dict's own groups are kept, as torch's."""
    params = OptimizerParams(model, order)
    by_name = given.get("state", {})
    if mode is _Given.ON_RANK0:  # what is not per unit comes from rank 0 as objects (hyper-parameters, plain parameters)
        plain = {fqn: by_name[fqn] for _, fqn in params.plain if fqn in by_name}
        shared = comm.broadcast_object_from_first({"param_groups": given.get("param_groups"), "plain": plain}, comm.default_group())
        given = {"state": {**by_name, **shared["plain"]}, "param_groups": shared["param_groups"]}
        by_name = given["state"]
    _refuse_unknown_names(by_name, params, mode)
    groups = given.get("param_groups")
    if "state" not in given or groups is None or (group_sizes is not None and len(groups) != len(group_sizes)):
        needed = "both" if group_sizes is None else f"{len(group_sizes)} group(s), as this optimizer has"
        raise ValueError(
            f"fsdp1: the optimizer state dict has {len(groups or [])} param group(s) and "
            f"{'a' if 'state' in given else 'no'} 'state' entry; it needs {needed}. Pass what "
            "FullyShardedDataParallel.optim_state_dict(model, optim) returned for this model."
        )
    state: Dict[int, State] = {}
    for entry in params.units:
        _unit_state_in(entry, by_name, mode, state)
    for position, fqn in params.plain:
        if fqn in by_name:
            state[position] = {k: v.full_tensor() if isinstance(v, DTensor) else _copied(v) for k, v in by_name[fqn].items()}
    if group_sizes is None:
        return {"state": state, "param_groups": _groups_by_position(groups, params)}
    start = 0
    loaded_groups: List[State] = []
    for group, size in zip(groups, group_sizes):
        expected = [f for p in range(start, start + size) for f in params.fqns_at[p]]
        if sorted(group["params"]) != sorted(expected):  # by name: another wrapping may order them otherwise
            raise ValueError(
                f"fsdp1: param group {len(loaded_groups)} of the optimizer state dict holds {_few(group['params'])}, "
                f"this optimizer's holds {_few(expected)}; build the optimizer with the same groups as the saved one."
            )
        loaded_groups.append({**{k: v for k, v in group.items() if k != "params"},
                              "params": list(range(start, start + size))})
        start += size
    return {"state": state, "param_groups": loaded_groups}


def _refuse_unknown_names(by_name: Dict[str, State], params: OptimizerParams, mode: _Given) -> None:
    """Refuse, on every rank at once, state for a name none of the optimizer's parameters has (a
    renamed or another model's parameter), whose state the load would otherwise drop without a word
    (torch's does)."""
    known = {fqn for fqns in params.fqns_at.values() for fqn in fqns}
    unknown = sorted(name for name in by_name if name not in known)
    if mode is _Given.ON_RANK0 and comm.global_rank() != 0:
        unknown = []  # only rank 0 was given the dict
    found = [(rank, names) for rank, names in enumerate(comm.all_gather_object(unknown, comm.default_group())) if names]
    if found:
        rank, names = found[0]
        raise ValueError(
            f"fsdp1: the optimizer state dict (rank {rank}'s) holds state for {_few(names)} that no parameter of this "
            "optimizer has; nothing was loaded. Pass the dict FullyShardedDataParallel.optim_state_dict() gave for "
            "this model and optimizer, or rename its keys to the model's parameter names."
        )


def _groups_by_position(groups: List[State], params: OptimizerParams) -> List[State]:
    """The dict's param groups with each name replaced by its parameter's position (a flat
    parameter's once, sorted): what torch's older loads give when no optimizer is passed."""
    position_of = {fqn: position for position, fqns in params.fqns_at.items() for fqn in fqns}
    loaded = []
    for index, group in enumerate(groups):
        unknown = [name for name in group["params"] if name not in position_of]
        if unknown:
            raise ValueError(
                f"fsdp1: param group {index} of the optimizer state dict holds {_few(unknown)} that the "
                "parameters it is loaded for (model.parameters(), or optim_input) do not hold; pass optim= "
                "(the optimizer to load into), or the state dict saved with this model."
            )
        loaded.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": sorted({position_of[name] for name in group["params"]})})
    return loaded


class _TensorState:
    """Stands for a tensor state in what rank 0 describes to the others (``rank0`` loads)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _unit_state_in(entry: UnitEntry, by_name: Dict[str, State], mode: _Given, out: Dict[int, State]) -> None:
    handle = entry.handle
    present = [by_name.get(fqn, {}) for fqn in entry.fqns]
    if mode is _Given.ON_RANK0:  # rank 0 checks and describes the unit's state to every rank (values stay on rank 0)
        problem = _shape_problem(entry, present) if comm.global_rank() == 0 else None
        described = [{n: _TensorState(v.dtype) if _is_tensor_state(v) else v for n, v in s.items()} for s in present]
        described, problem = comm.broadcast_object_from_first((described, problem), comm.default_group())
        if problem:  # on every rank, before any scatter that rank 0 alone would fail in
            raise ValueError(f"{problem} (rank 0's dict; rank0_only)")
        present = present if comm.global_rank() == 0 else described
    elif problem := _shape_problem(entry, present):
        raise ValueError(problem)
    if mode is _Given.SHARDED and state_dicts_of(entry.unit).effective_type is StateDictType.FULL_STATE_DICT:
        mode = _Given.FULL  # a NO_SHARD unit saved full tensors, as its parameters
    names = sorted({n for s in present for n, v in s.items() if _is_tensor_state(v) or isinstance(v, _TensorState)})
    shapes = [p.shape for p in handle.views.orig_params()] if handle.use_orig_params else []
    if handle.use_orig_params and mode is _Given.FULL:  # each parameter's slice straight from its full value
        for info, position, state, shape in zip(handle.layout.shard_infos, entry.positions, present, shapes):
            if position is not None and state and info.in_shard:
                out[position] = {n: piece_in_shard(info, v).reshape(shape).clone() if n in names else _copied(v)
                                 for n, v in state.items()}
        return
    like = handle.flat_param.detach()
    flats = {}
    for name in names:
        values = [s.get(name) for s in present]
        template = like.new_empty(0, dtype=next(v for v in values if v is not None).dtype)
        if mode is _Given.SHARDED:
            rows = [None if v is None else dim0_chunk(entry.unit, handle, i, v) for i, v in enumerate(values)]
            flats[name] = handle.conversions.shard_of_rows(rows, template)
        elif mode is _Given.FULL:
            flats[name] = handle.conversions.shard_of_full_values(values, template)
        else:
            flats[name] = _scattered(entry, values, template)
    if not handle.use_orig_params:
        scalars = next((s for s in present if s), {})
        out[entry.flat_position] = {**_scalars_of(scalars), **flats}
        return
    for index, (info, position, shape) in enumerate(zip(handle.layout.shard_infos, entry.positions, shapes)):
        if position is None or not present[index] or not info.in_shard:
            continue
        pieces = {n: flats[n][info.offset_in_shard : info.offset_in_shard + info.numel_in_shard].reshape(shape).clone()
                  for n in names if n in present[index]}
        out[position] = {**_scalars_of(present[index]), **pieces}


def _shape_problem(entry: UnitEntry, present: List[State]) -> Optional[str]:
    """What is wrong, if anything: a tensor state must have its parameter's shape (of the whole
    parameter: FULL and SHARDED alike describe the unsharded one)."""
    for fqn, state, shape in zip(entry.fqns, present, entry.handle.layout.shapes):
        for name, value in state.items():
            if _is_tensor_state(value) and tuple(value.shape) != tuple(shape):
                return (f"fsdp1: optimizer state '{name}' of '{fqn}' has shape {tuple(value.shape)}, the parameter "
                        f"{tuple(shape)}; load the optimizer state saved with this model.")
    return None


def _scattered(entry: UnitEntry, values: List[Any], template: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a state whose full values only global rank 0 holds: rank 0 lays out one
    unit's state and scatters it over its shard group (a broadcast when the unit is not sharded);
    under a hybrid strategy the other replicas then receive their shard from the first replica."""
    handle, unit = entry.handle, entry.unit
    full = handle.conversions.padded_full_of(values, template) if comm.global_rank() == 0 else None
    holds_rank0 = comm.global_rank_of(state_of(unit).process_group, 0) == 0
    if not handle.is_sharded:
        shard = full if full is not None else template.new_empty(handle.layout.shard_numel)
        if holds_rank0:
            comm.broadcast_from_first(shard, state_of(unit).process_group).wait()
    else:
        shard = template.new_empty(handle.layout.shard_numel)
        if holds_rank0:
            comm.scatter_from_first(shard, full, state_of(unit).process_group)
    if handle.replicate_group is not None:
        comm.broadcast_from_first(shard, handle.replicate_group).wait()
    return shard


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _is_tensor_state(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _scalars_of(state: State) -> State:
    """Copies (an optimizer adds to its ``step`` tensor in place, which must not change the caller's dict)."""
    return {n: _copied(v) for n, v in state.items() if not (_is_tensor_state(v) or isinstance(v, _TensorState))}


def _few(names: List[str], shown: int = 3) -> str:
    listed = ", ".join(f"'{n}'" for n in names[:shown])
    return f"{len(names)} parameter(s) ({listed}{', ...' if len(names) > shown else ''})"


# ---------------------------------------------------------------------------------------- the older API
@contextlib.contextmanager
def _as(model: nn.Module, kind: StateDictType, rank0_only: bool = False) -> Iterator[None]:
    """The model's units under ``kind`` (with ``rank0_only`` for FULL) for the duration."""
    optim_config = FullOptimStateDictConfig(rank0_only=rank0_only) if kind is StateDictType.FULL_STATE_DICT else None
    with state_dict_type(model, kind, None, optim_config):
        yield


def _warn_deprecated(api: str, replacement: str) -> None:
    """torch's FutureWarning for each older function, with its phrase, pointing at the caller's line
    (the frames between: the function here and the class's static method)."""
    warnings.warn(
        f"fsdp1: FullyShardedDataParallel.{api} is being deprecated and is replaced by "
        f"FullyShardedDataParallel.{replacement}, as in torch's FSDP1.",
        FutureWarning,
        stacklevel=4,
    )


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, rank0_only: bool = True) -> State:
    _warn_deprecated("full_optim_state_dict", "optim_state_dict")
    with _as(model, StateDictType.FULL_STATE_DICT, rank0_only):
        return optim_state_dict(model, optim)


def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> State:
    _warn_deprecated("sharded_optim_state_dict", "optim_state_dict")
    with _as(model, StateDictType.SHARDED_STATE_DICT):
        return optim_state_dict(model, optim)


def shard_full_optim_state_dict(full: State, model: nn.Module, optim: Optional[torch.optim.Optimizer],
                                optim_input: Any = None) -> State:
    """Every rank holds ``full`` and keeps its shard of it; no communication."""
    _warn_deprecated("shard_full_optim_state_dict", "optim_state_dict_to_load")
    return _full_to_load(full, model, optim, optim_input, rank0_only=False)


def flatten_sharded_optim_state_dict(sharded: State, model: nn.Module, optim: torch.optim.Optimizer) -> State:
    _warn_deprecated("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    with _as(model, StateDictType.SHARDED_STATE_DICT):
        return optim_state_dict_to_load(model, optim, sharded)


def scatter_full_optim_state_dict(full: Optional[State], model: nn.Module, optim: Optional[torch.optim.Optimizer],
                                  optim_input: Any = None) -> State:
    """Rank 0 holds ``full`` (the others pass None) and sends each rank its shard, unit by unit."""
    _warn_deprecated("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    return _full_to_load(full, model, optim, optim_input, rank0_only=True)


def _full_to_load(full: Optional[State], model: nn.Module, optim: Optional[torch.optim.Optimizer], optim_input: Any,
                  rank0_only: bool) -> State:
    """A FULL dict for ``optim``; without one, as torch's older loads, for an optimizer built on
    ``optim_input`` (its parameters or param groups, deprecated) or else on ``model.parameters()``,
    keeping the dict's own param groups."""
    if optim is not None:
        with _as(model, StateDictType.FULL_STATE_DICT, rank0_only):
            return optim_state_dict_to_load(model, optim, full)
    if optim_input is not None:
        warnings.warn(
            "fsdp1: The `optim_input` argument is deprecated, as in torch's FSDP1; pass optim= (the optimizer "
            "to load into) instead.",
            FutureWarning,
            stacklevel=4,
        )
    _check_every_rank_calls(model, "optim_state_dict_to_load()")
    order = list(model.parameters()) if optim_input is None else params_in(optim_input)
    return _to_load(model, order, None, full or {}, _Given.ON_RANK0 if rank0_only else _Given.FULL)


def rekey_optim_state_dict(optim_state_dict: State, by_name: bool, model: nn.Module,
                           optim: Optional[torch.optim.Optimizer] = None) -> State:
    """The same state keyed by clean parameter name (``by_name``) or by position, where positions
    count the names of ``optim``'s parameters (or ``model.parameters()``) in order, a flat parameter
    counting once per original parameter it holds: what a model without FSDP numbers them."""
    params = OptimizerParams(model, params_of(optim) if optim is not None else list(model.parameters()))
    names = [fqn for position in range(params.count) for fqn in params.fqns_at[position]]
    index = {name: i for i, name in enumerate(names)}

    def rekey(key: Any) -> Any:
        if by_name:
            return names[key] if isinstance(key, int) else key
        return index[key] if isinstance(key, str) else key

    def rekey_group(keys: List[Any]) -> List[Any]:  # optim.load_state_dict pairs a group's ids with its params in order
        rekeyed = [rekey(key) for key in keys]
        return rekeyed if by_name else sorted(rekeyed)

    return {
        "state": {rekey(key): value for key, value in optim_state_dict["state"].items()},
        "param_groups": [{**group, "params": rekey_group(group["params"])} for group in optim_state_dict["param_groups"]],
    }
