"""Tests corners of torch FSDP1's surface that scripts written for it reach, by running the same code
under torch's FSDP1 and under fsdp1 and comparing the outcome (a value, an exception type, a
warning category): the older optimizer-state loads without ``optim=``, ignoring the wrapped module
itself, the private helpers of torch's ``wrap`` module, the exception types of misused
``summon_full_params`` / ``apply`` / ``ignored_modules`` / state-dict configs / ``clip_grad_norm_``
/ auto-wrapping, ``_assert_state``, and ``ShardedGradScaler`` under ``use_as_torch_fsdp``."""

import copy
import functools
import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp1

from _harness import run_on_ranks
from _models import adam, fsdp1_full_params, make_gpt, torch_fsdp_full_params, train_steps, wrap_fsdp1, wrap_torch_fsdp

IMPLEMENTATIONS = ("torch", "fsdp1")


def _api(name):
    """The package a script imports as ``fsdp``, and the constructor arguments CPU needs there."""
    if name == "torch":
        import torch.distributed.fsdp as torch_fsdp
        import torch.distributed.fsdp.wrap  # noqa: F401 - torch_fsdp.wrap

        return torch_fsdp, {"device_id": torch.device("cpu")}
    return fsdp1, {}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(self.a(x))


def _outcome(call):
    """``call()``'s exception type name (None if it returns) and the warning categories it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
            raised = None
        except Exception as error:  # noqa: BLE001 - the type is the result
            raised = type(error).__name__
    return raised, sorted({w.category.__name__ for w in caught})


def _same(a, b):
    """Equal structure and values, tensors bitwise."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# ------------------------------------------------------------------- older optimizer loads without optim=
def _legacy_loads_without_optim(use_orig_params):
    """fsdp1 trains and saves a FULL optimizer dict; each implementation loads it into a fresh model
    through the older functions with no optimizer (the order of ``model.parameters()``), loads the
    result into Adam on ``model.parameters()`` and steps once."""
    rank = dist.get_rank()
    trained = wrap_fsdp1(make_gpt(), use_orig_params=use_orig_params)
    optim = adam(trained.parameters())
    train_steps(trained, optim, 0, 2)
    full = fsdp1.FullyShardedDataParallel.full_optim_state_dict(trained, optim, rank0_only=False)
    model_state = trained.state_dict()
    results = {}
    for name, wrap, full_params in (("torch", wrap_torch_fsdp, torch_fsdp_full_params), ("fsdp1", wrap_fsdp1, fsdp1_full_params)):
        fsdp = _api(name)[0].FullyShardedDataParallel
        fresh = wrap(make_gpt(seed=5), use_orig_params=use_orig_params)
        fresh.load_state_dict(model_state)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sharded = fsdp.shard_full_optim_state_dict(copy.deepcopy(full), fresh)
            scattered = fsdp.scatter_full_optim_state_dict(copy.deepcopy(full) if rank == 0 else None, fresh)
        fresh_optim = adam(fresh.parameters())
        fresh_optim.load_state_dict(sharded)
        train_steps(fresh, fresh_optim, 2, 1)
        warned = [(w.category.__name__, "is being deprecated and is replaced by" in str(w.message), w.filename == __file__)
                  for w in caught]
        results[name] = (sharded, scattered, full_params(fresh), warned)
    return results


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_shard_and_scatter_full_optim_state_dict_without_optim_give_torchs_dict(use_orig_params):
    for results in run_on_ranks(2, _legacy_loads_without_optim, use_orig_params):
        (theirs_sharded, theirs_scattered, theirs_params, theirs_warned) = results["torch"]
        (ours_sharded, ours_scattered, ours_params, ours_warned) = results["fsdp1"]
        assert _same(ours_sharded, theirs_sharded) and _same(ours_scattered, theirs_scattered)
        assert _same(ours_params, theirs_params)  # after a step from the loaded state
        assert ours_warned == theirs_warned == [("FutureWarning", True, True)] * 2


