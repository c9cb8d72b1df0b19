"""Tests units that mix frozen and trainable parameters with ``use_orig_params=True`` (fine-tuning part
of a block, LoRA-style): they train as DDP does, also after unfreezing part of a unit, and the frozen
parameters cost no gradient memory (torch's FSDP1 keeps a gradient over the whole shard,
pytorch#104690). Without use_orig_params such a unit is refused (tests/test_errors.py). Also: frozen
parameters keep their values and a None gradient, and units frozen whole at wrap time train after
unfreezing; and no warning about containers or frozen parameters (torch's FSDP1's claims there do
not hold for fsdp1). Under ``fully_shard``, a root with frozen parameters (one unfrozen between steps),
and torch's meta-device recipe, train bitwise like torch's ``fully_shard``."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1
from fsdp1._planner.dry_run import fake_process_group

from _harness import run_on_ranks
from _models import (
    assert_losses_equal,
    batch,
    build,
    fsdp1_full_params,
    fully_shard_against_oracle,
    fully_shard_of,
    lm_loss,
    make_gpt,
    max_relative_error,
    plain_params,
    relative_errors,
    seeded_randn,
    sgd,
    step_pair,
    train,
    wrap_fsdp1,
    wrap_torch_fsdp,
)

STEPS, TOLERANCE = 4, 1e-5
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


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
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert error <= TOLERANCE
        assert frozen_grads
        assert all(grad is None for grad in frozen_grads)


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
        assert relative_errors(mean_over_ranks, reference) <= TOLERANCE
        assert error <= TOLERANCE


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
        spans = [unit._handle.grad.span for unit in units if wrap is wrap_fsdp1 and unit._handle is not None]
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


# ---------------------------------------------------------------------------------------------- frozen values
def _frozen(strategy):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    base[0].weight.requires_grad_(False)
    base[2].bias.requires_grad_(False)
    frozen_before = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params=True, wrap_classes=())
    ddp = DDP(copy.deepcopy(base))
    losses = step_pair(ours, ddp, seeded_randn(3, 5))
    params = fsdp1_full_params(ours)
    grads = {n: p.grad for n, p in ours.named_parameters() if not p.requires_grad}
    return (
        losses,
        max_relative_error(params, plain_params(ddp)),
        {n: torch.equal(params[n], frozen_before[n]) for n in frozen_before},
        {n: g is None for n, g in grads.items()},
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_frozen_params_next_to_trainable_ones_with_use_orig_params(strategy):
    for losses, error, unchanged, grad_is_none in run_on_ranks(2, _frozen, strategy):
        assert_losses_equal(losses)
        assert error <= 1e-5
        assert unchanged == {"0.weight": True, "2.bias": True}
        assert grad_is_none == {"_fsdp_wrapped_module.0.weight": True, "_fsdp_wrapped_module.2.bias": True}


# ---------------------------------------------------------------------------------------------- unfreezing
def _unfreeze(strategy, use_orig_params):
    """Blocks frozen at wrap time, unfrozen after two SGD steps; against one process over the global
    batch doing the same (DDP cannot unfreeze a parameter after construction)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    for block in base.blocks:
        block.requires_grad_(False)
    ours = build(base, lambda m: wrap_fsdp1(m, strategy, use_orig_params))
    single = copy.deepcopy(base)
    ours_losses, single_losses = [], []
    for model, losses, global_batch in ((ours, ours_losses, False), (single, single_losses, True)):
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(5):
            if step == 2:
                model.requires_grad_(True)
            parts = [batch(step, r, world_size) for r in (range(world_size) if global_batch else [rank])]
            loss = lm_loss(model, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    gathered = [None] * world_size
    dist.all_gather_object(gathered, ours_losses)
    mean_losses = [sum(r[step] for r in gathered) / world_size for step in range(5)]
    return mean_losses, single_losses, max_relative_error(fsdp1_full_params(ours), plain_params(single))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_unit_frozen_at_wrap_time_trains_after_unfreezing(strategy, use_orig_params):
    for mean_losses, single_losses, error in run_on_ranks(2, _unfreeze, strategy, use_orig_params):
        assert relative_errors(mean_losses, single_losses) <= TOLERANCE
        assert error <= TOLERANCE


# ------------------------------------------------------------------- fully_shard: a frozen root, and meta init
@pytest.mark.parametrize("pattern", ["frozen_root", "meta_init"])
def test_frozen_root_parameters_and_meta_init_train_bitwise_like_torchs(pattern):
    """The root stays gathered for backward, with frozen parts, one unfrozen between steps (DDP cannot
    be the oracle: its reducer keeps the parameters that needed a gradient when it was built); and
    torch's meta-device recipe, to_empty then reset_parameters on the DTensors (each rank draws its
    own rows, so the values are torch's, not a plain model's)."""
    for ours, theirs, error in run_on_ranks(2, fully_shard_against_oracle, pattern):
        assert ours == theirs
        assert error == 0.0


# ------------------------------------------------------------------- no warnings whose claims do not hold
def _frozen_between_trainable(impl):
    """A fully_shard unit whose middle Linear is frozen: the losses, the trainable parameters after
    two AdamW steps, and the bytes this rank sent in the second step."""
    from fsdp1._planner.dry_run import CommBytes

    shard = fully_shard_of(impl)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    model[2].requires_grad_(False)
    shard(model)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, sent = [], {}
    for step in range(2):
        counter = CommBytes()
        with counter:
            loss = model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))).square().mean()
            loss.backward()
        sent = dict(counter.payload)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, [p.full_tensor().detach() for p in model.parameters() if p.requires_grad], sum(sent.values())


