"""``fully_shard``: torch's FSDP2 API on fsdp1's engine.

``fully_shard(module)`` makes ``module`` a unit in place: its parameters (minus those of modules
sharded before it, and ``ignored_params``) go into one ``FlatParamHandle`` whose layout splits every
parameter along its shard dim (``ChunkShardLayout``) and whose views are DTensors over the mesh, as
each parameter's ``ParamSharding`` places them (``DTensorParamViews``); the module holds its own
``UnitState``, so the runtime is the one ``FullyShardedDataParallel`` units run on; and its class
becomes ``FSDP<Class>``, a subclass of both ``FSDPModule`` and the original class, which carries
FSDP2's methods. Modules are sharded bottom-up:
blocks first, then the root, whose first forward makes it the root of every unit below it.

One handle per group, as FSDP1's units, not one per parameter as torch's ``FSDPParam``: that would
repeat the lifecycle, precision, offload and reduction per parameter and still need a group object
for the one collective. What differs from FSDP1 is data: the layout, the views and the schedule.
Every unit reshards after a forward without grad, as FSDP1 units do: keeping torch's registration
after an evaluation forward let an optimizer built on ``parameters()`` train the root silently wrong.
"""

from typing import Any, Callable, Dict, List, Optional, Set, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._engine import collectives as comm
from .._engine.collectives import ProcessGroups
from .._engine.dtensors import MeshPlacements, is_wrapper_subclass
from .._engine.flat_grad import ReduceSettings
from .._engine.handle import FlatParamHandle
from .._engine.mixed_precision import HandlePrecision
from .._engine.schedule import UnitSchedule
from .._engine.traversal import ParamSlot, is_fsdp_unit, iter_outermost_units, iter_param_slots
from .._engine.unit_state import UnitState, state_of
from .._engine.views import FLATTENED
from .._state_dict.fully_shard_hooks import register_fully_shard_hooks
from .._torch_internals import composable_apis_of, local_tensor, register_composable_api
from .._torch_version import FULLY_SHARD_FOLLOWS_GRAD_DTYPE
from ..api import (
    BlockQuantization,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    check_comm_quantization,
)
from .arguments import (
    as_mixed_precision_policy,
    as_offload_policy,
    check_one_dtype,
    checked_mesh,
    checked_modules,
    group_param_dtype,
    placement_dim,
    reshard_after_forward_flag,
)
from .chunk_shard_layout import ChunkShardLayout
from .dtensor_views import DTensorParamViews
from .extensions import GatherContext, has_extension
from .module import FSDPModule, _fsdp_class
from .param_sharding import DataParallelMesh, ParamSharding
from .pipeline import StageReduction
from .post_forward import PostForwardRows


def fully_shard(
    module: Union[nn.Module, List[nn.Module]],
    *,
    mesh: Optional[comm.DeviceMesh] = None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[Set[nn.Parameter]] = None,
    dp_mesh_dims: Optional[DataParallelMeshDims] = None,
    comm_quantization: Optional[BlockQuantization] = None,
) -> Any:
    """Shard ``module``'s parameters (those not in a module sharded before) as one group over
    ``mesh``, in place, and return it: torch's ``fully_shard`` on fsdp1's engine.

    Every parameter becomes a DTensor ``nn.Parameter`` (``Shard(0)``, or the dim
    ``shard_placement_fn`` gives; after ``Replicate()`` on a 2-D mesh, which shards over its second
    dimension and all-reduces over its first), gathered around the module's forward and backward, its
    gradient reduced to this rank's part. A parameter that is a DTensor already (tensor parallelism;
    on the whole mesh with ``dp_mesh_dims``) is sharded by its local tensor and keeps its placements
    after the data-parallel ones, as torch's.

    ``comm_quantization`` is fsdp1's own, not torch's: a ``BlockQuantization`` makes the gathers
    forward and backward compute on, and the gradient's reduction, send block-quantized values.
    """
    modules = checked_modules(module)
    check_comm_quantization(comm_quantization, "fully_shard")
    mesh, dp_mesh_dims = checked_mesh(mesh, dp_mesh_dims)
    dp_mesh = DataParallelMesh(mesh, dp_mesh_dims)
    after_forward, rows_group_size = reshard_after_forward_flag(reshard_after_forward, comm.group_size(dp_mesh.groups[0]))
    policy, offload = as_mixed_precision_policy(mp_policy), as_offload_policy(offload_policy)
    ignored = {id(p) for p in ignored_params or ()}
    device = _mesh_device(mesh)
    for each in modules:
        _move_to_mesh_device(each, ignored, device)
    slots: List[ParamSlot] = []
    shardings: Dict[int, ParamSharding] = {}
    for each in modules:
        slots += _managed_slots(each, ignored, shard_placement_fn, dp_mesh, shardings)
    _check_resharding_to_fewer_ranks(reshard_after_forward, rows_group_size, dp_mesh_dims, slots, shardings)
    check_one_dtype(slots)
    handle = _group_handle(modules[0], slots, shardings, dp_mesh, policy, offload, rows_group_size,
                           comm_quantization) if slots else None
    compute_device = handle.compute_device if handle is not None else torch.device(dp_mesh.mesh.device_type)
    replicated = [m for each in modules for m in each.modules() if _is_replicated(m)]
    UnitState(modules[0], modules[0], handle, dp_mesh.groups[0], UnitSchedule(after_forward), _as_fsdp1_precision(policy),
              compute_device, replicated, also_hooked=modules[1:], output_dtype=policy.output_dtype)
    for each in modules:
        _become_a_unit(each, handle)
    return modules if isinstance(module, list) else module


