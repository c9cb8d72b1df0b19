"""Tests that every auto-wrap policy of ``fsdp1.wrap`` (and ``enable_wrap``/``wrap``) makes exactly the
units torch's makes, with the same per-unit kwargs, on a transformer, a CNN with BatchNorm and nested
``ModuleList``s, and a Hugging Face GPT-2; and that the wrapped models train bitwise like torch's. A unit
wrapped around a unit by hand (``FSDP(FSDP(m))``) trains exactly as one wrap does. The private helpers
of torch's ``wrap`` module that clients import (``_or_policy``, ``_module_wrap_policy``,
``_wrap_module_cls_individually``, ``_recursive_wrap``) decide and wrap as torch's, and torch's policy
objects given to fsdp1's class (a size-based one not counting ignored parameters) plan torch's units."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import wrap as torch_wrap
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1
from fsdp1 import wrap as fsdp1_wrap
from fsdp1._engine.traversal import clean_fqn

from _harness import run_on_ranks
from _models import (
    IMPLEMENTATIONS,
    Block,
    batch,
    build,
    fsdp1_full_params,
    fsdp_api,
    lm_loss,
    make_gpt,
    max_relative_error,
    plain_params,
    relative_errors,
    train,
    wrap_fsdp1,
)

POLICIES = ["always", "lambda", "transformer", "size_based", "module", "custom"]
TOLERANCE = 1e-5


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 7, 3), nn.BatchNorm2d(7), nn.ReLU())
        self.stages = nn.ModuleList([nn.ModuleList([ConvBlock(7), ConvBlock(7)]), nn.ModuleList([ConvBlock(7)])])
        self.head = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    # Untied: several policies here put the embedding and the head in different units, and a weight
    # tied across units is still refused at construction (pytorch#77724).
    config = transformers.GPT2Config(vocab_size=37, n_positions=16, n_embd=10, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _model(name):
    if name == "gpt":
        return make_gpt(), Block
    if name == "cnn":
        torch.manual_seed(0)
        return ConvNet(), ConvBlock
    model = _gpt2()
    return model, type(model.transformer.h[0])


def _policy(api, name, layer_cls):
    """The policy ``name`` built from ``api`` (fsdp1.wrap or torch's), the same arguments for both."""
    if name == "always":
        return api.always_wrap_policy
    if name == "lambda":
        return functools.partial(api.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, (nn.Linear, nn.Conv2d)))
    if name == "transformer":
        return functools.partial(api.transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
    if name == "size_based":
        return functools.partial(api.size_based_auto_wrap_policy, min_num_params=150)
    if name == "module":
        return api.ModuleWrapPolicy({layer_cls, nn.LayerNorm})
    strategies = fsdp1.ShardingStrategy if api is fsdp1_wrap else torch.distributed.fsdp.ShardingStrategy

    def custom(module):
        if isinstance(module, layer_cls):
            return {"sharding_strategy": strategies.SHARD_GRAD_OP}
        return isinstance(module, nn.Linear)

    return api.CustomPolicy(custom)


def _units(model, fsdp_cls):
    """Clean path and sharding strategy of every unit."""
    return sorted((clean_fqn(name), unit.sharding_strategy.name) for name, unit in model.named_modules() if isinstance(unit, fsdp_cls))


def _input(model_name, step):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if model_name == "cnn":
        return (torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(10 * step + rank)),)
    return batch(step, rank, world_size)


def _loss(model_name, model, step):
    if model_name == "cnn":
        return model(*_input(model_name, step)).square().mean()
    inputs, targets = _input(model_name, step)
    if model_name == "hf_gpt2":
        return model(input_ids=inputs, labels=targets).loss
    return lm_loss(model, inputs, targets)


