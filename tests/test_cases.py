"""Tests the cases users hit, each against ground truth (DDP, torch's FSDP1, or exact values): uneven
sizes on 1, 2 and 4 ranks, unused parameters, frozen parameters, a unit called twice, buffers,
structured outputs and no_sync."""

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
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
    torch_fsdp_full_params,
    wrap_fsdp1,
    wrap_torch_fsdp,
)

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _step_pair(ours, oracle, make_input, steps=3, no_sync_microbatches=0):
    """Train both models identically with Adam; fsdp1's and the oracle's losses per step."""
    rank = dist.get_rank()
    optims = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, oracle)]
    losses = []
    for step in range(steps):
        step_losses = []
        for model, optim in zip((ours, oracle), optims):
            for micro in range(no_sync_microbatches):
                with model.no_sync():
                    model(make_input(step, rank, micro)).sum().backward()
            loss = model(make_input(step, rank, no_sync_microbatches)).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            step_losses.append(loss.item())
        losses.append(step_losses)
    return losses


def _randn(*shape):
    def make(step, rank, micro):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(step * 100 + rank * 10 + micro))

    return make


def _assert_losses_equal(losses):
    for ours, oracle in losses:
        assert abs(ours - oracle) <= 1e-5 * max(abs(oracle), 1e-6), losses


