"""How ``fully_shard`` shows one parameter as DTensors: at rest (sharded over the data-parallel
mesh) and while its module computes (the tensor the user's model holds: a plain tensor, or, for a
parameter that was a DTensor already, that DTensor).

The unit's layout splits each parameter's *local* tensor: the whole parameter when it was plain,
this rank's tensor-parallel part when it was a DTensor (``parallelize_module``, or a DTensor on the
whole SPMD mesh with ``dp_mesh_dims``). So the engine never sees a DTensor; this is the one place
that knows what the DTensors on top of its tensors are, with the placements torch's FSDP2 gives
them: ``Shard(dim)`` over the data-parallel shard dim (``_StridedShard`` where tensor parallelism
already splits that dim, since the data-parallel split is taken of each tensor-parallel part), after
``Replicate()`` on a replicate dim, and the tensor-parallel placements after that.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from .._engine import collectives as comm
from .._engine.dtensors import MeshPlacements
from .._torch_internals import StridedShard, concatenate_meshes, dtensor, flatten_mesh, local_tensor, spec_of
from ..api import DataParallelMeshDims


@dataclass(frozen=True)
class ParamSharding:
    """One parameter's DTensors: ``at_rest`` over ``shape`` (the global shape) viewing this rank's
    part of the shard, and ``computing`` (None: plain tensors) over the unsharded ``local_shape``
    tensor a gather fills. A forward's gradient is redistributed to the computing placements before
    the reduction, except on ``kept_dims`` (a whole-mesh parameter's data-parallel dims, whose
    partial sums the reduction adds up), as torch's FSDP2 takes gradients."""

    shape: torch.Size
    local_shape: torch.Size
    shard_dim: int
    at_rest: MeshPlacements
    computing: Optional[MeshPlacements] = None
    kept_dims: Tuple[int, ...] = ()
    _computing_specs: Dict[torch.dtype, Any] = field(default_factory=dict, compare=False, repr=False)  # by dtype

    def parameter(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        return self.at_rest.parameter(local, self.shape, requires_grad)

    def dtensor(self, local: torch.Tensor) -> DTensor:
        return self.at_rest.dtensor(local, self.shape)

    def for_compute(self, unsharded: torch.Tensor) -> torch.Tensor:
        """The tensor the module computes on, of a view of the gathered buffer; under autograd the
        gradient flows back to the view."""
        if self.computing is None:
            return unsharded
        spec = self._computing_specs.get(unsharded.dtype)
        if spec is None:  # made once per dtype, not on every forward
            spec = self._computing_specs[unsharded.dtype] = spec_of(self.computing.dtensor(unsharded, self.shape))
        return _ComputingDTensor.apply(unsharded, spec, self.kept_dims)

    def shown_unsharded(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a view of the gathered buffer, or a gradient laid out as one) as the module
        shows it outside autograd; a DTensor already (the forward's own) is shown as it is."""
        if self.computing is None or isinstance(tensor, DTensor):
            return tensor
        return self.computing.dtensor(tensor, self.shape)

    def local_of_computing(self, tensor: torch.Tensor) -> torch.Tensor:
        """The gathered-buffer tensor under what ``shown_unsharded`` gave (or a full value of the
        local shape)."""
        if isinstance(tensor, DTensor) and self.computing is not None:
            return local_tensor(tensor)
        return tensor

    def local_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local-shape part of a plain value of the global shape (no communication)."""
        if self.computing is None:
            return full
        return distribute_tensor(full.detach(), self.computing.mesh, list(self.computing.placements),
                                 src_data_rank=None).to_local()


class _ComputingDTensor(torch.autograd.Function):
    """A view of the gathered buffer as the DTensor of ``spec`` the module computes on. Backward
    hands the view the gradient's local tensor, redistributed to ``spec``'s placements on every dim
    but ``kept_dims``, where it keeps what it came with (torch's FSDP2 reduces those partial sums in
    its reduce-scatter; a gradient that is whole there is reduced as it is)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: Any, kept_dims: Tuple[int, ...]) -> DTensor:
        ctx.spec, ctx.kept_dims = spec, kept_dims
        return dtensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None]:
        if not isinstance(grad, DTensor):
            return grad, None, None
        wanted = tuple(grad.placements[dim] if dim in ctx.kept_dims else placement
                       for dim, placement in enumerate(ctx.spec.placements))
        if tuple(grad.placements) != wanted:
            grad = grad.redistribute(placements=wanted)
        local = local_tensor(grad)
        wait = getattr(local, "wait", None)  # a redistribution's result may still be in flight
        return (wait() if callable(wait) else local), None, None