# ------------------------------------------------------------------- ignoring the wrapped module itself
def _ignore_the_wrapped_module():
    results = {}
    for name in IMPLEMENTATIONS:
        api, kwargs = _api(name)
        torch.manual_seed(0)
        net = Net()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = api.FullyShardedDataParallel(net, ignored_modules=[net], **kwargs)
        torch.manual_seed(dist.get_rank())  # each rank its own batch: ignored gradients stay local
        model(torch.randn(2, 4)).sum().backward()
        params = [(fqn, p.detach().clone(), p.grad.clone()) for fqn, p in model.named_parameters()]
        warned = [(w.category.__name__, "Trying to ignore the top-level module" in str(w.message)) for w in caught]
        results[name] = (warned, params, len(api.FullyShardedDataParallel.fsdp_modules(model)))
    return results


def test_ignoring_the_wrapped_module_warns_and_leaves_every_parameter_local():
    for results in run_on_ranks(2, _ignore_the_wrapped_module):
        assert _same(results["fsdp1"], results["torch"])
        assert results["fsdp1"][0] == [("UserWarning", True)]


# ------------------------------------------------------------------- the private helpers of torch's wrap module
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
            api, kwargs = _api(name)
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


def test_use_as_torch_fsdp_puts_fsdp1s_sharded_grad_scaler_at_torchs_paths_and_back():
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.sharded_grad_scaler as torch_scaler_module

    original = torch_scaler_module.ShardedGradScaler
    exported = hasattr(torch_fsdp, "ShardedGradScaler")
    with fsdp1.use_as_torch_fsdp():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        assert ShardedGradScaler is fsdp1.sharded_grad_scaler.ShardedGradScaler
        assert not exported or torch_fsdp.ShardedGradScaler is ShardedGradScaler
    assert torch_scaler_module.ShardedGradScaler is original
    assert hasattr(torch_fsdp, "ShardedGradScaler") == exported


# ------------------------------------------------------------------- exception types of misuse
class SummonsInside(nn.Module):
    """Calls ``summon_full_params`` on its own root from its forward, or from a gradient hook in
    backward (on an intermediate tensor, so that the root's backward has begun)."""

    def __init__(self, where):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.where = where
        self.root = []

    def summon(self, grad=None):
        with type(self.root[0]).summon_full_params(self.root[0]):
            return grad

    def forward(self, x):
        if self.where == "forward":
            self.summon()
        hidden = self.l1(x)
        if self.where == "backward":
            hidden.register_hook(self.summon)
        return self.l2(hidden)


def _with_units_inside(wrap):
    """A root whose inner unit has run one step (so it is no root), and a plain model holding a unit."""
    with_inner = Net()
    with_inner.a = wrap(with_inner.a)
    nested = wrap(with_inner)
    nested(torch.ones(2, 4)).sum().backward()
    already_wrapped = Net()
    already_wrapped.a = wrap(already_wrapped.a)
    return nested, already_wrapped


def _misuse_outcomes():
    outcomes = {}
    for name in IMPLEMENTATIONS:
        api, kwargs = _api(name)
        fsdp = api.FullyShardedDataParallel

        def build(module=None, **extra):
            torch.manual_seed(0)
            return fsdp(Net() if module is None else module, **kwargs, **extra)

        def inside_summon(model, body, **summon_kwargs):
            with fsdp.summon_full_params(model, **summon_kwargs):
                body()

        model = build()
        no_shard = build(sharding_strategy=api.ShardingStrategy.NO_SHARD)
        nested, already_wrapped = _with_units_inside(build)
        cases = {
            "apply inside summon_full_params": lambda: inside_summon(model, lambda: model.apply(lambda m: None)),
            "ignored_modules holding an int": lambda: build(ignored_modules=[3]),
            "ignored_modules holding a parameter": lambda: build(ignored_modules=[nn.Parameter(torch.ones(2))]),
            "ignored_states holding a string": lambda: build(ignored_states=["a"]),
            "ignored_modules not iterable": lambda: build(ignored_modules=5),
            "rank0_only with writeback": lambda: inside_summon(model, lambda: None, rank0_only=True, writeback=True),
            "rank0_only with writeback, NO_SHARD": lambda: inside_summon(no_shard, lambda: None, rank0_only=True, writeback=True),
            "summon inside summon": lambda: inside_summon(model, lambda: inside_summon(model, lambda: None)),
            "forward inside summon": lambda: inside_summon(model, lambda: model(torch.ones(2, 4))),
            "state_dict_type with another config": lambda: fsdp.set_state_dict_type(
                model, api.StateDictType.SHARDED_STATE_DICT, api.FullStateDictConfig()),
            "param_init_fn not callable on meta": lambda: build(_meta_net(), param_init_fn=3),
            "clip_grad_norm_ on an inner unit": lambda: nested.module.a.clip_grad_norm_(1.0),
            "auto-wrapping a module holding a unit": lambda: build(
                already_wrapped, auto_wrap_policy=api.wrap.ModuleWrapPolicy({nn.Linear})),
        }
        for where in ("forward", "backward"):
            module = SummonsInside(where)
            root = build(module)
            module.root.append(root)
            cases[f"summon_full_params in {where}"] = functools.partial(lambda r: r(torch.ones(2, 4)).sum().backward(), root)
        outcomes[name] = {case: _outcome(call) for case, call in cases.items()}
    return outcomes


