"""What ``fully_shard`` accepts: its arguments checked and converted in torch's order, with torch's
exception types and phrases (each followed by fsdp1's fix), and torch's own policy objects taken
field by field."""

import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.distributed.tensor import Shard

from .._engine import collectives as comm
from .._engine.traversal import FSDP_STATE, ParamSlot
from ..api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from .module import FSDPModule


def checked_modules(module: Union[nn.Module, List[nn.Module]]) -> List[nn.Module]:
    """The group's modules: ``module``, or the list's, each once and each shardable."""
    modules = list(module) if isinstance(module, list) else [module]
    if not modules:
        raise ValueError("fsdp1: fully_shard got an empty list of modules; pass the modules to shard as one group.")
    if len({id(each) for each in modules}) < len(modules):
        raise AssertionError(  # torch's type and phrase
            "Each distinct composable distributed API can only be applied to a module once. fsdp1: fully_shard got "
            "the same module twice in its list; list each module of the group once."
        )
    for each in modules:
        check_module(each)
    return modules


def checked_mesh(mesh: Any, dp_mesh_dims: Optional[DataParallelMeshDims]) -> Tuple[comm.DeviceMesh, Optional[DataParallelMeshDims]]:
    """The mesh (the default group's when None) and ``dp_mesh_dims`` as fsdp1's own type, checked."""
    if mesh is not None and not isinstance(mesh, comm.DeviceMesh):
        raise ValueError(
            f"fsdp1: fully_shard(mesh=...) takes a DeviceMesh, got {type(mesh).__name__}. Build one with "
            "torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,)), or leave mesh out for "
            "the default group."
        )
    mesh = default_mesh() if mesh is None else mesh
    if dp_mesh_dims is not None and type(dp_mesh_dims) is not DataParallelMeshDims:  # torch's own
        dp_mesh_dims = DataParallelMeshDims(dp_mesh_dims.shard, dp_mesh_dims.replicate)
    check_mesh(mesh, dp_mesh_dims)
    return mesh, dp_mesh_dims


def check_mesh(mesh: comm.DeviceMesh, dp_mesh_dims: Optional[DataParallelMeshDims]) -> None:
    """torch's checks of ``mesh`` and ``dp_mesh_dims``, with its types and messages."""
    if dp_mesh_dims is not None:
        if mesh.mesh_dim_names is None:
            raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")  # torch's
        for name in (*dp_mesh_dims.shard_names, *dp_mesh_dims.replicate_names):
            if name not in mesh.mesh_dim_names:
                raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}")  # torch's
        return
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")  # torch's
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError(  # torch's type and phrase
            "Please init the 2D mesh for HSDP with mesh_dim_names specified. fsdp1: e.g. "
            "init_device_mesh(device_type, (replicas, shard), mesh_dim_names=(\"replicate\", \"shard\"))."
        )


def check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise ValueError(f"fsdp1: fully_shard takes an nn.Module or a list of them, got {type(module).__name__}.")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(  # torch's type and phrase
            f"fully_shard does not support containers that do not implement forward: {module}. "
            f"fsdp1: shard each module inside the {type(module).__name__} instead."
        )
    if isinstance(module, FSDPModule):
        raise AssertionError(  # torch's type and phrase
            "Each distinct composable distributed API can only be applied to a module once. fsdp1: cannot "
            f"fully_shard a {type(module).__name__}: fully_shard was already applied to it. Shard each module once."
        )
    if FSDP_STATE in module.__dict__:
        raise ValueError(f"fsdp1: cannot fully_shard a {type(module).__name__}: it is a FullyShardedDataParallel unit.")
    for name, inner in module.named_modules():
        if getattr(type(inner), "_is_fsdp_unit", False):
            raise ValueError(
                f"fsdp1: cannot fully_shard a module that contains the FullyShardedDataParallel unit '{name}': a "
                "model uses FullyShardedDataParallel or fully_shard, not both. Build the model again and use one."
            )