class DataParallelMesh:
    """The mesh ``fully_shard`` shards over, as torch's FSDP2 reads its ``mesh`` and
    ``dp_mesh_dims`` arguments: ``mesh`` itself when 1-D (shard) or 2-D (replicate, shard), or the
    data-parallel dims of a whole SPMD mesh (several names flattened into one dim; replicate dims
    alone are the engine's hybrid sharding over shard groups of one rank)."""

    def __init__(self, mesh: comm.DeviceMesh, dp_mesh_dims: Optional[DataParallelMeshDims]) -> None:
        self.spmd_mesh: Optional[comm.DeviceMesh] = None
        self.dims = dp_mesh_dims
        self._groups: Optional[Tuple[comm.ProcessGroup, comm.ProcessGroup]] = None
        if dp_mesh_dims is None:
            self.mesh = mesh
            self.replicates = mesh.ndim == 2
            return
        self.spmd_mesh = mesh
        self.replicates = bool(dp_mesh_dims.replicate_names)
        if not dp_mesh_dims.shard_names:  # replicas only (DDP): every rank a shard group of its own
            self.mesh = _submesh(mesh, dp_mesh_dims.replicate_names)
            self._groups = (comm.own_group(), comm.mesh_groups(self.mesh)[0])
            return
        shard_mesh = _submesh(mesh, dp_mesh_dims.shard_names)
        if self.replicates:
            replicate_mesh = _submesh(mesh, dp_mesh_dims.replicate_names)
            self.mesh = concatenate_meshes([replicate_mesh, shard_mesh])
        else:
            self.mesh = shard_mesh

    @property
    def shard_mesh(self) -> Optional[comm.DeviceMesh]:
        """The 1-D mesh of the shard group, which all-gather extensions are given (None: replicas only,
        where every rank is a shard group of its own)."""
        if self._groups is not None:
            return None
        return self.mesh if self.mesh.ndim == 1 else self.mesh[cast(Tuple[str, ...], self.mesh.mesh_dim_names)[-1]]

    @property
    def groups(self) -> Tuple[comm.ProcessGroup, Optional[comm.ProcessGroup]]:
        """The shard group, and the replicate group (None without one)."""
        if self._groups is not None:
            return self._groups
        groups = comm.mesh_groups(self.mesh)
        return groups[-1], groups[0] if self.replicates else None

    def sharding_of(self, param: nn.Parameter, shard_dim: int, fqn: str) -> ParamSharding:
        """``param``'s DTensors when split along ``shard_dim`` of its local tensor, as torch's FSDP2
        places them."""
        if self.dims is not None:
            return self._spmd_sharding(param, shard_dim, fqn)
        if isinstance(param, DTensor):
            return self._tensor_parallel_sharding(param, shard_dim)
        placements: Tuple[Placement, ...] = (Shard(shard_dim),)
        if self.replicates:
            placements = (Replicate(), *placements)
        return ParamSharding(param.shape, param.shape, shard_dim, MeshPlacements(self.mesh, placements))

    def _tensor_parallel_sharding(self, param: DTensor, shard_dim: int) -> ParamSharding:
        spec = spec_of(param)
        if len(spec.placements) > 2:
            raise NotImplementedError(f"FSDP only supports 1D TP/EP or 2D EP+TP, not {spec.placements}")  # torch's
        split_factor = spec.num_shards_map[shard_dim]
        fsdp: Placement = StridedShard(shard_dim, split_factor=split_factor) if split_factor > 1 else Shard(shard_dim)
        placements: Tuple[Placement, ...] = (fsdp, *spec.placements)
        if self.replicates:
            placements = (Replicate(), *placements)
        mesh = concatenate_meshes([self.mesh, spec.mesh])
        return ParamSharding(param.shape, local_tensor(param).shape, shard_dim, MeshPlacements(mesh, placements),
                             computing=MeshPlacements(spec.mesh, tuple(spec.placements)))

    def _spmd_sharding(self, param: nn.Parameter, shard_dim: int, fqn: str) -> ParamSharding:
        dims = cast(DataParallelMeshDims, self.dims)
        mesh = cast(comm.DeviceMesh, self.spmd_mesh)
        if not isinstance(param, DTensor):
            raise ValueError(  # torch's phrase
                "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh (e.g. via "
                f"distribute_module). Got plain tensor for parameter '{fqn}'."
            )
        spec = spec_of(param)
        if spec.mesh != mesh:
            raise ValueError(  # torch's phrase
                "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got different mesh "
                f"objects. fsdp1: '{fqn}' is a DTensor on {spec.mesh}; fully_shard was given {mesh}."
            )
        names = cast(Tuple[str, ...], mesh.mesh_dim_names)
        shard_dims = [names.index(name) for name in dims.shard_names]
        replicate_dims = [names.index(name) for name in dims.replicate_names]
        for index in shard_dims + replicate_dims:
            if not isinstance(spec.placements[index], Replicate):
                kind = "shard" if index in shard_dims else "replicate"
                raise ValueError(  # torch's phrase
                    f"Expected Replicate() on DP {kind} dim '{names[index]}' (index {index}) but got {spec.placements[index]}"
                )
        placements: List[Placement] = list(spec.placements)
        for index in shard_dims:
            split_factor = 1
            for later in range(index + 1, mesh.ndim):
                placement = spec.placements[later]
                if isinstance(placement, Shard) and placement.dim == shard_dim:
                    split_factor *= mesh.size(later)
            placements[index] = StridedShard(shard_dim, split_factor=split_factor) if split_factor > 1 else Shard(shard_dim)
        at_rest = MeshPlacements(mesh, tuple(placements))  # replicas only: the placements the parameter had
        if len(shard_dims) > 1:
            at_rest = self._flattened_sharding(placements, shard_dims)
        return ParamSharding(param.shape, local_tensor(param).shape, shard_dim, at_rest,
                             computing=MeshPlacements(mesh, tuple(spec.placements)),
                             kept_dims=tuple(sorted(shard_dims + replicate_dims)))

    def _flattened_sharding(self, placements: Sequence[Placement], shard_dims: Sequence[int]) -> MeshPlacements:
        """Several data-parallel shard dims show as one, the flattened mesh's, where the first of them
        stood (a replicate dim just before it); the other dims keep their places."""
        mesh = cast(comm.DeviceMesh, self.spmd_mesh)
        dims = cast(DataParallelMeshDims, self.dims)
        names = cast(Tuple[str, ...], mesh.mesh_dim_names)
        submeshes: List[comm.DeviceMesh] = []
        shown: List[Placement] = []
        for index, name in enumerate(names):
            if index == shard_dims[0]:
                submeshes.append(self.mesh)
                if self.replicates:
                    shown.append(Replicate())
                shown.append(placements[index])
            elif index in shard_dims or (self.replicates and name in dims.replicate_names):
                continue
            else:
                submeshes.append(mesh[name])
                shown.append(placements[index])
        return MeshPlacements(concatenate_meshes(submeshes), tuple(shown))


def _submesh(mesh: comm.DeviceMesh, names: Tuple[str, ...]) -> comm.DeviceMesh:
    """The dims ``names`` of ``mesh``; several are flattened into one, as torch's FSDP2 does."""
    if len(names) == 1:
        return mesh[names[0]]
    return flatten_mesh(mesh[names], "_".join(names))