def _check_resharding_to_fewer_ranks(value: Optional[Union[bool, int]], rows_group_size: int,
                                     dp_mesh_dims: Optional[DataParallelMeshDims], slots: List[ParamSlot],
                                     shardings: Dict[int, ParamSharding]) -> None:
    """What an int ``reshard_after_forward`` (rows kept over fewer ranks after forward) cannot do."""
    if dp_mesh_dims is not None and type(value) is int:
        raise NotImplementedError(  # torch's phrase
            "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims). fsdp1: pass True or "
            "False with dp_mesh_dims."
        )
    if not rows_group_size:
        return
    extended = [slot.fqn for slot in slots if has_extension(shardings[id(slot.live_param)].local_of_computing(slot.live_param))]
    if extended:
        raise NotImplementedError(  # torch's type; it raises in the first backward
            f"fsdp1: reshard_after_forward={value} keeps rows over a smaller group, which '{extended[0]}', "
            "gathered by its all-gather extension, cannot do (torch's fully_shard fails in backward); pass True or False."
        )
    if any(sharding.computing is not None for sharding in shardings.values()):
        raise NotImplementedError(  # torch's phrase, raised at its first forward
            "Resharding to smaller mesh is not supported for DTensor parameters yet. fsdp1: "
            f"reshard_after_forward={value} keeps rows over a smaller group, which fully_shard does "
            "not do for parameters that are DTensors (tensor parallelism); pass True or False."
        )


def _group_handle(module: nn.Module, slots: List[ParamSlot], shardings: Dict[int, ParamSharding], dp_mesh: DataParallelMesh,
                  policy: MixedPrecisionPolicy, offload: OffloadPolicy, rows_group_size: int,
                  quantization: Optional[BlockQuantization]) -> FlatParamHandle:
    """The handle of the group's parameters: DTensor views over the chunk layout, reduced as torch's FSDP2 reduces."""
    shard_group, replicate_group = dp_mesh.groups
    param_dtype = group_param_dtype(policy, slots)
    precision = HandlePrecision(slots[0].live_param.dtype, param_dtype, policy.reduce_dtype, accumulates_in_reduce_dtype=True,
                                follows_grad_dtype=FULLY_SHARD_FOLLOWS_GRAD_DTYPE)
    context = GatherContext(dp_mesh.shard_mesh, policy, param_dtype)
    views = DTensorParamViews(slots, module, shardings, context)
    layout = ChunkShardLayout(views.shapes, comm.group_rank(shard_group), comm.group_size(shard_group),
                            shard_dims=[sharding.shard_dim for sharding in views.shardings])
    # torch's FSDP2 averages with ReduceOp.AVG (sum, then divide) outside fp16: one division of the
    # reduced shard instead of one of the whole gradient before the reduction
    ranks = comm.group_size(shard_group) * (comm.group_size(replicate_group) if replicate_group else 1)
    settings = ReduceSettings(divide_factor=ranks if precision.reduce_dtype != torch.float16 else None)
    rows = _rows_after_forward(layout, dp_mesh.mesh, rows_group_size) if rows_group_size else None
    handle = FlatParamHandle(views, layout, ProcessGroups(shard_group, replicate_group), precision,
                             offload_params=isinstance(offload, CPUOffloadPolicy), reduce_settings=settings,
                             rows_after_forward=rows, quantization=quantization)
    views.grad_dtype_of_resting = lambda: handle.precision.unsharded_grad_dtype
    return handle


