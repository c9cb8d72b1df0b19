"""``fully_shard``: torch's FSDP2 API on fsdp1's engine.

``fully_shard(module)`` makes ``module`` a unit in place: its parameters (minus those of modules
sharded before it, and ``ignored_params``) go into one ``FlatParamHandle`` whose layout splits every
parameter along its shard dim (``RowShardLayout``) and whose views are DTensors over the mesh, as
each parameter's ``ParamSharding`` places them (``DTensorParamViews``); the module holds its own
``UnitState``, so the runtime is the one ``FullyShardedDataParallel`` units run on; and its class
becomes ``FSDP<Class>``, a subclass of both ``FSDPModule`` and the original class, which carries
FSDP2's methods. Modules are sharded bottom-up:
blocks first, then the root, whose first forward makes it the root of every unit below it.
"""

import sys
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem, _get_registry
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._engine import collectives as comm
from .._engine.collectives import ProcessGroups
from .._engine.dtensors import RowSharding, is_wrapper_subclass
from .._engine.flat_grad import ReduceSettings
from .._engine.flat_param import FlatParamHandle
from .._engine.mixed_precision import HandlePrecision
from .._engine.schedule import UnitSchedule
from .._engine.traversal import FSDP_STATE, ParamSlot, is_fsdp_unit, iter_outermost_units, iter_param_slots
from .._engine.unit_state import UnitState, state_of
from .._engine.views import FLATTENED
from .._state_dict.fully_shard_hooks import register_fully_shard_hooks
from ..api import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from .dtensor_views import DTensorParamViews
from .extensions import GatherContext, has_extension
from .module import FSDPModule, _fsdp_class
from .param_sharding import DataParallelMesh, ParamSharding
from .pipeline import StageReduction
from .post_forward import PostForwardRows
from .row_shard_layout import RowShardLayout


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
) -> Any:
    """Shard ``module``'s parameters (those not in a module sharded before) as one group over
    ``mesh``, in place, and return it: torch's ``fully_shard`` on fsdp1's engine.

    Every parameter becomes a DTensor ``nn.Parameter`` (``Shard(0)``, or the dim
    ``shard_placement_fn`` gives; after ``Replicate()`` on a 2-D mesh, which shards over its second
    dimension and all-reduces over its first), gathered around the module's forward and backward, its
    gradient reduced to this rank's part. A parameter that is a DTensor already (tensor parallelism;
    on the whole mesh with ``dp_mesh_dims``) is sharded by its local tensor and keeps its placements
    after the data-parallel ones, as torch's.
    """
    modules = list(module) if isinstance(module, list) else [module]
    if not modules:
        raise ValueError("fsdp1: fully_shard got an empty list of modules; pass the modules to shard as one group.")
    if len({id(each) for each in modules}) < len(modules):
        raise AssertionError(  # torch's type and phrase
            "Each distinct composable distributed API can only be applied to a module once. fsdp1: fully_shard got "
            "the same module twice in its list; list each module of the group once."
        )
    for each in modules:
        _check_module(each)
    if mesh is not None and not isinstance(mesh, comm.DeviceMesh):
        raise ValueError(
            f"fsdp1: fully_shard(mesh=...) takes a DeviceMesh, got {type(mesh).__name__}. Build one with "
            "torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,)), or leave mesh out for "
            "the default group."
        )
    mesh = _default_mesh() if mesh is None else mesh
    if dp_mesh_dims is not None and type(dp_mesh_dims) is not DataParallelMeshDims:  # torch's own
        dp_mesh_dims = DataParallelMeshDims(dp_mesh_dims.shard, dp_mesh_dims.replicate)
    _check_mesh(mesh, dp_mesh_dims)
    dp_mesh = DataParallelMesh(mesh, dp_mesh_dims)
    shard_group, replicate_group = dp_mesh.groups
    after_forward, rows_group_size = _reshard_after_forward(reshard_after_forward, comm.group_size(shard_group))
    policy = _mixed_precision_policy(mp_policy)
    offload = _offload_policy(offload_policy)
    ignored = {id(p) for p in ignored_params or ()}
    slots: List[ParamSlot] = []
    shardings: Dict[int, ParamSharding] = {}
    for each in modules:
        _move_to_mesh_device(each, ignored, _mesh_device(mesh))
    for each in modules:
        slots += _managed_slots(each, ignored, shard_placement_fn, dp_mesh, shardings)
    if dp_mesh_dims is not None and type(reshard_after_forward) is int:
        raise NotImplementedError(  # torch's phrase
            "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims). fsdp1: pass True or "
            "False with dp_mesh_dims."
        )
    extended = [slot.fqn for slot in slots if has_extension(shardings[id(slot.live_param)].local_of_computing(slot.live_param))]
    if rows_group_size and extended:
        raise NotImplementedError(  # torch's type; it raises in the first backward
            f"fsdp1: reshard_after_forward={reshard_after_forward} keeps rows over a smaller group, which '{extended[0]}', "
            "gathered by its all-gather extension, cannot do (torch's fully_shard fails in backward); pass True or False."
        )
    if rows_group_size and any(sharding.computing is not None for sharding in shardings.values()):
        raise NotImplementedError(  # torch's phrase, raised at its first forward
            "Resharding to smaller mesh is not supported for DTensor parameters yet. fsdp1: "
            f"reshard_after_forward={reshard_after_forward} keeps rows over a smaller group, which fully_shard does "
            "not do for parameters that are DTensors (tensor parallelism); pass True or False."
        )
    _check_one_dtype(slots)
    handle = None
    if slots:
        precision = HandlePrecision(slots[0].live_param.dtype, policy.param_dtype, policy.reduce_dtype,
                                    accumulates_in_reduce_dtype=True)
        context = GatherContext(dp_mesh.shard_mesh, policy, policy.param_dtype)
        views = DTensorParamViews(slots, modules[0], shardings, context)
        layout = RowShardLayout(views.shapes, comm.group_rank(shard_group), comm.group_size(shard_group),
                                shard_dims=[sharding.shard_dim for sharding in views.shardings])
        # torch's FSDP2 averages with ReduceOp.AVG (sum, then divide) outside fp16: one division of the
        # reduced shard instead of one of the whole gradient before the reduction
        ranks = comm.group_size(shard_group) * (comm.group_size(replicate_group) if replicate_group else 1)
        settings = ReduceSettings(divide_factor=ranks if precision.reduce_dtype != torch.float16 else None)
        rows = _rows_after_forward(layout, dp_mesh.mesh, rows_group_size) if rows_group_size else None
        handle = FlatParamHandle(views, layout, ProcessGroups(shard_group, replicate_group), precision,
                                 offload_params=isinstance(offload, CPUOffloadPolicy), reduce_settings=settings,
                                 rows_after_forward=rows)
    compute_device = handle.compute_device if handle is not None else torch.device(dp_mesh.mesh.device_type)
    mixed_precision = None
    if policy.param_dtype is not None or policy.reduce_dtype is not None:
        mixed_precision = MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                         cast_forward_inputs=policy.cast_forward_inputs,
                                         cast_root_forward_inputs=policy.cast_forward_inputs)
    replicated = [m for each in modules for m in each.modules() if _is_replicated(m)]
    UnitState(modules[0], modules[0], handle, shard_group, UnitSchedule(after_forward), mixed_precision,
              compute_device, replicated, also_hooked=modules[1:], output_dtype=policy.output_dtype)
    for each in modules:
        for path, inner in iter_outermost_units(each):
            inner_state = state_of(inner)
            inner_state.nest(path)
            if inner_state.also_hooked and inner_state.handle is not None:  # a group: each module its own path
                assert isinstance(inner_state.handle.views, DTensorParamViews), "fully_shard's handle"
                inner_state.handle.views.name_member(inner, path)
        if handle is not None:
            assert isinstance(handle.views, DTensorParamViews), "fully_shard's handle"
            register_fully_shard_hooks(each, handle, handle.views)
        each.__class__ = _fsdp_class(type(each))
        _register_as_fully_shard(each)
    if _pipelining_would_not_recognise():
        _UnrecognisedPipelineCheck(modules[0])
    return modules if isinstance(module, list) else module


