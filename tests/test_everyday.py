"""Tests the patterns users bring every day, each against ground truth doing exactly the same
thing: tied weights, evaluating before the optimizer exists, a metric between backward and step,
unfreezing after wrapping, wrapping a unit again, touching parameters outside forward and
``apply(init_fn)``, an exception mid-step, ``.to(dtype)`` after wrapping, two forwards before two
backwards, and ``torch.compile``."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    batch,
    build,
    fsdp1_full_params,
    lm_loss,
    make_gpt,
    make_tied_gpt,
    max_relative_error,
    plain_params,
    relative_errors,
    torch_fsdp_full_params,
    train,
    wrap_fsdp1,
    wrap_torch_fsdp,
)

FSDP = fsdp1.FullyShardedDataParallel
SHARDED = ["FULL_SHARD", "SHARD_GRAD_OP"]
STRATEGIES = SHARDED + ["NO_SHARD"]
TOLERANCE = 1e-5

pytestmark = pytest.mark.filterwarnings("ignore:The `NO_SHARD` sharding strategy is deprecated:FutureWarning")


class _AveragedGrads(nn.Module):
    """Data parallelism by hand: a plain model whose gradients are averaged over the ranks before each
    step. DDP itself is no oracle here: two forwards before two backwards give it wrong gradients
    (4.6e-2 off on the MLP below), silently."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)

    def average_grads(self):
        for param in self.parameters():
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()


def _train_each(models, steps=3, dtype=torch.float32, after_step=lambda: None):
    """Adam steps on the MLP's inputs for each model in turn; each model's losses."""
    losses = []
    for model in models:
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses.append([])
        for step in range(steps):
            loss = model(_x(step, dtype=dtype)).square().mean()
            loss.backward()
            if isinstance(model, _AveragedGrads):
                model.average_grads()
            optim.step()
            optim.zero_grad()
            losses[-1].append(loss.item())
            after_step()
    return losses


def _rank_world():
    return dist.get_rank(), dist.get_world_size()


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _x(step, rows=4, cols=5, dtype=torch.float32):
    rank = dist.get_rank()
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(100 * step + rank), dtype=dtype)


# ---------------------------------------------------------------------------------------------- 1. tied weights
def _tied(strategy, use_orig_params, ways):
    rank, world_size = _rank_world()
    base = make_tied_gpt(ways)
    ours = build(base, lambda m: wrap_fsdp1(m, strategy, use_orig_params))
    theirs = build(base, lambda m: wrap_torch_fsdp(m, strategy, use_orig_params))
    ddp = build(base, DDP)
    n_params = len(list(ours.parameters())), len(list(theirs.parameters()))
    losses = [train(m, 4, world_size, rank) for m in (ours, theirs, ddp)]
    params = fsdp1_full_params(ours)
    # Shared names come back once, as torch's summon shows them: compare the names both have.
    theirs_params = torch_fsdp_full_params(theirs)
    params = {n: params[n] for n in theirs_params}
    return n_params, losses, max_relative_error(params, theirs_params), max_relative_error(params, plain_params(ddp))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_embedding_and_head_train_like_torch_fsdp1_and_ddp(strategy, use_orig_params, world_size):
    for n_params, (ours, theirs, ddp), torch_error, ddp_error in run_on_ranks(world_size, _tied, strategy, use_orig_params, 2):
        assert n_params[0] == n_params[1]  # the shared weight appears once in parameters()
        assert ours == theirs and torch_error == 0.0  # bitwise
        assert relative_errors(ours, ddp) <= TOLERANCE and ddp_error <= TOLERANCE


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_weight_shared_three_ways_sums_all_three_gradients(use_orig_params):
    for _, (ours, theirs, ddp), torch_error, ddp_error in run_on_ranks(2, _tied, "FULL_SHARD", use_orig_params, 3):
        assert ours == theirs and torch_error == 0.0
        assert relative_errors(ours, ddp) <= TOLERANCE and ddp_error <= TOLERANCE