def _wrap_and_train(model_name, policy_name):
    wrapped = []
    for fsdp_cls, api, extra in ((fsdp1.FullyShardedDataParallel, fsdp1_wrap, {}), (TorchFSDP, torch_wrap, {"device_id": torch.device("cpu")})):
        model, layer_cls = _model(model_name)
        wrapped.append(fsdp_cls(model, auto_wrap_policy=_policy(api, policy_name, layer_cls), **extra))
    units = [_units(m, cls) for m, cls in zip(wrapped, (fsdp1.FullyShardedDataParallel, TorchFSDP))]
    losses = []
    for model in wrapped:
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses.append([])
        for step in range(2):
            loss = _loss(model_name, model, step)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses[-1].append(loss.item())
    return units, losses


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", ["gpt", "cnn", "hf_gpt2"])
def test_policy_makes_the_units_torch_makes(model, policy):
    if model == "hf_gpt2":
        pytest.importorskip("transformers")
    (ours, theirs), (our_losses, their_losses) = run_on_ranks(2, _wrap_and_train, model, policy)[0]
    assert ours == theirs
    assert len(ours) > 1
    assert our_losses == their_losses  # bitwise


# ---------------------------------------------------------------------------------------------- manual wrapping
class ManuallyWrapped(nn.Module):
    """Wraps its own layers with ``wrap()`` as it builds them, one with an override."""

    def __init__(self, api, strategies) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = api.wrap(nn.Linear(4, 6))
        self.second = api.wrap(nn.Linear(6, 6), sharding_strategy=strategies.SHARD_GRAD_OP)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.second(self.first(x))))


def _manual():
    results = []
    for fsdp_cls, api, strategies, extra in (
        (fsdp1.FullyShardedDataParallel, fsdp1_wrap, fsdp1.ShardingStrategy, {}),
        (TorchFSDP, torch_wrap, torch.distributed.fsdp.ShardingStrategy, {"device_id": torch.device("cpu")}),
    ):
        with api.enable_wrap(wrapper_cls=fsdp_cls, **extra):
            model = fsdp_cls(ManuallyWrapped(api, strategies), **extra)
        outside = api.wrap(nn.Linear(2, 2))  # a no-op outside the context
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        results.append((_units(model, fsdp_cls), type(outside).__name__, model(x).sum().item()))
    return results


def test_enable_wrap_and_wrap_match_torch():
    ours, theirs = run_on_ranks(2, _manual)[0]
    assert ours == theirs
    assert ours[0] == [("", "FULL_SHARD"), ("first", "FULL_SHARD"), ("second", "SHARD_GRAD_OP")]


def test_nested_enable_wrap_is_refused():
    with fsdp1_wrap.enable_wrap(wrapper_cls=fsdp1.FullyShardedDataParallel):
        with pytest.raises(NotImplementedError, match="cannot be nested"):
            with fsdp1_wrap.enable_wrap(wrapper_cls=fsdp1.FullyShardedDataParallel):
                pass
    assert fsdp1_wrap.wrap(nn.Linear(1, 1)).__class__ is nn.Linear  # the context is gone


# ---------------------------------------------------------------------------------------------- FSDP(FSDP(m))
def _wrap_twice_nested(strategy, use_orig_params):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    nested = build(base, lambda m: fsdp1.FullyShardedDataParallel(
        wrap_fsdp1(m, strategy, use_orig_params), sharding_strategy=fsdp1.ShardingStrategy[strategy],
        use_orig_params=use_orig_params))
    once, ddp = build(base, lambda m: wrap_fsdp1(m, strategy, use_orig_params)), build(base, DDP)
    losses = [train(m, 4, world_size, rank) for m in (nested, once, ddp)]
    return losses, max_relative_error(fsdp1_full_params(nested), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_a_unit_around_a_unit_trains_like_one_wrap(strategy, use_orig_params):
    for (nested, once, ddp), error in run_on_ranks(2, _wrap_twice_nested, strategy, use_orig_params):
        assert nested == once
        assert relative_errors(nested, ddp) <= TOLERANCE
        assert error <= TOLERANCE


# ------------------------------------------------------------------- the private helpers of torch's wrap module, and torch's policy objects
class Checkpointed(nn.Module):
    """A wrapper of the kind clients pass to ``_recursive_wrap`` (activation checkpointing)."""

    def __init__(self, module, **kwargs):
        super().__init__()
        self.inner = module
        self.kwargs = kwargs


def _tree():
    return nn.Sequential(
        nn.Linear(8, 8),
        nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.LayerNorm(4)),
        nn.Sequential(nn.Embedding(10, 8), nn.Linear(4, 4)),  # its embedding is the ignored module below
    )


