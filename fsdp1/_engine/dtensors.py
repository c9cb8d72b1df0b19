"""One builder of DTensors over a rank's rows, for every place fsdp1 shows a sharded tensor as a
DTensor: ``fully_shard``'s parameters and gradients, the rows ``reshard_after_forward=k`` keeps,
and FSDP1's SHARDED state dicts (parameters and optimizer state). Two ways, for two readers: a
parameter (and a gradient) is built on its local tensor itself, as ``from_local`` builds, which
``torch.compile`` traces; a tensor handed out to be saved (``viewing``) is built on an empty
stand-in and given its local tensor afterwards, which ``torch.save`` takes for a view of the shard."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from .._torch_internals import dtensor as build_dtensor
from .._torch_internals import is_traceable_wrapper_subclass, rebind, spec_of

if TYPE_CHECKING:
    from .._torch_internals import DTensorSpec


def contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    """A contiguous tensor's strides for ``shape``, as torch computes them (a zero-size dimension
    counts as one)."""
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class MeshPlacements:
    """DTensors on ``mesh`` with ``placements`` over given local tensors: how a ``fully_shard`` unit
    shows its parameters, and how a SHARDED state dict shows a unit's rows (``Shard(0)``)."""

    mesh: DeviceMesh
    placements: Tuple[Placement, ...]

    def dtensor(self, local: torch.Tensor, shape: torch.Size) -> DTensor:
        """``local`` (this rank's part) as the DTensor of global ``shape``; the shape is given, not
        inferred, since uneven rows would make every rank infer its own (a hang, pytorch#149138)."""
        return viewing(local, spec_of(self._stand_in(local, shape)))

    def parameter(self, local: torch.Tensor, shape: torch.Size, requires_grad: bool) -> nn.Parameter:
        """A DTensor ``nn.Parameter`` of global ``shape`` whose local tensor is ``local``, built on it
        as ``from_local`` builds, so that ``torch.compile`` can trace it (a compiled optimizer step);
        state dicts hold ``viewing`` copies, which ``torch.save`` takes."""
        return nn.Parameter(build_dtensor(local.view_as(local), spec_of(self._stand_in(local, shape))),
                            requires_grad=requires_grad)

    def _stand_in(self, local: torch.Tensor, shape: torch.Size) -> DTensor:
        return DTensor.from_local(_empty_like(local), self.mesh, self.placements, run_check=False, shape=shape,
                                  stride=contiguous_stride(shape))


def viewing(local: torch.Tensor, spec: "DTensorSpec") -> DTensor:
    """A DTensor of ``spec`` whose local tensor is ``local``, built on an empty stand-in: a DTensor's
    wrapper takes the storage offset of the tensor it is built on, and ``torch.save`` (and
    ``deepcopy``) cannot handle a wrapper with a nonzero offset, which a view of the shard past its
    first element would give it."""
    dtensor = build_dtensor(_empty_like(local), spec)
    rebind(dtensor, local, spec)
    return dtensor


def _empty_like(local: torch.Tensor) -> torch.Tensor:
    """An empty plain tensor of ``local``'s dtype and device (``local`` may be a tensor subclass
    whose own operations do not make one)."""
    return torch.empty(0, dtype=local.dtype, device=local.device)


def is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a tensor subclass that wraps other tensors (torch's ``TwoTensor``,
    torchao's weights), DTensors aside. torch types its test as one no ``Tensor`` can pass, which
    would make every branch on it unreachable to the type checker."""
    return bool(is_traceable_wrapper_subclass(tensor)) and not isinstance(tensor, DTensor)
