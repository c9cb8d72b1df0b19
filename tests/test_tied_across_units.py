"""Tests weights tied across units (pytorch#77724): an embedding tied to the output head, each matched
by the policy into its own unit, trains exactly as DDP. The planner gives the tied parameter to the
closest unit that holds every module using it; torch's FSDP1 cannot wrap these models this way.
Also a weight tied inside one unit (the root: the embedding and the head, or a third user) trains
bitwise as torch's FSDP1 and as DDP, its gradients summed over every use."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    D_MODEL,
    VOCAB,
    Block,
    build,
    fsdp1_full_params,
    make_tied_gpt,
    max_relative_error,
    plain_params,
    relative_errors,
    torch_fsdp_full_params,
    train,
    wrap_fsdp1,
    wrap_torch_fsdp,
)

STEPS, TOLERANCE = 4, 1e-5
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


# ---------------------------------------------------------------------------------------------- tied in one unit
def _tied_in_the_root_unit(strategy, use_orig_params, ways):
    rank, world_size = dist.get_rank(), dist.get_world_size()
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
    for n_params, (ours, theirs, ddp), torch_error, ddp_error in run_on_ranks(
        world_size, _tied_in_the_root_unit, strategy, use_orig_params, 2
    ):
        assert n_params[0] == n_params[1]  # the shared weight appears once in parameters()
        assert ours == theirs
        assert torch_error == 0.0  # bitwise
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert ddp_error <= TOLERANCE


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_weight_shared_three_ways_sums_all_three_gradients(use_orig_params):
    for _, (ours, theirs, ddp), torch_error, ddp_error in run_on_ranks(
        2, _tied_in_the_root_unit, "FULL_SHARD", use_orig_params, 3
    ):
        assert ours == theirs
        assert torch_error == 0.0
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert ddp_error <= TOLERANCE


# ---------------------------------------------------------------------------------------------- tied across units
def _policy(*modules, classes=()):
    """Wrap exactly ``modules`` and instances of ``classes``."""
    chosen = {id(m) for m in modules}
    return fsdp1.wrap.CustomPolicy(lambda m: id(m) in chosen or isinstance(m, tuple(classes)))


def _holders(model, fqn):
    """Paths of the units whose flat parameter holds ``fqn`` (relative to the unit)."""
    units = fsdp1._engine.traversal.unit_paths(model)
    return [path for unit, path in units.items() if unit._handle is not None and any(
        (f"{path}.{name}" if path else name) == fqn for name in unit._handle.fqns)]


def _tied_gpt_in_units(ways, strategy, use_orig_params):
    """TiedGPT with the embedding, the head (and the auxiliary head) each matched into its own unit."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = make_tied_gpt(ways)
    model = copy.deepcopy(base)
    tied = [model.tok, model.head] + ([model.aux] if ways == 3 else [])
    ours = fsdp1.FullyShardedDataParallel(
        model, auto_wrap_policy=_policy(*tied, classes=[Block]),
        sharding_strategy=fsdp1.ShardingStrategy[strategy], use_orig_params=use_orig_params,
    )
    units = sorted(fsdp1._engine.traversal.unit_paths(ours).values())
    ddp = DDP(copy.deepcopy(base))
    losses = [train(m, STEPS, world_size, rank) for m in (ours, ddp)]
    return units, _holders(ours, "tok.weight"), losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("ways", [2, 3])
def test_embedding_tied_to_heads_in_separate_units_trains_like_ddp(ways, strategy, use_orig_params):
    for units, holders, (ours, ddp), error in run_on_ranks(2, _tied_gpt_in_units, ways, strategy, use_orig_params):
        assert {"tok", "head"} <= set(units)  # each matched into its own unit...
        assert holders == [""]  # ...and the tied weight left to the root, their closest common unit
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert error <= TOLERANCE