# ---------------------------------------------------------------------------------------------- 2. eval first
def _eval_before_optimizer(strategy, use_orig_params):
    rank, world_size = _rank_world()
    base = make_gpt()
    ours, ddp = build(base, lambda m: wrap_fsdp1(m, strategy, use_orig_params)), build(base, DDP)
    eval_losses = []
    for model in (ours, ddp):
        with torch.no_grad():
            eval_losses.append(lm_loss(model, *batch(99, rank, world_size)).item())
    types = sorted({type(p).__name__ for p in ours.parameters()})
    gathered = [u._handle.state.name for u in FSDP.fsdp_modules(ours) if u._handle is not None]
    losses = [train(m, 4, world_size, rank) for m in (ours, ddp)]
    return types, gathered, eval_losses, losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", SHARDED)
def test_evaluating_before_building_the_optimizer(strategy, use_orig_params, world_size):
    for types, gathered, eval_losses, (ours, ddp), error in run_on_ranks(world_size, _eval_before_optimizer, strategy, use_orig_params):
        assert types == ["Parameter"]  # the optimizer gets the real parameters, never views
        assert set(gathered) == {"SHARDED"}  # a forward without grad leaves nothing gathered
        assert eval_losses[0] == pytest.approx(eval_losses[1], rel=TOLERANCE)
        assert relative_errors(ours, ddp) <= TOLERANCE and error <= TOLERANCE


# ---------------------------------------------------------------------------------------------- 3. metric before step
def _metric_between_backward_and_step(strategy, use_orig_params, mode):
    rank, world_size = _rank_world()
    base = make_gpt()
    ours, ddp = build(base, lambda m: wrap_fsdp1(m, strategy, use_orig_params)), build(base, DDP)
    results = []
    for model in (ours, ddp):
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, metrics = [], []
        for step in range(4):
            loss = lm_loss(model, *batch(step, rank, world_size))
            loss.backward()
            if mode == "no_grad":
                with torch.no_grad():
                    metrics.append(lm_loss(model, *batch(50 + step, rank, world_size)).item())
            elif mode == "inference_mode":
                with torch.inference_mode():
                    metrics.append(lm_loss(model, *batch(50 + step, rank, world_size)).item())
            else:  # eval mode, grad enabled, no backward for it
                model.eval()
                metrics.append(lm_loss(model, *batch(50 + step, rank, world_size)).item())
                model.train()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        results.append((losses, metrics))
    return results, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("mode, world_size", [("no_grad", 2), ("inference_mode", 2), ("eval", 2), ("no_grad", 4)])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_metric_between_backward_and_step_keeps_the_gradients(strategy, use_orig_params, mode, world_size):
    for ((ours, our_metrics), (ddp, ddp_metrics)), error in run_on_ranks(
        world_size, _metric_between_backward_and_step, strategy, use_orig_params, mode
    ):
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert relative_errors(our_metrics, ddp_metrics) <= TOLERANCE
        assert error <= TOLERANCE


def _summon_after_a_forward_without_backward(strategy, use_orig_params):
    """backward, a metric forward with grad enabled (no backward for it), step, then
    summon_full_params: it must show the stepped values, and its writeback must keep them."""
    rank, world_size = _rank_world()
    base = make_gpt()
    ours, ddp = build(base, lambda m: wrap_fsdp1(m, strategy, use_orig_params)), build(base, DDP)
    for model in (ours, ddp):
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        lm_loss(model, *batch(0, rank, world_size)).backward()
        lm_loss(model, *batch(50, rank, world_size))
        optim.step()
        optim.zero_grad()
    with FSDP.summon_full_params(ours):
        summoned = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in ours.named_parameters()}
    summon_error = max_relative_error(summoned, plain_params(ddp))
    losses = [train(m, 2, world_size, rank, make_optim=lambda ps: torch.optim.SGD(ps, lr=0.5)) for m in (ours, ddp)]
    return summon_error, losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", SHARDED)
def test_summon_full_params_after_a_forward_that_no_backward_followed(strategy, use_orig_params):
    for summon_error, (ours, ddp), error in run_on_ranks(2, _summon_after_a_forward_without_backward, strategy, use_orig_params):
        assert summon_error <= TOLERANCE  # the stepped values, not those gathered before the step
        assert relative_errors(ours, ddp) <= TOLERANCE and error <= TOLERANCE


# ---------------------------------------------------------------------------------------------- 4. unfreezing
def _unfreeze(strategy, use_orig_params):
    """Blocks frozen at wrap time, unfrozen after two SGD steps; against one process over the global
    batch doing the same (DDP cannot unfreeze a parameter after construction)."""
    rank, world_size = _rank_world()
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