def _policies(wrap):
    linear_or_norm = functools.partial(wrap._or_policy, policies=[
        functools.partial(wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.LayerNorm)),
        functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear}),
    ])
    return {
        "or": linear_or_norm,
        "module": functools.partial(wrap._module_wrap_policy, module_classes={nn.Embedding, nn.Sequential}),
        "individually": functools.partial(wrap._wrap_module_cls_individually, module_classes=[nn.ReLU]),
        "or_size": functools.partial(wrap._or_policy, policies=[
            functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=40),
            functools.partial(wrap._wrap_module_cls_individually, module_classes=[nn.LayerNorm]),
        ]),
    }


@pytest.mark.parametrize("policy", ["or", "module", "individually", "or_size"])
def test_private_wrap_helpers_decide_and_wrap_as_torchs(policy):
    from torch.distributed.fsdp import wrap as torch_wrap

    ours, theirs = _policies(fsdp1.wrap)[policy], _policies(torch_wrap)[policy]
    for module in _tree().modules():
        for recurse in (True, False):
            for numel in (0, 40, 1000):
                assert ours(module=module, recurse=recurse, nonwrapped_numel=numel) == \
                    theirs(module=module, recurse=recurse, nonwrapped_numel=numel)
    for only_wrap_children in (False, True):
        results = []
        for wrap, chosen in ((fsdp1.wrap, ours), (torch_wrap, theirs)):
            root = _tree()
            ignored = {root[2][0]}
            wrapped, numel = wrap._recursive_wrap(root, chosen, Checkpointed, ignored, set(root[2][0].parameters()),
                                                  only_wrap_children=only_wrap_children, tag=1)
            results.append((repr(wrapped), numel))
        assert results[0] == results[1]


def test_recursive_wrap_refuses_a_tree_already_wrapped_as_torchs():
    from torch.distributed.fsdp import wrap as torch_wrap

    for wrap in (fsdp1.wrap, torch_wrap):
        root = _tree()
        root[0] = Checkpointed(root[0])
        with pytest.raises(AssertionError, match="already wrapped by"):
            wrap._recursive_wrap(root, wrap.always_wrap_policy, Checkpointed, set(), set())


def _torchs_policy_objects_and_ignored_numel():
    """fsdp1's class given torch's policy objects (what a client under ``use_as_torch_fsdp`` passes),
    and a size-based policy that must not count ignored parameters, wraps as torch's does."""
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp import wrap as torch_wrap

    policies = [
        torch_wrap.CustomPolicy(lambda m: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP} if isinstance(m, nn.Linear) else False),
        torch_wrap.ModuleWrapPolicy({nn.Sequential}),
        functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=60),
    ]
    structures = []
    for policy in policies:
        seen = []
        for name in IMPLEMENTATIONS:
            api, kwargs = fsdp_api(name)
            torch.manual_seed(0)
            root = _tree()
            model = api.FullyShardedDataParallel(root, auto_wrap_policy=policy, ignored_modules=[root[2][0]], **kwargs)
            units = api.FullyShardedDataParallel.fsdp_modules(model)
            seen.append((repr(model), [unit.sharding_strategy.name for unit in units]))
        structures.append(seen)
    return structures


def test_torchs_policy_objects_and_ignored_parameters_plan_the_same_units():
    for structures in run_on_ranks(2, _torchs_policy_objects_and_ignored_numel):
        for theirs, ours in structures:
            assert ours == theirs