def _as_fsdp1_precision(policy: MixedPrecisionPolicy) -> Optional[MixedPrecision]:
    """The unit state's FSDP1 terms for ``policy`` (None when it casts nothing): the forward inputs
    cast at every unit, the root's included."""
    if policy.param_dtype is None and policy.reduce_dtype is None:
        return None
    return MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                          cast_forward_inputs=policy.cast_forward_inputs,
                          cast_root_forward_inputs=policy.cast_forward_inputs)


def _become_a_unit(module: nn.Module, handle: Optional[FlatParamHandle]) -> None:
    """``module`` nests the units below it, serves the state dicts through ``handle``'s views, and
    turns into an ``FSDP<Class>`` registered as torch's ``fully_shard``."""
    for path, inner in iter_outermost_units(module):
        inner_state = state_of(inner)
        inner_state.nest(path)
        if inner_state.also_hooked and inner_state.handle is not None:  # a group: each module its own path
            assert isinstance(inner_state.handle.views, DTensorParamViews), "fully_shard's handle"
            inner_state.handle.views.name_member(inner, path)
    if handle is not None:
        assert isinstance(handle.views, DTensorParamViews), "fully_shard's handle"
        register_fully_shard_hooks(module, handle, handle.views)
    module.__class__ = _fsdp_class(type(module))
    _register_as_fully_shard(module)


fully_shard.state = StageReduction  # type: ignore[attr-defined]  # torch's fully_shard.state(module), which its pipeline stages call


def _rows_after_forward(layout: ChunkShardLayout, mesh: comm.DeviceMesh, group_size: int) -> PostForwardRows:
    """After forward, keep each rank's rows over consecutive runs of ``group_size`` ranks, shown as
    torch's are: ``(Replicate(), Shard(0))`` on a ``(world / group_size, group_size)`` mesh."""
    regrouped = comm.regrouped_mesh(mesh, group_size)
    return PostForwardRows(layout, comm.mesh_groups(regrouped)[1], MeshPlacements(regrouped, (Replicate(), Shard(0))))