class _TiedPair(nn.Module):
    """Two layers sharing one weight, each to be its own unit inside this one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_MODEL, D_MODEL)
        self.b = nn.Linear(D_MODEL, D_MODEL)
        self.b.weight = self.a.weight

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class _NetWithTiedPair(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pair = _TiedPair()
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx):
        return self.head(self.pair(self.tok(idx)))


def _tied_inside_a_nested_unit(strategy, use_orig_params):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = _NetWithTiedPair()
    model = copy.deepcopy(base)
    ours = fsdp1.FullyShardedDataParallel(
        model, auto_wrap_policy=_policy(model.pair, model.pair.a, model.pair.b, model.head),
        sharding_strategy=fsdp1.ShardingStrategy[strategy], use_orig_params=use_orig_params,
    )
    ddp = DDP(copy.deepcopy(base))
    losses = [train(m, STEPS, world_size, rank) for m in (ours, ddp)]
    return _holders(ours, "pair.a.weight"), losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_weight_tied_inside_a_nested_unit_goes_to_that_unit(strategy, use_orig_params):
    for holders, (ours, ddp), error in run_on_ranks(2, _tied_inside_a_nested_unit, strategy, use_orig_params):
        assert holders == ["pair"]  # not the root: the closest unit holding both layers
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert error <= TOLERANCE


def _gpt2(seed=0):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=61, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def _gpt2_embedding_and_head_in_units(world_size_check, strategy, use_orig_params):
    """Hugging Face GPT-2 with wte, wpe, every block and lm_head each a unit; wte and lm_head share
    one weight. Against DDP, and a direct call of the head (as a user computing logits from
    hidden states would make), which gathers the root for the tied weight, against the weight."""
    rank = dist.get_rank()
    base = _gpt2()
    model = copy.deepcopy(base)
    block = type(model.transformer.h[0])
    ours = fsdp1.FullyShardedDataParallel(
        model, auto_wrap_policy=_policy(model.lm_head, classes=[block, nn.Embedding]),
        sharding_strategy=fsdp1.ShardingStrategy[strategy], use_orig_params=use_orig_params,
    )
    ddp = DDP(copy.deepcopy(base))
    losses = []
    for m in (ours, ddp):
        optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses.append([])
        for step in range(STEPS):
            ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(100 * step + rank))
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses[-1].append(loss.item())
    # c_attn.bias holds the key bias, whose gradient is rounding noise (see test_hf_models).
    ddp_params = {n: p for n, p in plain_params(ddp).items() if not n.endswith("attn.c_attn.bias")}
    full = fsdp1_full_params(ours)
    params = {n: p for n, p in full.items() if n in ddp_params}
    hidden = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        direct = torch.equal(ours.lm_head(hidden), hidden @ full["transformer.wte.weight"].T)
    return _holders(ours, "transformer.wte.weight"), losses, max_relative_error(params, ddp_params), direct


@pytest.mark.parametrize("world_size, strategy, use_orig_params", [
    (2, "FULL_SHARD", False), (2, "FULL_SHARD", True), (2, "SHARD_GRAD_OP", False), (4, "FULL_SHARD", True),
])
def test_gpt2_with_embedding_and_head_in_separate_units_trains_like_ddp(world_size, strategy, use_orig_params):
    results = run_on_ranks(world_size, _gpt2_embedding_and_head_in_units, world_size, strategy, use_orig_params)
    for holders, (ours, ddp), error, direct in results:
        assert holders == [""]
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert error <= TOLERANCE
        assert direct


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.lin = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, idx):
        return torch.tanh(self.lin(self.emb(idx)))


class _LMWithBody(nn.Module):
    """The embedding's unit lies inside another unit (the body), the head outside it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = _Body()
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.body.emb.weight

    def forward(self, idx):
        return self.head(self.body(idx))


def _tied_from_a_unit_inside_a_unit(classes, use_orig_params):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = _LMWithBody()
    ours = fsdp1.FullyShardedDataParallel(
        copy.deepcopy(base), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy(classes), use_orig_params=use_orig_params,
    )
    ddp = DDP(copy.deepcopy(base))
    losses = [train(m, STEPS, world_size, rank) for m in (ours, ddp)]
    return _holders(ours, "body.emb.weight"), losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("classes", [{_Body, nn.Embedding}, {_Body, nn.Embedding, nn.Linear}], ids=["body+emb", "body+emb+linear"])
def test_weight_tied_from_a_unit_nested_in_another_goes_to_the_root(classes, use_orig_params):
    for holders, (ours, ddp), error in run_on_ranks(2, _tied_from_a_unit_inside_a_unit, classes, use_orig_params):
        assert holders == [""]  # the closest unit holding both the embedding and the head
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert error <= TOLERANCE