def test_frozen_parameters_of_a_fully_shard_unit_are_not_reduced_as_torchs():
    """Their places in the gradient are left out of the reduce-scatter, as torch's leaves out the
    parameters without a gradient (fsdp1 reduced their zeros): bitwise torch's, no more bytes."""
    for (ours, our_values, our_sent), (theirs, their_values, their_sent) in zip(
            run_on_ranks(2, _frozen_between_trainable, "fsdp1"), run_on_ranks(2, _frozen_between_trainable, "torch")):
        assert ours == theirs
        assert all(torch.equal(a, b) for a, b in zip(our_values, their_values))
        assert our_sent <= their_sent


def _warnings_whose_claims_do_not_hold():
    """torch's FSDP1 warns that it will not gather a container's parameters (a ``ModuleList`` has no
    forward) and that a unit mixing frozen and trainable parameters costs gradient memory for the frozen
    ones. Neither holds for fsdp1, which says nothing: calls of the container's children gather (the
    children train like DDP's), and frozen parameters keep no gradient (tested above)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 3)])
    reference = DDP(copy.deepcopy(layers))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = fsdp1.FullyShardedDataParallel(layers, use_orig_params=True)
        mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        mixed[0].requires_grad_(False)
        fsdp1.FullyShardedDataParallel(mixed, use_orig_params=True,
                                       auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({nn.Sequential}))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    for model in (wrapped.module, reference.module):  # the container's children, called from outside
        model[1](model[0](x)).sum().backward()
    for param in reference.module.parameters():  # DDP reduces only through its own forward: average by hand
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()
    with fsdp1.FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
        grads = [p.grad.clone() for p in wrapped.parameters()]
    return [str(w.message) for w in caught], grads, [p.grad for p in reference.module.parameters()]


def test_fsdp1_does_not_warn_where_its_units_gather_containers_and_keep_no_frozen_gradients():
    for caught, grads, ddp_grads in run_on_ranks(2, _warnings_whose_claims_do_not_hold):
        assert caught == []
        assert len(grads) == len(ddp_grads) == 4
        assert all(torch.allclose(g, d, atol=1e-7) for g, d in zip(grads, ddp_grads))