# ---------------------------------------------------------------------------------------------- uneven sizes
def _uneven(use_orig_params):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))  # 20 + 6 = 26 elements
    ours = wrap_fsdp1(copy.deepcopy(base), use_orig_params=use_orig_params, wrap_classes=[nn.Linear])
    theirs = wrap_torch_fsdp(copy.deepcopy(base), use_orig_params=use_orig_params, wrap_classes=[nn.Linear])
    same_layout = [
        torch.equal(a._flat_param.detach(), b._flat_param.detach())
        for a, b in zip(fsdp1.FullyShardedDataParallel.fsdp_modules(ours), TorchFSDP.fsdp_modules(theirs))
        if a._has_params
    ]
    shard_numels = [m._flat_param.numel() for m in fsdp1.FullyShardedDataParallel.fsdp_modules(ours) if m._has_params]
    ddp = DDP(copy.deepcopy(base))
    losses = _step_pair(ours, ddp, _randn(4, 3))
    return same_layout, shard_numels, losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sizes_not_divisible_by_world_size(world_size, use_orig_params):
    results = run_on_ranks(world_size, _uneven, use_orig_params)
    for same_layout, shard_numels, losses, error in results:
        assert same_layout == [True, True], "local shards differ from torch FSDP1's flat layout"
        _assert_losses_equal(losses)
        assert error <= 1e-5
    # Linear(3, 5) has 15 + 5 and Linear(5, 1) 5 + 1 elements. use_orig_params starts each parameter
    # on a 16-byte boundary (4 floats) and pads the total to the world size: 15+1+5 = 21, 5+3+1 = 9.
    unpadded = [21, 9] if use_orig_params else [20, 6]
    expected = [-(-(n + (-n % world_size if use_orig_params else 0)) // world_size) for n in unpadded]
    assert results[0][1] == expected


# ---------------------------------------------------------------------------------------------- unused parameters
class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)  # its own unit, never called
        self.scale = nn.Parameter(torch.ones(3))
        self.unused_root_param = nn.Parameter(torch.ones(3))  # in the root unit, never used

    def forward(self, x):
        return self.used(x) * self.scale


def _unused(strategy, use_orig_params):
    torch.manual_seed(0)
    base = WithUnused()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    theirs = wrap_torch_fsdp(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    losses = _step_pair(ours, ddp, _randn(2, 4))
    _step_pair(theirs, DDP(copy.deepcopy(base), find_unused_parameters=True), _randn(2, 4))
    x = _randn(2, 4)(9, dist.get_rank(), 0)
    for model in (ours, theirs):
        model(x).sum().backward()
    ours_grads = {n: None if p.grad is None else p.grad.clone() for n, p in ours.named_parameters()}
    theirs_grads = {n: None if p.grad is None else p.grad.clone() for n, p in theirs.named_parameters()}
    return losses, ours_grads, theirs_grads, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameter_unused_in_a_step(strategy, use_orig_params):
    for losses, ours_grads, theirs_grads, error in run_on_ranks(2, _unused, strategy, use_orig_params):
        _assert_losses_equal(losses)
        assert error <= 1e-5
        # The unused unit's gradient stays None, exactly where torch's FSDP1 leaves it None.
        assert ours_grads.keys() == theirs_grads.keys()
        unused_unit = [n for n in ours_grads if "unused." in n]
        assert unused_unit and all(ours_grads[n] is None for n in unused_unit)
        for name in ours_grads:
            assert (ours_grads[name] is None) == (theirs_grads[name] is None), name
            if ours_grads[name] is not None:
                assert torch.equal(ours_grads[name], theirs_grads[name]), name


# ---------------------------------------------------------------------------------------------- frozen parameters
def _frozen(strategy):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    base[0].weight.requires_grad_(False)
    base[2].bias.requires_grad_(False)
    frozen_before = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params=True, wrap_classes=())
    ddp = DDP(copy.deepcopy(base))
    losses = _step_pair(ours, ddp, _randn(3, 5))
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
        _assert_losses_equal(losses)
        assert error <= 1e-5
        assert unchanged == {"0.weight": True, "2.bias": True}
        assert grad_is_none == {"_fsdp_wrapped_module.0.weight": True, "_fsdp_wrapped_module.2.bias": True}


# ---------------------------------------------------------------------------------------------- original storage
def _original_storage_alive(strategy, use_orig_params):
    """Bytes of the original parameters' storages still alive after wrapping, for fsdp1 and torch."""
    alive = []
    for wrap in (wrap_fsdp1, wrap_torch_fsdp):
        model = make_gpt()
        storages = [weakref.ref(p.untyped_storage()) for p in model.parameters()]
        wrapped = wrap(model, strategy, use_orig_params)
        gc.collect()
        alive.append(sum(ref().nbytes() for ref in storages if ref() is not None))
        del wrapped
    return alive


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_wrapping_frees_the_original_parameter_storage(strategy, use_orig_params):
    # A rank keeps only its shard: nothing of the unflattened parameters survives, as with torch.
    for ours, theirs in run_on_ranks(2, _original_storage_alive, strategy, use_orig_params):
        assert ours == theirs == 0


# ---------------------------------------------------------------------------------------------- a unit called twice
class CallsTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.shared(torch.relu(self.shared(x))))


def _twice(strategy, use_orig_params):
    torch.manual_seed(0)
    base = CallsTwice()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    ddp = DDP(copy.deepcopy(base))
    losses = _step_pair(ours, ddp, _randn(3, 6))
    return losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unit_called_twice_in_one_forward(strategy, use_orig_params):
    for losses, error in run_on_ranks(2, _twice, strategy, use_orig_params):
        _assert_losses_equal(losses)
        assert error <= 1e-5


# ---------------------------------------------------------------------------------------------- buffers
class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.register_buffer("offset", torch.linspace(-1, 1, 6))

    def forward(self, x):
        return self.norm(self.lin(x)) + self.offset