def _meta_net():
    with torch.device("meta"):
        return Net()


def test_misuse_raises_torchs_exception_types():
    for outcomes in run_on_ranks(2, _misuse_outcomes):
        for case, theirs in outcomes["torch"].items():
            assert outcomes["fsdp1"][case][0] == theirs[0], case
            assert theirs[0] is not None, case


def _messages_keep_torchs_phrases():
    """fsdp1's own messages, which name the unit and the fix, also carry the phrase torch's carry."""
    torch.manual_seed(0)
    fsdp = fsdp1.FullyShardedDataParallel
    model, already_wrapped = _with_units_inside(fsdp)
    plain = Net()
    calls = [
        lambda: fsdp.set_state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT, fsdp1.FullStateDictConfig()),
        lambda: model.module.a.clip_grad_norm_(1.0),
        lambda: fsdp(already_wrapped, auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({nn.Linear})),
        lambda: fsdp(Net(), ignored_modules=list(Net().a.parameters())),
        lambda: fsdp(Net(), ignored_states=[plain.b, plain.b.weight]),
        lambda: fsdp(Net(), ignored_modules=[plain.b], ignored_states=[plain.b]),
    ]
    messages = []
    for call in calls:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - the message is the result
            messages.append(str(error))
    return messages


def test_messages_keep_torchs_phrases():
    """The phrases, as the regular expressions torch's own tests match them with."""
    patterns = [
        "Expected state_dict_config of type", "should only be called on the root FSDP instance",
        "FSDP auto wrapping requires modules to not already have FSDP applied but found .* in",
        r"ignored_modules expects nn.Module list elements but got types \[<class 'torch.nn.parameter.Parameter'>\]",
        r"ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
        r"\[<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.parameter.Parameter'>\]",
        "Cannot pass both ignored_modules and ignored_states at the same time",
    ]
    for messages in run_on_ranks(2, _messages_keep_torchs_phrases):
        assert len(messages) == len(patterns)
        for message, pattern in zip(messages, patterns):
            assert message.startswith("fsdp1: ")
            assert re.search(pattern, message)
            assert "_fsdp_wrapped_module" not in message


def _offload_to_cpu_on_no_shard():
    """A documented difference: torch's refuses ``offload_to_cpu=True`` for a NO_SHARD unit even on
    CPU; fsdp1 gives the full parameters, as for the other strategies."""
    found = {}
    for name in IMPLEMENTATIONS:
        api, kwargs = _api(name)
        torch.manual_seed(0)
        model = api.FullyShardedDataParallel(Net(), sharding_strategy=api.ShardingStrategy.NO_SHARD, **kwargs)
        try:
            with api.FullyShardedDataParallel.summon_full_params(model, offload_to_cpu=True):
                found[name] = [(n.replace("_fsdp_wrapped_module.", ""), p.detach().clone()) for n, p in model.named_parameters()]
        except NotImplementedError:
            found[name] = "NotImplementedError"
    torch.manual_seed(0)
    return found, list(Net().named_parameters())


