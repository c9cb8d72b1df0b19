"""Tests what only ``fsdp1.fully_shard`` (torch's FSDP2 API on fsdp1's engine) has, against torch's own
``fully_shard`` and DDP doing the same: the class swap, DTensor parameters (placements, global and local
shapes, values) and training bitwise torch's (blocks + root, on 1, 2 and 4 ranks), what is registered
after forward / backward / an evaluation forward for each ``reshard_after_forward``, an integer
``reshard_after_forward`` on 4 ranks, ``unshard``/``reshard``, ``summon_full_params`` and ``no_sync`` on
its modules, forward methods, dtype conversions and deepcopy. Its other features are tested with the
same feature under ``FullyShardedDataParallel`` (test_accumulation, test_mixed_precision,
test_cpu_offload, test_prefetch, test_hybrid_shard, test_fully_shard_checkpoint, test_errors, ...)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import Block, adam, batch, lm_loss, local_shards, make_gpt, shard_gpt, torchs_fully_shard, train


# ---------------------------------------------------------------------------------------------- layout and training
def _layout_and_training():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ours = shard_gpt(make_gpt(), fsdp1.fully_shard)
    theirs = shard_gpt(make_gpt(), torchs_fully_shard())
    ddp = DDP(make_gpt())
    same_layout = all(
        isinstance(p, DTensor) and isinstance(p, nn.Parameter) and p.placements == q.placements
        and p.shape == q.shape and p.to_local().shape == q.to_local().shape and torch.equal(p.to_local(), q.to_local())
        for p, q in zip(ours.parameters(), theirs.parameters())
    )
    names = [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    classes = (type(ours).__name__, type(ours.blocks[0]).__name__, isinstance(ours.blocks[0], fsdp1.FSDPModule),
               isinstance(ours.blocks[0], Block), isinstance(ours.blocks[0].ln1, fsdp1.FSDPModule))
    losses = [train(model, 4, world_size, rank) for model in (ours, theirs, ddp)]
    same_after = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(ours.parameters(), theirs.parameters()))
    full_ours = {n: p.full_tensor() for n, p in ours.named_parameters()}
    ddp_params = dict(ddp.module.named_parameters())
    ddp_error = max((full_ours[n] - ddp_params[n]).abs().max().item() for n in full_ours)
    return same_layout, names, classes, losses, same_after, ddp_error


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parameters_are_torchs_dtensors_and_training_is_bitwise_torchs_fully_shard(world_size):
    for same_layout, names, classes, (ours, theirs, ddp), same_after, ddp_error in run_on_ranks(world_size, _layout_and_training):
        assert same_layout  # placements, global and local shapes and values
        assert names  # names in order
        assert classes == ("FSDPTinyGPT", "FSDPBlock", True, True, False)
        assert ours == theirs  # bitwise, losses and parameters after 4 Adam steps
        assert same_after
        assert max(abs(a - b) for a, b in zip(ours, ddp)) < 1e-5
        assert ddp_error < 1e-5


# ---------------------------------------------------------------------------------------------- what is registered
def _kinds(model):
    """'D' for a DTensor parameter, 'P' for a plain tensor, for the root's own and a block's."""
    return ("D" if isinstance(model.head.weight, DTensor) else "P") + ("D" if isinstance(model.blocks[0].fc.weight, DTensor) else "P")


def _registered(reshard_after_forward):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seen = []
    for shard in (fsdp1.fully_shard, torchs_fully_shard()):
        model = shard_gpt(make_gpt(), shard, reshard_after_forward=reshard_after_forward)
        kinds = [_kinds(model)]
        loss = lm_loss(model, *batch(0, rank, world_size))
        kinds.append(_kinds(model))  # between forward and backward
        loss.backward()
        kinds.append(_kinds(model))
        with torch.no_grad():
            model(batch(1, rank, world_size)[0])
        kinds.append(_kinds(model))  # after an evaluation forward
        model.reshard()
        kinds.append(_kinds(model))
        seen.append(kinds)
    return seen


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_what_is_registered_after_forward_and_backward_is_torchs_and_after_evaluation_the_dtensors(reshard_after_forward):
    for ours, theirs in run_on_ranks(2, _registered, reshard_after_forward):
        assert ours[:3] == theirs[:3]  # before forward, between forward and backward, after backward
        # After a forward without grad every module holds its DTensors again (and after reshard()):
        # torch's keeps the root (or any reshard_after_forward=False module) gathered, so an optimizer
        # or clip_grad_norm_ built on parameters() then sees the unsharded copies and trains the root
        # silently wrong.
        assert ours[3:] == ["DD", "DD"]


def _reshard_onto_two_ranks():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seen = []
    for shard in (fsdp1.fully_shard, torchs_fully_shard()):
        model = shard_gpt(make_gpt(), shard, reshard_after_forward=2)
        optim = adam(model.parameters())
        losses, between = [], []
        for step in range(3):
            loss = lm_loss(model, *batch(step, rank, world_size))
            weight = model.blocks[0].fc.weight  # between forward and backward: rows over 2 ranks
            between.append((type(weight).__name__, tuple(weight.placements), tuple(weight.device_mesh.mesh.shape),
                            tuple(weight.to_local().shape), weight.full_tensor().sum().item()))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        after = model.blocks[0].fc.weight
        seen.append((losses, between, tuple(after.placements), local_shards(model)))
    (ours, ours_between, ours_after, ours_params), (theirs, theirs_between, theirs_after, theirs_params) = seen
    same = all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params))
    return ours, theirs, ours_between, theirs_between, ours_after, theirs_after, same


def test_reshard_after_forward_onto_two_of_four_ranks_is_torchs():
    for ours, theirs, ours_between, theirs_between, ours_after, theirs_after, same in run_on_ranks(4, _reshard_onto_two_ranks):
        assert ours == theirs  # bitwise, backward gathering over 2 ranks only
        assert same
        assert ours_between == theirs_between  # (Replicate(), Shard(0)) on a 2x2 mesh, torch's rows and values
        assert ours_after == theirs_after  # Shard(0) over 4 ranks again after backward


def _late_wait_while_rows_are_kept():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seen = []
    for shard in (fsdp1.fully_shard, torchs_fully_shard()):
        model = shard_gpt(make_gpt(), shard, reshard_after_forward=2)
        optim = adam(model.parameters())
        handle = model.blocks[0].unshard(async_op=True)
        losses, kept = [], []
        for step in range(2):
            loss = lm_loss(model, *batch(step, rank, world_size))
            if step == 0:
                handle.wait()  # the forward used its gather; the block keeps its rows over 2 ranks now
            weight = model.blocks[0].fc.weight
            kept.append((tuple(weight.placements), weight.full_tensor().sum().item()))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        seen.append((losses, kept, local_shards(model)))
    (ours, ours_kept, ours_params), (theirs, theirs_kept, theirs_params) = seen
    return ours, theirs, ours_kept, theirs_kept, all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params))


def test_a_late_wait_on_a_module_that_keeps_its_rows_after_forward_does_nothing_as_torchs():
    for ours, theirs, ours_kept, theirs_kept, same in run_on_ranks(4, _late_wait_while_rows_are_kept):
        assert ours == theirs  # bitwise losses over 2 Adam steps
        assert ours_kept == theirs_kept  # the rows the block shows after the wait: (Replicate(), Shard(0)), torch's values
        assert same  # parameters after the steps


def _unshard_and_reshard():
    model = shard_gpt(make_gpt(), fsdp1.fully_shard)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    block = model.blocks[0]
    handle = block.unshard(async_op=True)
    kinds = [type(handle).__name__, isinstance(block.fc.weight, DTensor)]
    handle.wait()
    kinds += [isinstance(block.fc.weight, DTensor), torch.equal(block.fc.weight, full["blocks.0.fc.weight"]),
              isinstance(model.head.weight, DTensor)]  # not recursive
    block.reshard()
    kinds.append(isinstance(block.fc.weight, DTensor))
    kinds.append(model.unshard())
    model.reshard()
    return kinds


def test_unshard_and_reshard_act_on_one_module_as_torchs():
    for kinds in run_on_ranks(2, _unshard_and_reshard):
        assert kinds == ["UnshardHandle", True, False, True, True, True, None]


# ---------------------------------------------------------------------------------------------- beyond torch
def _beyond_torch():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = shard_gpt(make_gpt(), fsdp1.fully_shard)
    plain = make_gpt()
    with model.summon_full_params():
        summoned = all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
        kinds = {type(p).__name__ for p in model.parameters()}
    with model.no_sync():
        lm_loss(model, *batch(0, rank, world_size)).backward()
    no_grad_yet = all(p.grad is None for p in model.parameters())
    lm_loss(model, *batch(1, rank, world_size)).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    reference = shard_gpt(make_gpt(), fsdp1.fully_shard)
    reference.set_requires_gradient_sync(False)
    lm_loss(reference, *batch(0, rank, world_size)).backward()
    reference.set_requires_gradient_sync(True)
    lm_loss(reference, *batch(1, rank, world_size)).backward()
    same_grads = all(torch.equal(a, p.grad.full_tensor()) for a, p in zip(grads, reference.parameters()))
    return summoned, kinds, no_grad_yet, same_grads


def test_summon_full_params_and_no_sync_work_on_fully_shard_modules():
    for summoned, kinds, no_grad_yet, same_grads in run_on_ranks(2, _beyond_torch):
        assert summoned
        assert kinds == {"Parameter"}
        assert no_grad_yet
        assert same_grads  # no_sync() is set_requires_gradient_sync(False) for its duration


def _forward_method_and_conversion():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    plain = make_gpt()
    model = shard_gpt(make_gpt(), fsdp1.fully_shard)

    def embed(self, idx):
        return self.tok(idx) + self.pos[: idx.shape[1]]

    type(plain).embed = embed
    fsdp1.register_fsdp_forward_method(model, "embed")
    fsdp1.register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # a plain module: nothing happens
    idx = batch(0, rank, world_size)[0]
    same_embedding = torch.equal(model.embed(idx), plain.embed(idx))
    del type(plain).embed
    model.double()
    dtypes = {p.dtype for p in model.parameters()} | {p.to_local().dtype for p in model.parameters()}
    loss = lm_loss(model, *batch(1, rank, world_size))
    loss.backward()
    try:
        copy.deepcopy(model)
        deepcopy_error = None
    except AssertionError as error:
        deepcopy_error = str(error)
    return same_embedding, dtypes, loss.dtype, deepcopy_error


def test_forward_methods_conversions_and_deepcopy_behave_as_torchs():
    for same_embedding, dtypes, loss_dtype, deepcopy_error in run_on_ranks(2, _forward_method_and_conversion):
        assert same_embedding
        assert dtypes == {torch.float64}
        assert loss_dtype == torch.float64
        assert deepcopy_error == "FSDP does not support deepcopy"