# ---------------------------------------------------------------------------------------------- 5. FSDP(FSDP(m))
def _wrap_twice_nested(strategy, use_orig_params):
    rank, world_size = _rank_world()
    base = make_gpt()
    nested = build(base, lambda m: FSDP(wrap_fsdp1(m, strategy, use_orig_params), sharding_strategy=fsdp1.ShardingStrategy[strategy], use_orig_params=use_orig_params))
    once, ddp = build(base, lambda m: wrap_fsdp1(m, strategy, use_orig_params)), build(base, DDP)
    losses = [train(m, 4, world_size, rank) for m in (nested, once, ddp)]
    return losses, max_relative_error(fsdp1_full_params(nested), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", SHARDED)
def test_a_unit_around_a_unit_trains_like_one_wrap(strategy, use_orig_params):
    for (nested, once, ddp), error in run_on_ranks(2, _wrap_twice_nested, strategy, use_orig_params):
        assert nested == once
        assert relative_errors(nested, ddp) <= TOLERANCE and error <= TOLERANCE


# ---------------------------------------------------------------------------------------------- 6. outside forward
def _init_fn(module):
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        nn.init.constant_(module.bias, 0.25)


def _apply_then_train(strategy, use_orig_params):
    rank, world_size = _rank_world()
    base = _mlp()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    shapes = []
    ours.apply(lambda m: shapes.append(tuple(m.weight.shape)) if isinstance(m, nn.Linear) else None)
    torch.manual_seed(7)
    ours.apply(_init_fn)
    torch.manual_seed(7)
    plain = copy.deepcopy(base).apply(_init_fn)
    ddp = DDP(plain)
    losses = _train_each((ours, ddp))
    read = None
    try:
        ours.module[0].weight.sum()
    except RuntimeError as error:
        read = str(error)
    return shapes, losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp)), read


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_apply_gathers_full_parameters_and_reads_outside_forward_never_crash(strategy, use_orig_params):
    for shapes, (ours, ddp), error, read in run_on_ranks(2, _apply_then_train, strategy, use_orig_params):
        assert shapes == [(7, 5), (3, 7)]  # the initialiser saw full shapes
        assert relative_errors(ours, ddp) <= TOLERANCE and error <= TOLERANCE
        if use_orig_params or strategy == "NO_SHARD":
            assert read is None  # the rank's shard (or the whole parameter) is readable
        else:
            assert "'0.weight' is sharded across the ranks" in read and "summon_full_params" in read


# ---------------------------------------------------------------------------------------------- 7. exception mid-step
class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("deliberate failure in backward")


