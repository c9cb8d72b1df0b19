"""What ``load_state_dict`` checks before it writes anything: the first unit a load reaches checks its
whole subtree's keys and shapes against the state dict (``check_subtree``), and the ranks agree on
the verdict (``agree_on``), so that a refused load leaves the model as it was on every rank.

``nn.Module.load_state_dict`` copies what matches and reports the rest at the end, and passes its
hooks ``strict=True`` whatever the caller asked; so the unit's own ``load_state_dict`` records
``strict``, and through a root that is not a unit (strictness unknown) only shapes are checked first.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._engine import collectives as comm
from .._engine.flat_parameter import FlatParameter
from .._engine.traversal import clean_fqn, is_fsdp_unit
from .._engine.unit_state import state_of
from .._engine.views import FLAT_PARAM, FLATTENED
from .._torch_internals import (
    NormBase,
    has_load_state_dict_pre_hooks,
    is_checkpoint_wrapper,
    is_persistent_buffer,
    loads_state_dict_its_own_way,
)
from ..api import StateDictType
from .settings import state_dicts_of


def check_subtree(unit: nn.Module, state_dict: Dict[str, Any], prefix: str, strict: bool) -> Optional[str]:
    """What is wrong with ``state_dict`` for ``unit``'s subtree (None if nothing): a value whose shape
    differs from the model's, and with ``strict`` a key the model has and the dict lacks or the
    reverse (through a root that is not a unit, strictness is not known here: ``nn.Module`` then
    reports those keys after loading the rest, as it does for a plain model). Keys a module may fill
    or consume in its own way (``_is_exempt``) are only checked for shape."""
    expected, exempt = _expected_entries(unit)
    given = {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
    clean_prefix = clean_fqn(prefix)
    for name, shape in expected.items():
        value = given.get(name)
        if value is None or shape is None or not torch.overrides.is_tensor_like(value):
            continue
        if tuple(value.shape) != tuple(shape):
            if _is_a_shard_of(unit, value):
                return (
                    f"missing key '{clean_prefix}{name}': in its place the state dict has this rank's own shard of "
                    "the parameter, which torch's set_model_state_dict / set_state_dict put there for a key a full "
                    "state dict lacks. Load a checkpoint that has every key of the model."
                )
            return (
                f"size mismatch for '{clean_prefix}{name}': the state dict has shape {tuple(value.shape)}, the "
                f"model {tuple(shape)}. Load a checkpoint of this model, or fix the model's configuration."
            )
    if not strict:
        return None
    missing = [name for name in expected if name not in given and not _is_exempt(name, exempt)]
    unexpected = [name for name in given if name not in expected and not _is_exempt(name, exempt)]
    parts = []
    if missing:
        parts.append(f"missing key(s) {_names(clean_prefix, missing)}")
    if unexpected:
        parts.append(f"unexpected key(s) {_names(clean_prefix, unexpected)}")
    if parts:
        return " and ".join(parts) + ". Pass strict=False to load the keys that match and get the rest listed."
    return None


def _is_exempt(name: str, exempt: List[str]) -> bool:
    """``exempt`` holds key names, and module prefixes (ending in a dot) for every key below them."""
    return any(name == entry or (entry.endswith(".") or entry == "") and name.startswith(entry) for entry in exempt)


def _names(prefix: str, names: Sequence[str], shown: int = 5) -> str:
    listed = ", ".join(f"'{prefix}{name}'" for name in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _is_a_shard_of(unit: nn.Module, value: torch.Tensor) -> bool:
    """Whether ``value`` lies in the sharded flat parameter of a unit of ``unit``'s subtree."""
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return False
    storage = value.untyped_storage().data_ptr()
    handles = [state_of(module).handle for module in unit.modules() if is_fsdp_unit(module)]
    return any(handle is not None and handle.flat_param.untyped_storage().data_ptr() == storage for handle in handles)


def _expected_entries(unit: nn.Module) -> Tuple[Dict[str, Optional[torch.Size]], List[str]]:
    """The clean keys (relative to ``unit``) a state dict of its subtree has, with their shapes (None
    where unknown), and what ``_is_exempt`` spares: the keys a norm layer fills or drops itself
    (``num_batches_tracked`` of old checkpoints, running statistics it does not track), and everything below any other module
    that loads in its own way (a custom ``_load_from_state_dict`` or load hook may rename keys)."""
    expected: Dict[str, Optional[torch.Size]] = {}
    exempt: List[str] = []
    for raw_name, module in unit.named_modules(remove_duplicate=False):
        path = clean_fqn(raw_name)
        dot = f"{path}." if path else ""
        if is_fsdp_unit(module):
            _add_unit_entries(module, dot, expected)
            continue
        if isinstance(module, NormBase) and not has_load_state_dict_pre_hooks(module):
            untracked = [dot + name for name in ("running_mean", "running_var") if module._buffers.get(name) is None]
            exempt += [dot + "num_batches_tracked", *untracked]
        elif _loads_in_own_way(module):
            exempt.append(dot)
        for attr, param in module._parameters.items():
            if param is not None and not isinstance(param, FlatParameter) and not getattr(param, FLATTENED, False):
                expected[dot + attr] = param.shape
        for attr, buffer in module._buffers.items():
            if buffer is not None and is_persistent_buffer(module, attr):
                expected[dot + attr] = buffer.shape
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            expected[dot + "_extra_state"] = None
    return expected, exempt


def _add_unit_entries(unit: nn.Module, dot: str, expected: Dict[str, Optional[torch.Size]]) -> None:
    handle = state_of(unit).handle
    if handle is None:
        return
    if state_dicts_of(unit).effective_type is StateDictType.LOCAL_STATE_DICT:
        expected[dot + FLAT_PARAM] = torch.Size([handle.layout.unpadded_numel])
        return
    for fqn, index in handle.views.slot_fqns():
        expected[dot + clean_fqn(fqn)] = handle.layout.shapes[index]


def _loads_in_own_way(module: nn.Module) -> bool:
    if is_checkpoint_wrapper(module):  # only renames keys, which the checks already undo
        return False
    return loads_state_dict_its_own_way(module)


def agree_on(unit: nn.Module, prefix: str, problem: Optional[str]) -> None:
    """Raise on every rank of the unit's group if the check failed on any, naming the ranks, so that
    no rank goes on into a collective the others never reach."""
    problems = comm.all_gather_object(problem, state_of(unit).process_group) if state_of(unit).world_size > 1 else [problem]
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if not failed:
        return
    ranks = ", ".join(str(rank) for rank, _ in failed)
    where = (
        "the model is unchanged"
        if not prefix
        else f"nothing below '{clean_fqn(prefix)[:-1]}' was loaded, but its parent, which is not an FSDP unit, may "
        "have loaded its own entries before (wrap the root in FullyShardedDataParallel to have the whole dict checked first)"
    )
    raise RuntimeError(f"fsdp1: load_state_dict() refused on rank(s) {ranks}; {where}: {failed[0][1]}")