def _mesh_device(mesh: comm.DeviceMesh) -> torch.device:
    """The device a mesh's ranks compute on: the current one of its accelerator."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def _move_to_mesh_device(module: nn.Module, ignored_ids: Set[int], device: torch.device) -> None:
    """The parameters and buffers this group manages (not those of modules sharded before, not the
    ignored ones) moved to the mesh's device in place, as torch's ``fully_shard`` moves them: a model
    built on the CPU trains on the GPU of a CUDA mesh. Meta tensors stay for deferred initialisation;
    DTensors (tensor parallelism) are where their own mesh put them."""
    params = [slot.live_param for slot in iter_param_slots(module, stop=_managed_elsewhere) if id(slot.live_param) not in ignored_ids]
    buffers = [buffer for owner in _modules_until(module, _managed_elsewhere) for buffer in owner._buffers.values() if buffer is not None]
    with torch.no_grad():
        for tensor in {id(t): t for t in params + buffers}.values():
            if tensor.device == device or tensor.device.type == "meta" or isinstance(tensor, DTensor):
                continue
            if is_wrapper_subclass(tensor):  # its inner tensors move with it: swap the whole object
                moved = tensor.to(device)
                torch.utils.swap_tensors(tensor, nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved)
            else:
                tensor.data = tensor.to(device)


def _modules_until(module: nn.Module, stop: Callable[[nn.Module], bool]) -> List[nn.Module]:
    """``module`` and the modules below it, not descending into those for which ``stop`` holds."""
    found = [module]
    for child in module.children():
        if not stop(child):
            found += _modules_until(child, stop)
    return found


def _managed_slots(module: nn.Module, ignored_ids: Set[int], placement_fn: Optional[Callable[[nn.Parameter], Any]],
                   dp_mesh: DataParallelMesh, shardings: Dict[int, ParamSharding]) -> List[ParamSlot]:
    """The registrations of the parameters this group shards: ``module``'s, minus those of modules
    sharded before it and the ignored ones; each parameter's ``ParamSharding`` goes into
    ``shardings``. Refused: a scalar, a parameter tied to one another group manages (which would
    split one weight over two groups), and what torch's refuses of placements and meshes."""
    sharded_elsewhere = _sharded_elsewhere(module)
    shard_size = comm.group_size(dp_mesh.groups[0])
    slots = []
    for slot in iter_param_slots(module, stop=_managed_elsewhere):
        param = slot.live_param
        if id(param) in ignored_ids:
            continue
        elsewhere = sharded_elsewhere(param)
        if elsewhere is not None or getattr(param, FLATTENED, False):
            where = f" ('{elsewhere}')" if elsewhere is not None else ""
            raise ValueError(  # torch's type and phrase, raised at its first forward
                f"Parameter '{slot.fqn}' is shared with a parameter already managed by another FSDP group{where}. "
                "For shared/tied parameters, use fully_shard([module_a, module_b]) to place them in the same FSDP "
                "group. fsdp1: one weight cannot be split over two groups; shard the modules that share it as one "
                "group, or a module holding them both, or untie the weight."
            )
        if param.dim() == 0:
            raise ValueError(f"fully_shard doesn't support scalar parameters. Change {slot.fqn} to a 1D tensor with numel equal to 1.")
        local = local_tensor(param) if isinstance(param, DTensor) else param
        if isinstance(param, DTensor) and any(placement.is_partial() for placement in param.placements):
            raise RuntimeError(  # torch's type; it raises at the first forward ("Can not redistribute from R to P")
                f"fsdp1: parameter '{slot.fqn}' is a DTensor with a partial placement {tuple(param.placements)}: its "
                "values are not whole on any rank, so FSDP cannot shard and gather them (torch's fully_shard fails at "
                "the first forward). Redistribute it to Replicate() (param.redistribute(placements=...)) first."
            )
        if has_extension(local) and dp_mesh.shard_mesh is None:
            raise NotImplementedError(
                f"fsdp1: parameter '{slot.fqn}' is a {type(local).__name__} that defines an all-gather extension, "
                "which fully_shard gathers over the shard dim of the mesh; dp_mesh_dims with replicate dims alone has "
                "none. Name a shard dim in dp_mesh_dims."
            )
        if not local.is_contiguous():
            raise NotImplementedError(  # torch's type and phrase
                f"FSDP does not support non-contiguous parameters yet: {param.shape=} {param.stride()=}. fsdp1: "
                f"make '{slot.fqn}' contiguous before fully_shard (e.g. a channels_last convolution's weight: "
                "convert the module to channels_last after sharding, or not at all)."
            )
        dim = placement_dim(local, placement_fn(param) if placement_fn is not None else None, shard_size, slot.fqn)
        if id(param) not in shardings:
            shardings[id(param)] = dp_mesh.sharding_of(param, dim, slot.fqn)
        slots.append(slot)
    return slots


def _managed_elsewhere(module: nn.Module) -> bool:
    """Whether a module below the group is another's: a unit sharded before, or torch's ``replicate``'s."""
    return is_fsdp_unit(module) or _is_replicated(module)


def _is_replicated(module: nn.Module) -> bool:
    """Whether torch's composable ``replicate`` (DDP) manages ``module``: its parameters stay out of
    the group, as torch's ``fully_shard`` leaves them."""
    return "replicate" in composable_apis_of(module)


def _register_as_fully_shard(module: nn.Module) -> None:
    """Enter ``module`` in torch's registry of composable APIs under ``fully_shard``, as torch's does,
    so that torch's ``replicate`` leaves it (and its parameters) out, and torch's own ``fully_shard``
    refuses it as applied twice."""
    register_composable_api(module, "fully_shard")


def _sharded_elsewhere(module: nn.Module) -> Callable[[nn.Parameter], Optional[str]]:
    """For a parameter of ``module``'s tree, the path under which a module sharded before (inside
    ``module``) registered it, if one did: a tied registration outside that module still holds the
    original Parameter the DTensors replaced."""
    names = {id(m): name for name, m in module.named_modules()}
    replacing = []
    for inner in module.modules():
        handle = state_of(inner).handle if inner is not module and isinstance(inner, FSDPModule) else None
        if handle is not None and isinstance(handle.views, DTensorParamViews):
            replacing.append(handle.views)

    def path_of(param: nn.Parameter) -> Optional[str]:
        for views in replacing:
            found = views.replaced_registration(param)
            if found is not None:
                path = names.get(id(found[0]), "?")
                return f"{path}.{found[1]}" if path else found[1]
        return None

    return path_of