class _MaybeFails(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()
        self.fail_in_backward = False

    def forward(self, x):
        x = self.net[0](x)
        if self.fail_in_backward:
            x = _FailInBackward.apply(x)
        return self.net[2](self.net[1](x))


def _exception_mid_step(strategy, use_orig_params, where):
    base = _MaybeFails()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    ddp = DDP(copy.deepcopy(base))
    losses, errors = [], []
    for model in (ours, ddp):
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses.append([])
        for step in range(4):
            if step == 1 and where == "backward" and model is ours:  # DDP cannot go on after this one
                model.module.fail_in_backward = True
                try:
                    model(_x(9)).sum().backward()
                except ValueError as error:
                    errors.append(type(error).__name__)
                model.module.fail_in_backward = False
            loss = model(_x(step)).square().mean()
            loss.backward()
            if step == 1 and where in ("forward", "nested unit"):
                # A float64 input fails inside the first unit, reached through the root or directly.
                called = model if where == "forward" else model.module.net[0]
                try:
                    called(_x(9, dtype=torch.float64))
                except RuntimeError as error:
                    errors.append(type(error).__name__)
            optim.step()
            optim.zero_grad()
            losses[-1].append(loss.item())
    return errors, losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("where", ["forward", "nested unit", "backward"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_goes_on_after_an_exception_as_if_it_never_happened(strategy, use_orig_params, where):
    for errors, (ours, ddp), error in run_on_ranks(2, _exception_mid_step, strategy, use_orig_params, where):
        assert errors == (["ValueError"] if where == "backward" else ["RuntimeError", "RuntimeError"])
        assert relative_errors(ours, ddp) <= TOLERANCE and error <= TOLERANCE


# ---------------------------------------------------------------------------------------------- 8. .to(dtype)
def _convert_after_wrapping(strategy, use_orig_params, conversion, trained_before):
    """Convert to float64 right after wrapping, or after a float32 step whose gradients were zeroed
    (they must stay zeroed); against a plain model doing the same, its gradients averaged by hand."""
    base = _mlp()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    oracle = _AveragedGrads(copy.deepcopy(base))
    if trained_before:
        _train_each((ours, oracle), steps=1)
    for model in (ours, oracle):
        if conversion == "to":
            model.to(torch.float64)
        else:
            model.double()
    losses = _train_each((ours, oracle), dtype=torch.float64)
    dtypes = sorted({str(p.dtype) for p in ours.parameters()} | {str(g.dtype) for g in fsdp1_full_params(ours).values()})
    return dtypes, losses, max_relative_error(fsdp1_full_params(ours), plain_params(oracle.module))


@pytest.mark.parametrize("trained_before", [False, True])
@pytest.mark.parametrize("conversion", ["to", "double"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_converting_the_dtype_after_wrapping(strategy, use_orig_params, conversion, trained_before):
    for dtypes, (ours, oracle), error in run_on_ranks(
        2, _convert_after_wrapping, strategy, use_orig_params, conversion, trained_before
    ):
        assert dtypes == ["torch.float64"]
        assert relative_errors(ours, oracle) <= 1e-12 and error <= 1e-12


# ---------------------------------------------------------------------------------------------- 9. torch.compile
def _compiled(use_orig_params):
    """Inductor compiles the module bodies; fsdp1's hooks run eagerly between them."""
    import torch._dynamo

    rank, world_size = _rank_world()
    base = make_gpt()
    counts = {}
    for name, wrap in (("fsdp1", wrap_fsdp1), ("torch_fsdp1", wrap_torch_fsdp)):
        model = build(base, lambda m: wrap(m, "FULL_SHARD", use_orig_params))
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(batch(0, rank, world_size)[0])
        counts[name] = (explained.graph_count, explained.graph_break_count)
    torch._dynamo.reset()
    compiled = torch.compile(build(base, lambda m: wrap_fsdp1(m, "FULL_SHARD", use_orig_params)))
    eager = build(base, lambda m: wrap_fsdp1(m, "FULL_SHARD", use_orig_params))
    graphs, losses = [], []
    for model in (compiled, eager):
        losses.append(train(model, 1, world_size, rank))
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        losses[-1] += train(model, 2, world_size, rank)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return counts, losses, graphs


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_torch_compile_runs_the_hooks_eagerly_and_matches_eager(use_orig_params):
    for counts, (compiled, eager), graphs in run_on_ranks(2, _compiled, use_orig_params):
        assert relative_errors(compiled, eager) <= TOLERANCE
        assert graphs[0] > 0 and len(set(graphs)) == 1  # compiled at the first step, never again
        # 3 graphs, 2 breaks: one break per unit boundary. torch's FSDP1 compiles nothing without use_orig_params.
        assert counts["fsdp1"] == (3, 2)
        assert counts["torch_fsdp1"] == ((3, 2) if use_orig_params else (0, -1))


# ---------------------------------------------------------------------------------------------- 10. two forwards
def _two_forwards_then_two_backwards(strategy, use_orig_params):
    base = _mlp()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    oracle = _AveragedGrads(copy.deepcopy(base))
    losses = []
    for model in (ours, oracle):
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses.append([])
        for step in range(3):
            first = model(_x(2 * step)).square().mean()
            second = model(_x(2 * step + 1)).tanh().mean()
            first.backward()
            second.backward()
            if model is oracle:
                oracle.average_grads()
            optim.step()
            optim.zero_grad()
            losses[-1] += [first.item(), second.item()]
    return losses, max_relative_error(fsdp1_full_params(ours), plain_params(oracle.module))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_forwards_then_two_backwards_match_averaged_gradients(strategy, use_orig_params):
    for (ours, oracle), error in run_on_ranks(2, _two_forwards_then_two_backwards, strategy, use_orig_params):
        assert relative_errors(ours, oracle) <= TOLERANCE and error <= TOLERANCE