def test_offload_to_cpu_on_a_no_shard_unit_works_where_torchs_refuses():
    for found, plain in run_on_ranks(2, _offload_to_cpu_on_no_shard):
        assert found["torch"] == "NotImplementedError"
        assert [n for n, _ in found["fsdp1"]] == [n for n, _ in plain]
        assert all(torch.equal(ours, theirs) for (_, ours), (_, theirs) in zip(found["fsdp1"], plain))


# ------------------------------------------------------------------- _assert_state
def _assert_state_outcomes():
    from torch.distributed.fsdp._common_utils import TrainingState as TorchState

    from fsdp1._engine.common import TrainingState as OurState

    results = {}
    for name in IMPLEMENTATIONS:
        api, kwargs = _api(name)
        torch.manual_seed(0)
        model = api.FullyShardedDataParallel(Net(), **kwargs)
        model(torch.ones(2, 4)).sum().backward()
        outcomes = [_outcome(lambda: model._assert_state(TorchState.IDLE)),
                    _outcome(lambda: model._assert_state([TorchState.FORWARD_BACKWARD, TorchState.SUMMON_FULL_PARAMS])),
                    _outcome(lambda: model._assert_state(TorchState.FORWARD_BACKWARD))]
        if name == "fsdp1":
            outcomes.append(_outcome(lambda: model._assert_state(OurState.IDLE)))
        with api.FullyShardedDataParallel.summon_full_params(model):
            outcomes += [_outcome(lambda: model._assert_state(TorchState.SUMMON_FULL_PARAMS)),
                         _outcome(lambda: model._assert_state(TorchState.IDLE))]
        results[name] = outcomes
    return results


def test_assert_state_takes_torchs_training_states_and_raises_its_type():
    for results in run_on_ranks(2, _assert_state_outcomes):
        ok, failed = (None, []), ("ValueError", [])
        assert results["torch"] == [ok, failed, failed, ok, failed]
        assert results["fsdp1"] == [ok, failed, failed, ok, ok, failed]


# ------------------------------------------------------------------- runtime behaviours torch's tests rely on
def _strategy(name, strategy):
    fsdp, _ = _api(name)
    return fsdp.ShardingStrategy[strategy]


def _wrapped(name, module, **kwargs):
    fsdp, cpu = _api(name)
    return fsdp.FullyShardedDataParallel(module, **cpu, **kwargs)


def _full_params(name, model):
    fsdp, _ = _api(name)
    with fsdp.FullyShardedDataParallel.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sgd_steps(model, steps=2):
    """Losses of ``steps`` SGD steps on rank-dependent inputs."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        loss = model(x).square().sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


class SharedModule(nn.Module):
    """One Linear registered under two names (``b`` is ``a``), used twice in forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.b(torch.relu(self.a(x))))


def _train_shared_module(use_orig_params):
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = _wrapped(name, SharedModule(), use_orig_params=use_orig_params)
        losses = _sgd_steps(model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        results[name] = (losses, state, _full_params(name, model))
    return results


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_module_registered_under_two_names_trains_and_saves_as_torchs(use_orig_params):
    """``m.b = m.a``: torch's wraps it, and its state dict has both names; fsdp1 crashed (KeyError)."""
    for result in run_on_ranks(2, _train_shared_module, use_orig_params):
        assert list(result["fsdp1"][1]) == list(result["torch"][1]) == ["a.weight", "a.bias", "b.weight", "b.bias", "head.weight", "head.bias"]
        assert _same(result["fsdp1"], result["torch"])


def _summon_between_forward_and_backward(strategy, use_orig_params):
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = _wrapped(name, Net(), sharding_strategy=_strategy(name, strategy), use_orig_params=use_orig_params)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4) + dist.get_rank()).sum()
        with _api(name)[0].FullyShardedDataParallel.summon_full_params(model):
            pass
        loss.backward()
        optim.step()
        results[name] = _full_params(name, model)
    return results


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_summon_full_params_between_forward_and_backward_leaves_the_backward_intact(strategy, use_orig_params):
    """fsdp1's write-back bumped the version counter autograd checks, so the backward failed."""
    for result in run_on_ranks(2, _summon_between_forward_and_backward, strategy, use_orig_params):
        assert _same(result["fsdp1"], result["torch"])


