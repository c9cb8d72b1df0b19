"""Tests ``register_comm_hook``: a custom hook sees every unit's reduction (sharded and not) and
training equals the default path's; fsdp1's default and compressing hooks (``fsdp1.comm_hooks``)
and torch's own hook functions give torch's FSDP1 results bit for bit; misuse is refused as
torch's refuses it."""

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp1
from fsdp1 import comm_hooks

from _harness import run_on_ranks
from _models import Block, fsdp1_full_params, make_gpt, max_relative_error, torch_fsdp_full_params, train

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
STEPS = 3


def _wrap(base, strategy="FULL_SHARD", **kwargs):
    return fsdp1.FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}),
                                          sharding_strategy=fsdp1.ShardingStrategy[strategy], **kwargs)


def _custom_hook(strategy):
    """A hook that records what it is given and reduces with dist directly, as a user's would."""
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []

    def hook(state, grad, output=None):
        calls.append((grad.numel(), None if output is None else output.numel()))
        grad.div_(world)
        if output is None:
            dist.all_reduce(grad, group=state)
        else:
            dist.reduce_scatter_tensor(output, grad, group=state)

    base = make_gpt()
    hooked, default = _wrap(base, strategy), _wrap(base, strategy)
    hooked.register_comm_hook(dist.group.WORLD, hook)
    losses = train(hooked, STEPS, world, rank), train(default, STEPS, world, rank)
    units = sum(1 for u in hooked.fsdp_modules(hooked) if u._handle is not None)
    return calls, units, losses, max_relative_error(fsdp1_full_params(hooked), fsdp1_full_params(default))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_a_custom_hook_sees_every_reduction(strategy):
    for calls, units, (hooked, default), error in run_on_ranks(2, _custom_hook, strategy):
        assert len(calls) == units * STEPS
        assert units == 3
        assert all((output is None) == (strategy == "NO_SHARD") for _, output in calls)
        assert all(output is None or output * 2 == numel for numel, output in calls)
        assert hooked == default
        assert error < 1e-6  # one division by 2 instead of fsdp1's 2-step split: equal here


def _against_torch(hook_name, strategy, param_dtype, use_torch_hook):
    """fsdp1 with the hook against torch's FSDP1 with the same hook; for the compressing hooks, whose
    torch versions fail on CPU (``record_stream`` on a CPU tensor), against torch's FSDP1 reducing in
    the hook's dtype without a hook, which is the same arithmetic: cast, divide, reduce, divide, cast back."""
    from torch.distributed.algorithms._comm_hooks import default_hooks as torch_hooks
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    compress_dtype = {"bf16_compress_hook": torch.bfloat16, "fp16_compress_hook": torch.float16}.get(hook_name)
    mp = dict(param_dtype=param_dtype) if param_dtype else {}
    ours = _wrap(base, strategy, mixed_precision=fsdp1.MixedPrecision(**mp) if mp else None)
    their_mp = dict(mp, reduce_dtype=compress_dtype) if compress_dtype else mp
    theirs = TorchFSDP(copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy],
                       mixed_precision=TorchMixedPrecision(**their_mp) if their_mp else None, device_id=torch.device("cpu"))
    module = torch_hooks if use_torch_hook else comm_hooks
    state = (module.LowPrecisionState if compress_dtype else module.DefaultState)(dist.group.WORLD)
    ours.register_comm_hook(state, getattr(module, hook_name))
    if not compress_dtype:
        theirs.register_comm_hook(torch_hooks.DefaultState(dist.group.WORLD), getattr(torch_hooks, hook_name))
    losses = train(ours, STEPS, world, rank), train(theirs, STEPS, world, rank)
    return losses, max_relative_error(fsdp1_full_params(ours), torch_fsdp_full_params(theirs))


@pytest.mark.parametrize("hook_name, strategy, param_dtype, use_torch_hook", [
    ("reduce_scatter_hook", "FULL_SHARD", None, False),
    ("allreduce_hook", "NO_SHARD", None, False),
    ("bf16_compress_hook", "FULL_SHARD", None, False),
    ("fp16_compress_hook", "SHARD_GRAD_OP", None, False),
    ("fp16_compress_hook", "FULL_SHARD", torch.bfloat16, False),
    ("bf16_compress_hook", "NO_SHARD", None, False),
    ("reduce_scatter_hook", "FULL_SHARD", torch.float16, True),
    ("allreduce_hook", "NO_SHARD", None, True),
])
def test_hooks_match_torch_fsdp1(hook_name, strategy, param_dtype, use_torch_hook):
    for (ours, theirs), error in run_on_ranks(2, _against_torch, hook_name, strategy, param_dtype, use_torch_hook):
        assert ours == theirs
        assert error == 0.0


def _misuse():
    base = make_gpt()
    model = _wrap(base)
    assert model.check_is_root()
    state = comm_hooks.DefaultState(dist.group.WORLD)
    errors = []
    for call in (lambda: model.blocks[0].register_comm_hook(state, comm_hooks.reduce_scatter_hook),
                 lambda: model.register_comm_hook(state, "not a hook")):
        try:
            call()
        except (AssertionError, ValueError) as e:
            errors.append(str(e))
    model.register_comm_hook(state, comm_hooks.reduce_scatter_hook)
    try:
        model.register_comm_hook(state, comm_hooks.reduce_scatter_hook)
    except AssertionError as e:
        errors.append(str(e))
    try:
        comm_hooks.DefaultState(None)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_misuse_is_refused_with_the_fix():
    for errors in run_on_ranks(2, _misuse):
        assert len(errors) == 4
        assert "root instance" in errors[0]
        assert "'blocks.0'" in errors[0]
        assert "callable" in errors[1]
        assert "already registered" in errors[2]
        assert "ProcessGroup" in errors[3]