def _buffers(strategy):
    torch.manual_seed(0)
    base = WithBuffers()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, wrap_classes=[nn.BatchNorm1d])
    theirs = wrap_torch_fsdp(copy.deepcopy(base), strategy, wrap_classes=[nn.BatchNorm1d])
    losses = _step_pair(ours, theirs, _randn(5, 4))
    ours_buffers = {n.replace("_fsdp_wrapped_module.", ""): b for n, b in ours.named_buffers()}
    theirs_buffers = {n.replace("_fsdp_wrapped_module.", ""): b for n, b in theirs.named_buffers()}
    return (
        losses,
        max_relative_error(ours_buffers, theirs_buffers),
        max_relative_error(fsdp1_full_params(ours), torch_fsdp_full_params(theirs)),
        sorted(ours_buffers),
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_buffers_stay_local_and_match_torch_fsdp1(strategy):
    for losses, buffer_error, param_error, names in run_on_ranks(2, _buffers, strategy):
        _assert_losses_equal(losses)
        assert buffer_error == 0.0 and param_error == 0.0
        assert names == ["norm.num_batches_tracked", "norm.running_mean", "norm.running_var", "offset"]


# ---------------------------------------------------------------------------------------------- structured outputs
@dataclasses.dataclass
class Output:
    main: torch.Tensor
    aux: torch.Tensor
    note: str = "not a tensor"


class ReturnsStructure(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        main, aux = self.a(x), self.b(x).tanh()
        if self.kind == "tuple":
            return main, (aux, None)
        if self.kind == "dict":
            return {"main": main, "extra": {"aux": aux}}
        return Output(main, aux)


class ConsumesStructure(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.inner = ReturnsStructure(kind)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        out = self.inner(x)
        if isinstance(out, tuple):
            main, aux = out[0], out[1][0]
        elif isinstance(out, dict):
            main, aux = out["main"], out["extra"]["aux"]
        else:
            main, aux = out.main, out.aux
        return self.head(main * aux)


def _structured(kind, strategy):
    torch.manual_seed(0)
    base = ConsumesStructure(kind)
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, wrap_classes=[ReturnsStructure])
    ddp = DDP(copy.deepcopy(base))
    losses = _step_pair(ours, ddp, _randn(3, 4))
    return losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_outputs_that_are_tuples_dicts_or_dataclasses(kind, strategy):
    # The inner unit is resharded after forward: backward only works if its outputs' hooks re-gather it.
    for losses, error in run_on_ranks(2, _structured, kind, strategy):
        _assert_losses_equal(losses)
        assert error <= 1e-5


# ---------------------------------------------------------------------------------------------- no_sync
def _no_sync(strategy, use_orig_params):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    ddp = DDP(copy.deepcopy(base))
    losses = _step_pair(ours, ddp, _randn(2, 5), no_sync_microbatches=2)
    # Inside no_sync the first unit's gradient is kept unsharded and unreduced, as torch's.
    inner = fsdp1.FullyShardedDataParallel.fsdp_modules(ours)[1]
    with ours.no_sync():
        ours(torch.ones(2, 5)).sum().backward()
    unreduced_numel = inner._flat_param.grad.numel()
    ours.zero_grad()
    return losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp)), unreduced_numel


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_accumulates_like_ddp(strategy, use_orig_params):
    for losses, error, unreduced_numel in run_on_ranks(2, _no_sync, strategy, use_orig_params):
        _assert_losses_equal(losses)
        assert error <= 1e-5
        # Linear(5, 7): 35 + 7 elements; use_orig_params aligns the bias to 36 and pads 43 to 44.
        assert unreduced_numel == (44 if use_orig_params else 42)


# ---------------------------------------------------------------------------------------------- eval between steps
def _eval_between_steps(strategy, use_orig_params):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    ours, ddp = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params), DDP(copy.deepcopy(base))
    eval_losses = []
    for model in (ours, ddp):
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            lm_loss(model, *batch(step, rank, world_size)).backward()
            optim.step()
            optim.zero_grad()
            with torch.no_grad():  # no backward follows: the root stays unsharded, as torch's
                losses.append(lm_loss(model, *batch(99, rank, world_size)).item())
        eval_losses.append(losses)
    return eval_losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_grad_forward_between_training_steps(strategy, use_orig_params):
    for (ours, oracle), error in run_on_ranks(2, _eval_between_steps, strategy, use_orig_params):
        assert ours == oracle
        assert error == 0.0