fully_shard.state = StageReduction  # type: ignore[attr-defined]  # torch's fully_shard.state(module), which its pipeline stages call


def _rows_after_forward(layout: RowShardLayout, mesh: comm.DeviceMesh, group_size: int) -> PostForwardRows:
    """After forward, keep each rank's rows over consecutive runs of ``group_size`` ranks, shown as
    torch's are: ``(Replicate(), Shard(0))`` on a ``(world / group_size, group_size)`` mesh."""
    regrouped = comm.regrouped_mesh(mesh, group_size)
    return PostForwardRows(layout, comm.mesh_groups(regrouped)[1], RowSharding(regrouped, (Replicate(), Shard(0))))


def _pipelining_would_not_recognise() -> bool:
    """torch's pipeline stages are imported and bound torch's ``FSDPModule``, not fsdp1's."""
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    return stage is not None and getattr(stage, "FSDPModule", FSDPModule) is not FSDPModule


class _UnrecognisedPipelineCheck:
    """A one-shot forward pre-hook: torch's pipeline stages recognise a stage module by the
    ``FSDPModule`` they imported, and a stage that does not recognise fsdp1's runs it as a plain
    module: gathered and reduced once per micro-batch, and under a schedule that splits backward with
    no weight gradient at all. The first forward under such a stage says so. Registered only where
    the stages are imported and would not recognise fsdp1's modules."""

    def __init__(self, module: nn.Module) -> None:
        self._handle = module.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: Any) -> None:
        self._handle.remove()
        if not _pipelining_would_not_recognise():
            return
        stage_file = sys.modules["torch.distributed.pipelining.stage"].__file__
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename != stage_file:
            frame = frame.f_back  # type: ignore[assignment]  # None ends the walk
        if frame is not None:
            warnings.warn(
                "fsdp1: a torch.distributed.pipelining stage runs this fully_shard module without recognising it: "
                "it is gathered and reduced once per micro-batch, and a schedule that splits backward (zero-bubble, "
                "DualPipeV) computes no weight gradient for it. Call fsdp1.use_as_torch_fsdp() before building the "
                "pipeline stages.",
                stacklevel=2,
            )


