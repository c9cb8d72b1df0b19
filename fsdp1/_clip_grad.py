"""``clip_grad_norm_`` of the root: the gradient norm over every rank and unit, then one scaling.

Sharded units hold disjoint parts of each gradient, so their contributions (sums of ``|g|^p``, or
maxima for p = inf) are summed over the shard group; gradients every rank holds whole (NO_SHARD
units, parameters outside any unit, ignored ones) count once, from this rank, as DDP plus
``torch.nn.utils.clip_grad_norm_`` counts them. Scaling the sharded gradient in place scales the
original parameters' ``.grad`` too (with use_orig_params they are views of it).
"""

import warnings
from typing import TYPE_CHECKING, List

import torch

from . import _collectives as comm

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel as Unit


def clip_grad_norm_(root: "Unit", max_norm: float, norm_type: float) -> torch.Tensor:
    norm_type = float(norm_type)
    sharded: List[torch.Tensor] = []
    whole: List[torch.Tensor] = []
    for unit in root._root_state.units:  # per unit, not per parameter
        handle = unit._handle
        grad = None if handle is None else handle.optim_grad
        if grad is not None:
            (sharded if handle.is_sharded else whole).append(grad)
    whole += [p.grad for p in root._root_state.params_outside_units if p.grad is not None]
    device = root.compute_device
    if not sharded and not whole:
        warnings.warn("fsdp1: clip_grad_norm_() found no gradients; it returns a norm of 0 and scales nothing.", stacklevel=3)
    sharded_part = _partial(sharded, norm_type, device)
    if root.world_size > 1:
        comm.all_reduce_with(sharded_part, root.process_group, maximum=norm_type == float("inf")).wait()
    whole_part = _partial(whole, norm_type, device)
    if norm_type == float("inf"):
        total = torch.maximum(sharded_part, whole_part)
    else:
        total = (sharded_part + whole_part) ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in sharded + whole:
        grad.mul_(clip_coef.to(grad.dtype))
    return total


def _partial(grads: List[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The maximum of ``|g|`` (p = inf), else the sum of ``|g|^p``, over ``grads``, in float32 or wider."""
    if not grads:
        return torch.zeros((), device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads])
    if norm_type == float("inf"):
        return norms.max()
    return (norms ** norm_type).sum()
