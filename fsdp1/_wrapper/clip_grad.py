"""``clip_grad_norm_`` of the root: the gradient norm over every rank and unit, then one scaling.

Sharded units hold disjoint parts of each gradient, so their contribution (the p-th power of their
norm, or its maximum for p = inf) is summed over the shard group; gradients every rank holds whole
(NO_SHARD units, parameters outside any unit, ignored ones) count once, from this rank, as DDP plus
``torch.nn.utils.clip_grad_norm_`` counts them. The arithmetic is torch FSDP1's, term for term (a
float32 norm per gradient tensor, in unit order, then the norm of those norms), so the result is
bitwise torch's and clipping does not make two runs drift apart. Scaling the sharded gradient in
place scales the original parameters' ``.grad`` too (with use_orig_params they are views of it).
"""

import functools
import warnings
from typing import List, Optional

import torch
from torch import nn

from .._engine import collectives as comm
from .._engine.handle import FlatParamHandle
from .._engine.unit_state import state_of


def clip_grad_norm_(root: nn.Module, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                    offload_params: bool) -> torch.Tensor:
    root_unit = state_of(root)
    state = root_unit.root_state
    handles = [unit.handle for unit in state.units if unit.handle is not None]
    if not any(handle.is_sharded for handle in handles):  # every rank holds every gradient: DDP's case
        params = list(root.parameters())
        total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type)
        if error_if_nonfinite:
            _refuse_nonfinite(root, total, not torch.isfinite(total).item())
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total
    norm_type = float(norm_type)
    sharded: List[torch.Tensor] = []
    whole: List[torch.Tensor] = []
    for handle in handles:
        (sharded if handle.is_sharded else whole).extend(_grads_of(handle))
    has_whole = any(not handle.is_sharded for handle in handles) or bool(state.params_outside_units)
    whole += [p.grad for p in state.params_outside_units if p.grad is not None]
    device = root_unit.compute_device
    sharded_norm = _norm(sharded, norm_type, device)
    whole_norm = _norm(whole, norm_type, device) if has_whole else None
    nonfinite_here = error_if_nonfinite and not all(
        torch.isfinite(norm).item() for norm in (sharded_norm, whole_norm) if norm is not None)
    if norm_type == float("inf"):
        # The whole part joins after the reduction: the same maximum as torch's wherever the ranks'
        # whole gradients agree, and each rank's own, as DDP's, for ignored ones, which may not.
        comm.all_reduce_with(sharded_norm, root_unit.process_group, maximum=True).wait()
        total = sharded_norm if whole_norm is None else torch.maximum(sharded_norm, whole_norm)
    else:
        total = sharded_norm**norm_type
        comm.all_reduce_with(total, root_unit.process_group, maximum=False).wait()
        if whole_norm is not None:
            total += whole_norm**norm_type
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite:
        _refuse_nonfinite(root, total, nonfinite_here)
    if offload_params:
        total = total.cpu()
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = sharded + whole
    for grad in grads:
        grad.mul_(clip_coef.to(grad.device, grad.dtype))  # offloaded gradients are on the CPU
    if not grads:
        warnings.warn(f"fsdp1: clip_grad_norm_() found no gradients on rank {root.rank}; it returns the norm in "
                      f"{total.dtype} and scales nothing.", stacklevel=3)
        return total
    # Computed in float32; returned in the gradients' dtype, as torch's (bf16 with keep_low_precision_grads).
    return total.to(functools.reduce(torch.promote_types, [grad.dtype for grad in grads]))


def _refuse_nonfinite(root: nn.Module, total: torch.Tensor, nonfinite_here: bool) -> None:
    """``error_if_nonfinite``: raise on every rank, before any gradient is scaled, naming the ranks
    whose own gradients (after the reduction, their shards) hold a NaN or an infinity; each rank
    judges its own part, so ranks never disagree about raising."""
    unit = state_of(root)
    flags = torch.zeros(unit.world_size, device=unit.compute_device)
    flags[comm.group_rank(unit.process_group)] = float(nonfinite_here)
    comm.all_reduce_with(flags, unit.process_group, maximum=True).wait()
    ranks = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if ranks:
        raise RuntimeError(
            f"fsdp1: clip_grad_norm_(error_if_nonfinite=True): the total gradient norm is {total.item()}; the "
            f"gradients of rank(s) {ranks} hold a NaN or an infinity. No gradient was scaled. Skip this step "
            "(zero_grad()) or find its cause (a bad batch, too high a learning rate); with "
            "error_if_nonfinite=False the norm is returned and the step left to you.")


def _grads_of(handle: FlatParamHandle) -> List[torch.Tensor]:
    """The gradient tensors torch's FSDP1 takes norms of: each original parameter's with
    use_orig_params (None where the parameter has none on this rank), else the flat one."""
    if handle.use_orig_params:
        return [p.grad for p in handle.views.orig_params() if p.grad is not None]
    grad: Optional[torch.Tensor] = handle.grad.for_optim
    return [] if grad is None else [grad]


def _norm(grads: List[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The ``norm_type``-norm of ``grads`` seen as one vector, in float32: the norm of their norms."""
    if not grads:
        return torch.zeros((), device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads])
    return torch.linalg.vector_norm(norms, norm_type, dtype=torch.float32).to(device)
