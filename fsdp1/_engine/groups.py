"""What fsdp1 asks of torch's process groups and meshes, with no collective issued: ranks and sizes,
backends, the groups a unit uses, and the subgroups and meshes fsdp1 builds. Version shims of
torch's collective names live here too."""

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._torch_internals import group_timeout

ProcessGroup = dist.ProcessGroup


Work = dist.Work


@dataclass(frozen=True)
class ProcessGroups:
    """The groups a unit communicates over: it shards over ``shard`` and, under a hybrid strategy,
    all-reduces its sharded gradient over ``replicate`` (None when there is no replica to sync)."""

    shard: ProcessGroup
    replicate: Optional[ProcessGroup]


# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_group() -> ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError(
            "fsdp1: torch.distributed is not initialized. Call torch.distributed.init_process_group() "
            "(e.g. under torchrun) first."
        )
    return group


def mesh_groups(mesh: DeviceMesh) -> List[ProcessGroup]:
    """The process group of each of ``mesh``'s dimensions, in dimension order."""
    return [mesh.get_group(mesh_dim=dim) for dim in range(mesh.ndim)]


_OWN_GROUPS: Dict[ProcessGroup, ProcessGroup] = {}


def own_group() -> ProcessGroup:
    """A group of this rank alone, made once per default group (collective the first time: every
    rank makes every rank's)."""
    world = default_group()
    if world not in _OWN_GROUPS:
        _OWN_GROUPS[world] = dist.new_subgroups(group_size=1)[0]
    return _OWN_GROUPS[world]


def group_rank(group: ProcessGroup) -> int:
    """This rank within ``group``; asked of the group itself, so that a group made without
    ``init_process_group`` (a stand-in for planning or tests) answers too, as under torch's FSDP1."""
    return group.rank()


def group_size(group: ProcessGroup) -> int:
    return group.size()


def is_process_group(group: Any) -> bool:
    """A torch ProcessGroup, or an object that answers ``rank()`` and ``size()`` as one does."""
    return isinstance(group, ProcessGroup) or (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None)))


class FakeGroupsStandFor:
    """While entered, fake groups (the planner's dry runs) take the paths that groups of the job's
    ``backend`` take, so that a dry run allocates what the job will: two gloo ranks exchange their
    shards where another backend gathers them through a staging buffer. Process-wide, like the fake
    default group, as autograd may run the backward's gathers on another thread."""

    backend: Optional[str] = None

    def __init__(self, backend: Optional[str]) -> None:
        self._backend: Optional[str] = backend
        self._outer: Optional[str] = None

    def __enter__(self) -> None:
        self._outer, FakeGroupsStandFor.backend = FakeGroupsStandFor.backend, self._backend

    def __exit__(self, *exc: Any) -> None:
        FakeGroupsStandFor.backend = self._outer


def is_gloo_pair(group: ProcessGroup) -> bool:
    """Two gloo ranks, where an exchange of chunks beats gloo's own collectives (``PairwiseExchange``),
    or two fake ones standing for them."""
    if group_size(group) != 2:
        return False
    return is_gloo(group) or (_is_fake(group) and FakeGroupsStandFor.backend == dist.Backend.GLOO)


def communicates(group: Any) -> bool:
    """A group whose collectives move data: not a fake one (the memory estimator's), nor a stand-in
    that only answers ``rank()`` and ``size()`` (a planning or test object, never initialised)."""
    return isinstance(group, ProcessGroup) and not _is_fake(group)


def _is_fake(group: ProcessGroup) -> bool:
    """A fake group (the memory estimator's): its collectives move no data."""
    return dist.get_backend(group) == "fake"


def is_gloo(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


def device_mesh_of(group: ProcessGroup, device_type: str) -> DeviceMesh:
    """A 1-D mesh over ``group``'s ranks that reuses the group (no new group is created), for DTensors."""
    return DeviceMesh.from_group(group, device_type)


def regrouped_mesh(mesh: DeviceMesh, group_size: int) -> DeviceMesh:
    """A 2-D mesh over a 1-D ``mesh``'s ranks whose second dimension groups consecutive runs of
    ``group_size`` of them. Collective: every rank of ``mesh`` creates its groups."""
    return DeviceMesh(mesh.device_type, mesh.mesh.view(-1, group_size))


def subgroup_of_this_rank(rank_lists: List[List[int]]) -> ProcessGroup:
    """Make one group per list of global ranks (collective: every rank makes all of them, in the
    same order) and return the one this rank is in."""
    group, _ = dist.new_subgroups_by_enumeration(rank_lists)
    assert isinstance(group, ProcessGroup), "every rank is in one of the lists"  # typed as maybe not, since 2.15
    return group


def new_gloo_group() -> ProcessGroup:
    """A gloo group over every rank, for collectives run beside training's (a background save).
    Collective: every rank of the default group creates it."""
    group = dist.new_group(backend="gloo")
    assert isinstance(group, ProcessGroup), "every rank is in it"  # typed as maybe not, since 2.15
    return group


def global_rank_of(group: ProcessGroup, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def global_rank() -> int:
    return dist.get_rank()


def timeout_of(group: ProcessGroup) -> timedelta:
    """The group's own timeout (init_process_group(timeout=...)); torch keeps it on the backend's options."""
    own = group_timeout(group)
    return dist.distributed_c10d.default_pg_timeout if own is None else own