def default_mesh() -> comm.DeviceMesh:
    """A 1-D mesh over the default group (no new group), on the accelerator if there is one."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return comm.device_mesh_of(comm.default_group(), device_type)


def reshard_after_forward_flag(value: Optional[Union[bool, int]], shard_size: int) -> Tuple[Optional[bool], int]:
    """The schedule's flag, and the group size the rows are kept over after forward (0: none). An
    int ``k`` is False for 1, True for the shard size, and rows kept over ``k`` ranks otherwise."""
    if value is None or isinstance(value, bool):
        return value, 0
    if not isinstance(value, int):
        raise ValueError(  # torch's phrase
            f"reshard_after_forward should be a bool or an int representing the group size to reshard to, not {value}"
        )
    if value == 1:
        warnings.warn("reshard_after_forward=1 is the same as False: the parameters stay gathered after forward.", stacklevel=3)
        return False, 0
    if value == shard_size:
        return True, 0
    if value < 1 or shard_size % value != 0:
        raise ValueError(  # torch's phrase
            f"If passing reshard_after_forward as an int, it should be a factor of {shard_size}, not {value}. fsdp1: "
            f"reshard_after_forward={value} must be a positive divisor of the shard world size {shard_size}: pass "
            "True, False or a divisor of the number of ranks each parameter is sharded over."
        )
    return True, value


def as_mixed_precision_policy(policy: Any) -> MixedPrecisionPolicy:
    """fsdp1's policy, or torch's converted field by field."""
    if type(policy) is MixedPrecisionPolicy:
        return policy
    if type(policy).__name__ != "MixedPrecisionPolicy":
        raise ValueError(f"fsdp1: mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__}.")
    return MixedPrecisionPolicy(policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs,
                                param_dtype_override_fn=getattr(policy, "param_dtype_override_fn", None))


def group_param_dtype(policy: MixedPrecisionPolicy, slots: List[ParamSlot]) -> Optional[torch.dtype]:
    """The dtype the group gathers and computes in: ``param_dtype``, or what ``param_dtype_override_fn``
    gives each parameter, checked in torch's order with its messages. One group is one flat buffer of
    one dtype, so its parameters must agree (torch's gathers a group in several dtypes)."""
    override = policy.param_dtype_override_fn
    if override is None or not slots:
        return policy.param_dtype
    chosen: Dict[torch.dtype, str] = {}
    for slot in slots:
        param = slot.live_param
        dtype = override(param)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"param_dtype_override_fn must return a torch.dtype or None but got {type(dtype)}")  # torch's
        if dtype is not None and dtype not in (policy.param_dtype, param.dtype):
            raise ValueError(  # torch's phrase
                "param_dtype_override_fn must return None, param_dtype, or the parameter's original dtype but got "
                f"{dtype} for a parameter with dtype {param.dtype} and param_dtype {policy.param_dtype}. fsdp1: "
                f"it returned that for '{slot.fqn}'."
            )
        chosen.setdefault(dtype or policy.param_dtype or param.dtype, slot.fqn)
    if len(chosen) > 1:
        listed = ", ".join(f"'{fqn}' in {dtype}" for dtype, fqn in chosen.items())
        raise NotImplementedError(
            f"fsdp1: param_dtype_override_fn gives one fully_shard group several compute dtypes ({listed}); a group "
            "gathers into one flat buffer of one dtype. Call fully_shard on the modules whose parameters keep their "
            "own dtype first, as groups of their own."
        )
    return next(iter(chosen))


def as_offload_policy(policy: Any) -> OffloadPolicy:
    if isinstance(policy, OffloadPolicy):
        return policy
    name = type(policy).__name__
    if name == "CPUOffloadPolicy":
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if name == "OffloadPolicy":
        return OffloadPolicy()
    raise ValueError(f"fsdp1: offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got {name}.")


def check_one_dtype(slots: List[ParamSlot]) -> None:
    """A group's parameters live in one flat shard of one dtype. torch's refuses trainable parameters of
    several dtypes too (at its first forward); frozen ones of another dtype it keeps apart, which
    fsdp1 does not do yet, so they are refused instead of being cast silently."""
    dtypes = {slot.live_param.dtype for slot in slots}
    if len(dtypes) < 2:
        return
    trainable = {slot.live_param.dtype for slot in slots if slot.live_param.requires_grad}
    listed = ", ".join(f"'{slot.fqn}' {slot.live_param.dtype}" for slot in slots if slot.live_param.dtype != slots[0].live_param.dtype)
    fix = (f"fsdp1: one group's parameters share one dtype ({slots[0].fqn} is {slots[0].live_param.dtype}; also {listed}). "
           "fully_shard the modules holding the others as groups of their own, pass them as ignored_params, or "
           "convert them to one dtype first.")
    if len(trainable) > 1:
        raise AssertionError(f"FSDP expects uniform original parameter dtype but got {trainable}. {fix}")  # torch's phrase
    raise NotImplementedError(f"fsdp1: frozen parameters of another dtype than the rest of their group are not supported yet. {fix}")


def placement_dim(param: torch.Tensor, placement: Optional[Shard], shard_size: int, fqn: str) -> int:
    """The dim ``shard_placement_fn`` gave ``param`` (None: 0; ``param`` is the tensor sharded, a
    DTensor's local one), checked in torch's order with its messages."""
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(f"Invalid shard_placement_fn result: {placement}")  # torch's
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.dim():
        raise AssertionError(  # torch's phrase
            f"Shard dim {dim} is invalid for {param.dim()}D tensor: {param.shape}. fsdp1: shard_placement_fn gave "
            f"{placement} for '{fqn}'; give a dim in [-{param.dim()}, {param.dim()})."
        )
    if dim > 0 and param.shape[dim] % shard_size != 0:
        raise NotImplementedError(  # torch's phrase
            f"FSDP does not support uneven sharding on dim {dim}: {param.shape} (world size: {shard_size}). fsdp1: "
            f"'{fqn}' (its local tensor, for a DTensor) does not split evenly over the {shard_size} shard ranks along "
            f"dim {dim}; give it Shard(0), or a dim whose size {shard_size} divides."
        )
    return dim