def _replace_original_parameters(which, how):
    """use_orig_params: a parameter's variable or ``.data`` replaced between steps is written back
    (same shape) or refused (another shape), as torch's does."""
    rank = dist.get_rank()
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = _wrapped(name, Net(), use_orig_params=True)
        linear = model.module.a if which == "a" or which == "by rank" and rank == 0 else model.module.b
        shape = linear.weight.shape if how != "shape" else torch.Size([n + 1 for n in linear.weight.shape])
        new = nn.Parameter(torch.full(shape, 2.0 + rank))
        if how == "data":
            linear.weight.data = new
        else:
            linear.weight = new

        def summon_and_train(name=name, model=model):
            full = _full_params(name, model)
            return full, _sgd_steps(model)

        raised, _ = _outcome(summon_and_train)
        results[name] = (raised, None if raised else summon_and_train())
    return results


@pytest.mark.parametrize("which, how", [("a", "variable"), ("a", "data"), ("b", "variable"), ("b", "data"),
                                        ("by rank", "shape")])
def test_original_parameters_replaced_between_steps_are_written_back_or_refused(which, how):
    """fsdp1 kept the old values without a word; torch writes the new ones into the shard, and a new
    shape raises ``RuntimeError`` ("Cannot writeback"). Each rank replaces a weight it holds part of
    in the last case: torch's checks only those, and a rank holding none would go on alone."""
    for result in run_on_ranks(2, _replace_original_parameters, which, how):
        assert result["torch"][0] == ("RuntimeError" if how == "shape" else None)
        assert _same(result["fsdp1"], result["torch"])


def _replace_after_a_forward_without_backward():
    """A forward with grad and no backward leaves the root gathered; a parameter replaced then is
    still taken: the next forward computes with it (as the plain model would) and it is in the
    shard afterwards, as under torch's."""
    results = {}
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = _wrapped(name, Net(), use_orig_params=True)
        model(x)
        model.module.a.weight = nn.Parameter(torch.full_like(model.module.a.weight, 0.25))
        loss = model(x).sum()
        loss.backward()
        results[name] = loss.detach(), _full_params(name, model)
    torch.manual_seed(0)
    plain = Net()
    with torch.no_grad():
        plain.a.weight.fill_(0.25)
    results["plain"] = plain(x).sum().detach()
    return results


def test_a_parameter_replaced_after_a_forward_without_backward_is_taken():
    """fsdp1 put the old parameter back when it resharded, dropping the new one; torch's takes it
    into the shard (and computes that next forward with the old values, where fsdp1 uses the new)."""
    for result in run_on_ranks(2, _replace_after_a_forward_without_backward):
        assert _same(result["fsdp1"][1], result["torch"][1])
        assert torch.equal(result["fsdp1"][1]["a.weight"], torch.full((4, 4), 0.25))
        assert torch.equal(result["fsdp1"][0], result["plain"])


def _change_between_forward_and_backward(how):
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = _wrapped(name, Net(), sharding_strategy=_strategy(name, "SHARD_GRAD_OP"), use_orig_params=True,
                         auto_wrap_policy=_api(name)[0].wrap.ModuleWrapPolicy({nn.Linear}))
        loss = model(torch.randn(2, 4)).sum()
        if how == "data":
            model.a.weight.data = model.a.weight.clone()
        else:
            model.a.module.weight = nn.Parameter(model.a.weight.clone())
        results[name] = _outcome(loss.backward)[0]
    return results


@pytest.mark.parametrize("how", ["data", "variable"])
def test_a_parameter_changed_between_forward_and_backward_is_refused(how):
    """SHARD_GRAD_OP keeps the unit gathered for backward, so torch's refuses the change
    (``AssertionError``); fsdp1 went on with the gathered values."""
    for result in run_on_ranks(2, _change_between_forward_and_backward, how):
        assert result == {"torch": "AssertionError", "fsdp1": "AssertionError"}


