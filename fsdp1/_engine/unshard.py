"""``summon_full_params``: every original parameter unsharded, outside forward and backward.

This module decides which units take part, refuses what cannot work (inside forward or backward,
nested), keeps every unit's training state truthful while they are gathered, and shows each unit's
full values through its handle's gather (``FlatParamHandle.gathered_views``).
"""

import contextlib
from typing import Iterator, List

import torch
from torch import nn

from . import collectives as comm
from .common import TrainingState
from .handle import FlatParamHandle
from .traversal import is_fsdp_unit, unit_name, unit_paths
from .unit_state import UnitState, adopt_replaced_flat_params, state_of, unit_states


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Within, every unit in ``module`` (or only ``module`` itself without ``recurse``) holds its
    original parameters unsharded; with ``writeback`` each rank keeps its shard of what they hold on
    exit. Collective: every rank must enter it.

    ``rank0_only``: only global rank 0 holds them; the other ranks take part in the gathers and free
    the result at once. ``offload_to_cpu``: the full parameters are CPU copies (no copy when the
    compute device is the CPU). ``with_grads``: each one's ``.grad`` is the full averaged gradient,
    with either ``use_orig_params`` value (torch's needs it True). ``offload_to_cpu`` also works for
    NO_SHARD units, which torch's refuses.

    Misuse raises torch's exception types: ``NotImplementedError`` for ``writeback`` with
    ``rank0_only``, ``AssertionError`` inside forward or backward and when nested.
    """
    if writeback and rank0_only:
        raise NotImplementedError(
            "fsdp1: summon_full_params(writeback=True, rank0_only=True) cannot write back (writeback=True and "
            "rank0_only=True is not supported): the other ranks hold no full parameters to take their shards "
            "from. Pass writeback=False with rank0_only=True."
        )
    units = unit_states(module) if recurse else ([state_of(module)] if is_fsdp_unit(module) else [])
    _check_idle(module, units)
    if units:
        comm.check_every_rank_calls(units[0].process_group, "summon_full_params()")
    adopt_replaced_flat_params(module)
    expose = not rank0_only or comm.global_rank() == 0
    with contextlib.ExitStack() as stack:
        for unit in units:
            unit.training_state = TrainingState.SUMMON_FULL_PARAMS
            stack.callback(setattr, unit, "training_state", TrainingState.IDLE)
            if unit.handle is not None:
                stack.enter_context(_full_params(unit.handle, writeback, expose, offload_to_cpu, with_grads))
        yield


def _check_idle(module: nn.Module, units: List[UnitState]) -> None:
    for unit in units:
        if unit.training_state is TrainingState.IDLE:
            continue
        path = unit.path
        where = unit_name(unit_paths(module).get(unit.owner, "?") if path is None else path)
        if unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise AssertionError(
                f"fsdp1: Cannot manually unshard parameters when already unsharding parameters: "
                f"summon_full_params() was entered again for {where}, whose parameters are already gathered "
                "by an enclosing summon_full_params(); use the outer context alone."
            )
        raise AssertionError(
            f"fsdp1: Cannot manually unshard parameters during forward/backward: summon_full_params() "
            f"cannot gather {where} now; call it between training steps (after backward() has returned)."
        )


@contextlib.contextmanager
def _full_params(handle: FlatParamHandle, writeback: bool, expose: bool, offload_to_cpu: bool,
                 with_grads: bool) -> Iterator[None]:
    """Within, the unit's module holds every original parameter unsharded as an ``nn.Parameter`` (the
    originals themselves with use_orig_params), outside autograd; on exit with ``writeback`` this
    rank keeps its shard of what they hold then, including data the caller replaced, also when the
    body raised (as torch's).

    Collective on every rank; a rank with ``expose=False`` (not rank 0 under ``rank0_only``) frees
    what it gathered at once and its module stays as it was. ``offload_to_cpu`` shows CPU copies (the
    device buffer is freed meanwhile); ``with_grads`` sets each one's ``.grad`` to the full averaged
    gradient (None where no rank has one).
    """
    with handle.gathered_views() as views:
        grads = handle.full_grads() if with_grads else None
        if not expose:
            handle.reshard()
            yield
            return
        if offload_to_cpu and views[0].device.type != "cpu":
            views = [view.cpu() for view in views]
            grads = None if grads is None else [grad.cpu() for grad in grads]
            handle.reshard()
        exposed = handle.views.expose_full(handle.flat_param, views)
        if grads is not None:
            for param, grad, requires_grad in zip(exposed, grads, handle.views.requires_grad):
                param.grad = grad if requires_grad else None
        try:
            yield
        finally:  # written back even when the body raised, as torch's
            try:
                if writeback:
                    registered = handle.views.registered_full_params(exposed)
                    _check_full_shapes(handle, views, registered)
                    handle.views.adopt_replaced(exposed, registered)
                    handle.conversions.load_full_params(registered)
            finally:
                handle.reshard()
                handle.views.hide_full(handle.flat_param, handle.local_shard, handle.layout)
                if grads is not None:  # the originals showed full gradients: back to views of the sharded one
                    handle.grad.reshow()


def _check_full_shapes(handle: FlatParamHandle, views: List[torch.Tensor], exposed: List[nn.Parameter]) -> None:
    for slot, view, param in zip(handle.views.slots, views, exposed):
        if param.shape != view.shape:
            raise RuntimeError(
                f"fsdp1: Cannot writeback when the parameter shape changes: '{handle.views.clean_fqn(slot)}' changed from "
                f"{tuple(view.shape)} to {tuple(param.shape)} inside summon_full_params; FSDP can only write "
                "back values of the same shape. Change values in place (e.g. param.copy_(...)) instead."
            )