def _check_mesh(mesh: comm.DeviceMesh, dp_mesh_dims: Optional[DataParallelMeshDims]) -> None:
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


def _check_module(module: nn.Module) -> None:
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
    def stop(child: nn.Module) -> bool:
        return is_fsdp_unit(child) or _is_replicated(child)

    params = [slot.live_param for slot in iter_param_slots(module, stop=stop) if id(slot.live_param) not in ignored_ids]
    buffers = [buffer for owner in _modules_until(module, stop) for buffer in owner._buffers.values() if buffer is not None]
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


def _default_mesh() -> comm.DeviceMesh:
    """A 1-D mesh over the default group (no new group), on the accelerator if there is one."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return comm.device_mesh_of(comm.default_group(), device_type)


def _reshard_after_forward(value: Optional[Union[bool, int]], shard_size: int) -> Tuple[Optional[bool], int]:
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


def _mixed_precision_policy(policy: Any) -> MixedPrecisionPolicy:
    """fsdp1's policy, or torch's converted field by field."""
    if type(policy) is MixedPrecisionPolicy:
        return policy
    if type(policy).__name__ != "MixedPrecisionPolicy":
        raise ValueError(f"fsdp1: mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__}.")
    return MixedPrecisionPolicy(policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs)


def _offload_policy(policy: Any) -> OffloadPolicy:
    if isinstance(policy, OffloadPolicy):
        return policy
    name = type(policy).__name__
    if name == "CPUOffloadPolicy":
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if name == "OffloadPolicy":
        return OffloadPolicy()
    raise ValueError(f"fsdp1: offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got {name}.")


def _managed_slots(module: nn.Module, ignored_ids: Set[int], placement_fn: Optional[Callable[[nn.Parameter], Any]],
                   dp_mesh: DataParallelMesh, shardings: Dict[int, ParamSharding]) -> List[ParamSlot]:
    """The registrations of the parameters this group shards: ``module``'s, minus those of modules
    sharded before it and the ignored ones; each parameter's ``ParamSharding`` goes into
    ``shardings``. Refused: a scalar, a parameter tied to one another group manages (which would
    split one weight over two groups), and what torch's refuses of placements and meshes."""
    sharded_elsewhere = _sharded_elsewhere(module)
    shard_size = comm.group_size(dp_mesh.groups[0])
    slots = []
    for slot in iter_param_slots(module, stop=lambda m: is_fsdp_unit(m) or _is_replicated(m)):
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
        local = param._local_tensor if isinstance(param, DTensor) else param
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
        dim = _placement_dim(local, placement_fn(param) if placement_fn is not None else None, shard_size, slot.fqn)
        if id(param) not in shardings:
            shardings[id(param)] = dp_mesh.sharding_of(param, dim, slot.fqn)
        slots.append(slot)
    return slots


def _check_one_dtype(slots: List[ParamSlot]) -> None:
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


def _placement_dim(param: torch.Tensor, placement: Optional[Shard], shard_size: int, fqn: str) -> int:
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


def _is_replicated(module: nn.Module) -> bool:
    """Whether torch's composable ``replicate`` (DDP) manages ``module``: its parameters stay out of
    the group, as torch's ``fully_shard`` leaves them."""
    return "replicate" in (_get_registry(module) or {})


def _register_as_fully_shard(module: nn.Module) -> None:
    """Enter ``module`` in torch's registry of composable APIs under ``fully_shard``, as torch's does,
    so that torch's ``replicate`` leaves it (and its parameters) out, and torch's own ``fully_shard``
    refuses it as applied twice."""
    registry = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
    registry["fully_shard"] = RegistryItem()


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