def _grads_inside_no_sync(strategy):
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = _wrapped(name, Net(), sharding_strategy=_strategy(name, strategy), use_orig_params=True)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        with model.no_sync():
            for micro_batch in range(2):
                model(torch.randn(2, 4) + dist.get_rank()).sum().backward()
                seen.append([p.grad.clone() for p in model.parameters()])
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        results[name] = seen, _full_params(name, model)
    return results


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_inside_no_sync_the_original_parameters_show_the_local_unsharded_gradient(strategy):
    """Gradient logging or clipping between micro-batches reads ``p.grad``: torch's shows the local
    accumulated gradient in the parameter's full shape there; fsdp1 showed None."""
    for result in run_on_ranks(2, _grads_inside_no_sync, strategy):
        assert _same(result["fsdp1"], result["torch"])
        assert result["fsdp1"][0][0][0].shape == (4, 4)


def _shard_grad_op_inside_no_sync():
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = _wrapped(name, Net(), sharding_strategy=_strategy(name, "SHARD_GRAD_OP"))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.no_sync():
            model(torch.randn(2, 4) + dist.get_rank()).sum().backward()
        flat_numel = next(model.parameters()).numel()
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        results[name] = flat_numel, _full_params(name, model)
    return results


def test_shard_grad_op_inside_no_sync_keeps_the_unsharded_flat_parameter_and_trains_as_torchs():
    """A documented difference: both keep the unsharded buffer for the next micro-batch (no gather);
    fsdp1's flat parameter keeps pointing at it, torch's points at the shard."""
    for result in run_on_ranks(2, _shard_grad_op_inside_no_sync):
        assert result["fsdp1"][0] == 36  # 4 * 4 + 4 + 4 * 3 + 3 = 35 elements, padded: both ranks' shards
        assert result["torch"][0] == 18  # this rank's shard of the padded 36
        assert _same(result["fsdp1"][1], result["torch"][1])


class SetattrLinear(nn.Module):
    """Counts assignments through its own ``__setattr__`` (a cache keyed on assignment would)."""

    def __init__(self):
        object.__setattr__(self, "assignments", 0)
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.weight

    def __setattr__(self, name, value):
        object.__setattr__(self, "assignments", self.assignments + 1)
        super().__setattr__(name, value)


def _setattr_calls(use_orig_params, unsafe):
    if unsafe:
        os.environ["FSDP_USE_UNSAFE_SETATTR"] = "1"
    try:
        results = {}
        for name in IMPLEMENTATIONS:
            torch.manual_seed(0)
            module = SetattrLinear()
            model = _wrapped(name, module, use_orig_params=use_orig_params)
            before = module.assignments
            output = model(torch.ones(2, 4))
            results[name] = module.assignments - before, output.detach()
        return results
    finally:
        os.environ.pop("FSDP_USE_UNSAFE_SETATTR", None)


@pytest.mark.parametrize("unsafe", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_forward_assigns_views_through_a_modules_own_setattr(use_orig_params, unsafe):
    """torch's calls the override once per forward without use_orig_params and twice with it, and
    not at all under ``FSDP_USE_UNSAFE_SETATTR=1``."""
    for result in run_on_ranks(2, _setattr_calls, use_orig_params, unsafe):
        assert result["torch"][0] == (0 if unsafe else 2 if use_orig_params else 1)
        assert _same(result["fsdp1"], result["torch"])


@pytest.mark.parametrize("size", [1, 2])
def test_a_process_group_object_without_init_process_group_is_taken_as_torchs(size):
    """A stand-in group (torch's own wrap-policy tests use one) on a process that never called
    ``init_process_group``: the same units, rank, world size and shards as torch's, and on one rank
    the same outputs (a stand-in of two ranks cannot gather: it only plans)."""
    from torch.testing._internal.common_fsdp import DummyProcessGroup

    assert not dist.is_initialized()
    seen = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        fsdp, cpu = _api(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the world size of 1 switches to NO_SHARD, with a warning
            model = fsdp.FullyShardedDataParallel(
                nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), process_group=DummyProcessGroup(rank=0, size=size),
                auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Linear}), **cpu)
        units = [(m.rank, m.world_size) for m in model.modules() if isinstance(m, fsdp.FullyShardedDataParallel)]
        shards = [p.detach().clone() for p in model.parameters()]
        if size == 1:
            output = model(torch.ones(3, 4))
            output.sum().backward()
            seen[name] = units, shards, output, [p.grad for p in model.parameters()]
        else:
            seen[name] = units, shards
    assert _same(seen["fsdp1"], seen["torch"])


