"""Tests units that mix frozen and trainable parameters with ``use_orig_params=True`` (fine-tuning part
of a block, LoRA-style): they train as DDP does, also after unfreezing part of a unit, and the frozen
parameters cost no gradient memory (torch's FSDP1 keeps a gradient over the whole shard,
pytorch#104690). Without use_orig_params such a unit is refused (tests/test_errors.py)."""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    batch,
    fsdp1_full_params,
    lm_loss,
    make_gpt,
    max_relative_error,
    plain_params,
    relative_errors,
    sgd,
    train,
    wrap_fsdp1,
    wrap_torch_fsdp,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from memory_estimator import fake_process_group  # noqa: E402

STEPS, TOLERANCE = 4, 1e-5


def _freeze_part_of_every_unit(model):
    """Attention and the token embedding frozen; the MLPs, norms, positions and head train."""
    model.tok.requires_grad_(False)
    for block in model.blocks:
        block.qkv.requires_grad_(False)
        block.proj.requires_grad_(False)
    return model


def _train_partly_frozen(strategy):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = _freeze_part_of_every_unit(make_gpt())
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params=True)
    ddp = DDP(copy.deepcopy(base))
    losses = [train(m, STEPS, world_size, rank) for m in (ours, ddp)]
    frozen_grads = [p.grad for p in ours.parameters() if not p.requires_grad]
    return losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp)), frozen_grads


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_units_mixing_frozen_and_trainable_parameters_train_like_ddp(strategy):
    for (ours, ddp), error, frozen_grads in run_on_ranks(2, _train_partly_frozen, strategy):
        assert relative_errors(ours, ddp) <= TOLERANCE and error <= TOLERANCE
        assert frozen_grads and all(grad is None for grad in frozen_grads)


def _unfreeze_part_of_a_unit():
    """Two SGD steps with attention frozen, then two with everything trainable (the kept gradient
    grows to cover the unfrozen parameters); against one process over the global batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = _freeze_part_of_every_unit(make_gpt())
    reference = copy.deepcopy(base)
    ours = wrap_fsdp1(copy.deepcopy(base), "FULL_SHARD", use_orig_params=True)
    losses = []
    for model in (ours, reference):
        optim = sgd(model.parameters())
        losses.append([])
        for step in range(4):
            if step == 2:
                model.requires_grad_(True)
            inputs = batch(step, rank, world_size) if model is ours else _global(step, world_size)
            loss = lm_loss(model, *inputs)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses[-1].append(loss.item())
    return losses, max_relative_error(fsdp1_full_params(ours), plain_params(reference))


def _global(step, world_size):
    parts = [batch(step, r, world_size) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def test_unfreezing_part_of_a_unit_trains_like_one_process():
    results = run_on_ranks(2, _unfreeze_part_of_a_unit)
    mean_over_ranks = [sum(losses) / len(results) for losses in zip(*(ours for (ours, _), _ in results))]
    for (_, reference), error in results:
        assert relative_errors(mean_over_ranks, reference) <= TOLERANCE and error <= TOLERANCE


def _gradient_bytes(model, units):
    """Bytes of distinct gradient storage held for the optimizer after backward."""
    grads = [p.grad for p in model.parameters()] + [u._flat_param.grad for u in units if u._flat_param is not None]
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads if g is not None}
    return sum(storages.values())


def _gradient_memory(wrap, world_size, rank):
    """Gradient bytes one rank holds after backward, and for fsdp1 the bytes of its gradient spans."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    with fake_process_group(world_size, rank):
        model = wrap(_freeze_part_of_every_unit(make_gpt()), "FULL_SHARD", use_orig_params=True)
        lm_loss(model, *batch(0, rank, world_size)).backward()
        units = (TorchFSDP if wrap is wrap_torch_fsdp else fsdp1.FullyShardedDataParallel).fsdp_modules(model)
        spans = [unit._handle._grad_span for unit in units if wrap is wrap_fsdp1 and unit._handle is not None]
        return _gradient_bytes(model, units), sum(hi - lo for lo, hi in spans) * 4


@pytest.mark.parametrize("world_size", [2, 4])
def test_frozen_parameters_cost_no_gradient_memory(world_size):
    """Summed over the ranks (frozen parameters are laid out last, so the last ranks save most)."""
    ours = [_gradient_memory(wrap_fsdp1, world_size, rank) for rank in range(world_size)]
    theirs = sum(_gradient_memory(wrap_torch_fsdp, world_size, rank)[0] for rank in range(world_size))
    trainable = [p.numel() * 4 for p in _freeze_part_of_every_unit(make_gpt()).parameters() if p.requires_grad]
    assert all(held == spans for held, spans in ours)  # only the trainable parameters' part of each shard
    total = sum(held for held, _ in ours)
    # use_orig_params aligns every parameter to 16 bytes
    assert sum(trainable) <= total <= sum(trainable) + 16 * len(trainable), (total, sum(trainable))
    assert total < 0.75 * theirs, (total, theirs)