class TutorialNet(nn.Module):
    """The model of PyTorch's FSDP tutorial (MNIST), as written there."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        x = self.dropout1(torch.nn.functional.max_pool2d(x, 2))
        x = self.dropout2(torch.relu(self.fc1(torch.flatten(x, 1))))
        return torch.nn.functional.log_softmax(self.fc2(x), dim=1)


def _mnist_tutorial(with_policy):
    """The tutorial's wrapping, training and test loops on MNIST-shaped random data. Its spawned
    workers are not seeded alike, so each rank builds other initial values (seeded by rank here)."""
    rank = dist.get_rank()
    results = {}
    for name in IMPLEMENTATIONS:
        fsdp, cpu = _api(name)
        torch.manual_seed(rank + 1)
        model = TutorialNet()
        policy = functools.partial(fsdp.wrap.size_based_auto_wrap_policy, min_num_params=100) if with_policy else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = fsdp.FullyShardedDataParallel(model, auto_wrap_policy=policy, **cpu)
        optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        data = torch.Generator().manual_seed(rank)
        train_loss, test_loss = torch.zeros(2), torch.zeros(3)
        for epoch in range(2):
            model.train()
            for _ in range(2):
                images, target = torch.randn(4, 1, 28, 28, generator=data), torch.randint(0, 10, (4,), generator=data)
                optimizer.zero_grad()
                loss = torch.nn.functional.nll_loss(model(images), target, reduction="sum")
                loss.backward()
                optimizer.step()
                train_loss += torch.tensor([loss.item(), len(images)])
            dist.all_reduce(train_loss)
            model.eval()
            with torch.no_grad():
                images, target = torch.randn(4, 1, 28, 28, generator=data), torch.randint(0, 10, (4,), generator=data)
                output = model(images)
                correct = output.argmax(dim=1, keepdim=True).eq(target.view_as(output.argmax(dim=1, keepdim=True))).sum()
                test_loss += torch.tensor([torch.nn.functional.nll_loss(output, target, reduction="sum").item(), correct.item(), 4])
            dist.all_reduce(test_loss)
            scheduler.step()
        dist.barrier()
        states = model.state_dict()
        warned = [str(w.message) for w in caught if "other values on rank" in str(w.message)]
        results[name] = train_loss, test_loss, states, bool(warned)
    return results


@pytest.mark.parametrize("with_policy", [False, True])
def test_the_fsdp_tutorials_mnist_code_runs_as_written_and_equals_torchs(with_policy):
    """``model = FSDP(Net().to(rank))`` (and with its size-based policy) with ranks seeded apart: torch's
    FSDP1 trains the mix of the ranks' draws, and so does fsdp1, bit for bit, after a warning that
    names the first differing parameter (it used to refuse)."""
    for result in run_on_ranks(2, _mnist_tutorial, with_policy):
        torch_loss, torch_test, torch_states, _ = result["torch"]
        loss, test, states, warned = result["fsdp1"]
        assert _same((loss, test, states), (torch_loss, torch_test, torch_states)) and warned


def _warnings_whose_claims_do_not_hold():
    """torch's FSDP1 warns that it will not gather a container's parameters (a ``ModuleList`` has no
    forward) and that a unit mixing frozen and trainable parameters costs gradient memory for the frozen
    ones. Neither holds for fsdp1, which says nothing: calls of the container's children gather (the
    children train like DDP's), and frozen parameters keep no gradient (tested in test_frozen_params)."""
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
