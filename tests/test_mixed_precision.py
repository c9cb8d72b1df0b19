"""Tests ``MixedPrecision`` against torch's FSDP1 running the same configuration on the same batches:
losses and parameters bit for bit (bf16 and fp16, every strategy, both use_orig_params), and each
field on its own with a check that fails if fsdp1 ignored it: the dtype the units compute in,
reduce in, hand the optimizer, cast inputs and buffers to, BatchNorm's full-precision units,
full-precision evaluation, and full-precision state dicts and ``summon_full_params``. Also the dtype
changed without ``MixedPrecision``: ``.to(torch.float64)`` or ``.double()`` after wrapping, before or
after a step, trains as the plain model converted alike. Under ``fully_shard``, a bf16
``MixedPrecisionPolicy`` (fsdp1's or torch's object) trains like torch's ``fully_shard``, keeping
parameters and gradients in fp32, and ``cast_forward_inputs`` casts the input of every module of a group
as torch's does."""

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import fsdp1

from _harness import run_on_ranks
from _models import (
    AveragedGrads,
    Block,
    batch,
    fsdp1_full_params,
    full_grads,
    fully_shard_of,
    lm_loss,
    make_gpt,
    make_mlp,
    max_relative_error,
    plain_params,
    relative_errors,
    run_both,
    same_tensors,
    sgd,
    shard_gpt,
    torch_fsdp_full_params,
    torchs_fully_shard,
    train,
    train_each,
    wrap_fsdp1,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
STEPS = 5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}


def _pair(base, wrap_classes=(Block,), strategy="FULL_SHARD", use_orig_params=False, **mp):
    """fsdp1 and torch's FSDP1 around copies of ``base`` with the same MixedPrecision (given by field)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    ours = fsdp1.FullyShardedDataParallel(
        copy.deepcopy(base), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy(set(wrap_classes)),
        sharding_strategy=fsdp1.ShardingStrategy[strategy], use_orig_params=use_orig_params,
        mixed_precision=fsdp1.MixedPrecision(**mp))
    theirs = TorchFSDP(
        copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy(set(wrap_classes)),
        sharding_strategy=ShardingStrategy[strategy], use_orig_params=use_orig_params,
        mixed_precision=TorchMixedPrecision(**mp), device_id=torch.device("cpu"))
    return ours, theirs


# ------------------------------------------------------------------------------ parity with torch
def _train_both(strategy, use_orig_params, param_dtype, reduce_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, theirs = _pair(make_gpt(), strategy=strategy, use_orig_params=use_orig_params,
                         param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    ours_losses, their_losses = train(ours, STEPS, world, rank), train(theirs, STEPS, world, rank)
    return ours_losses, their_losses, max_relative_error(fsdp1_full_params(ours), torch_fsdp_full_params(theirs))


@pytest.mark.parametrize("strategy, use_orig_params, param_dtype, reduce_dtype", [
    ("FULL_SHARD", False, "bf16", None),
    ("FULL_SHARD", True, "bf16", "fp32"),
    ("FULL_SHARD", False, "fp16", "fp32"),
    ("FULL_SHARD", True, None, "bf16"),
    ("SHARD_GRAD_OP", False, "fp16", None),
    ("SHARD_GRAD_OP", True, "bf16", None),
    ("NO_SHARD", False, "bf16", "fp32"),
    ("NO_SHARD", True, "fp16", None),
])
def test_training_matches_torch_fsdp1_bitwise(strategy, use_orig_params, param_dtype, reduce_dtype):
    for ours, theirs, error in run_on_ranks(2, _train_both, strategy, use_orig_params, param_dtype, reduce_dtype):
        assert ours == theirs
        assert error == 0.0


def _runs_per_configuration():
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, mp in {"fp32": {}, "bf16": dict(param_dtype=torch.bfloat16),
                     "bf16_reduce_fp32": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                     "reduce_bf16": dict(reduce_dtype=torch.bfloat16)}.items():
        ours, theirs = _pair(make_gpt(), **mp)
        losses = train(ours, 3, world, rank), train(theirs, 3, world, rank)
        results[name] = (losses, fsdp1_full_params(ours), torch_fsdp_full_params(theirs))
    return results


def test_param_and_reduce_dtype_each_change_the_numbers_as_torchs_do():
    """Four configurations train to four different sets of parameters, each torch's: a field ignored
    would make two of fsdp1's equal, or one differ from torch's."""
    for results in run_on_ranks(2, _runs_per_configuration):
        runs = list(results.values())
        for i, (_, params, _) in enumerate(runs):
            assert all(max_relative_error(params, other) > 0 for _, other, _ in runs[i + 1 :])
        for (ours, theirs), params, their_params in runs:
            assert ours == theirs
            assert max_relative_error(params, their_params) == 0.0


# ------------------------------------------------------------------------------ what computes in which dtype
class _DtypeProbe(nn.Module):
    """Records the dtype of its input and of its weight at each forward."""

    def __init__(self, features):
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.seen = []

    def forward(self, x):
        self.seen.append((x.dtype, self.linear.weight.dtype))
        return self.linear(x)


class _Probed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _DtypeProbe(6)
        self.outer = _DtypeProbe(6)

    def forward(self, x):
        return self.inner(self.outer(x).float())


def _dtypes_seen(cast_root, cast_inner):
    torch.manual_seed(0)
    base = _Probed()
    rows = []
    for model in _pair(base, wrap_classes=(_DtypeProbe,), param_dtype=torch.float16,
                       cast_root_forward_inputs=cast_root, cast_forward_inputs=cast_inner):
        try:
            model(torch.randn(2, 6)).sum().backward()
            error = None
        except RuntimeError as e:  # a module fed fp32 with fp16 weights
            error = "dtype" in str(e) or "type" in str(e)
        probes = [m for m in model.modules() if isinstance(m, _DtypeProbe)]
        rows.append(([p.seen for p in probes], error))
    return rows


@pytest.mark.parametrize("cast_root, cast_inner", [(True, False), (False, True), (True, True)])
def test_forward_inputs_are_cast_where_torchs_are(cast_root, cast_inner):
    for ours, theirs in run_on_ranks(2, _dtypes_seen, cast_root, cast_inner):
        assert ours == theirs
        seen, _ = ours
        assert all(weight == torch.float16 for probe in seen for _, weight in probe)
        assert seen[0][0][0] == (torch.float16 if cast_inner else torch.float32)  # inner unit's input


def _low_precision_grads(use_orig_params, strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    models = _pair(make_gpt(), strategy=strategy, use_orig_params=use_orig_params, param_dtype=torch.bfloat16,
                   reduce_dtype=torch.float32, keep_low_precision_grads=True)
    grads = []
    for model in models:
        optim = sgd(model.parameters())
        for step in range(3):
            lm_loss(model, *batch(step, rank, world)).backward()
            seen = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()
                    if p.grad is not None}
            optim.step()
            optim.zero_grad()
        grads.append(seen)
    return grads, max_relative_error(fsdp1_full_params(models[0]), torch_fsdp_full_params(models[1]))


@pytest.mark.parametrize("use_orig_params, strategy", [(False, "FULL_SHARD"), (True, "FULL_SHARD"), (False, "NO_SHARD")])
def test_keep_low_precision_grads_hands_the_optimizer_torchs_bf16_gradients(use_orig_params, strategy):
    for (ours, theirs), error in run_on_ranks(2, _low_precision_grads, use_orig_params, strategy):
        assert ours.keys() == theirs.keys()
        assert ours
        for name, grad in ours.items():
            # torch's leaves a unit that does not shard its gradient in reduce_dtype
            assert grad.dtype == theirs[name].dtype == (torch.float32 if strategy == "NO_SHARD" else torch.bfloat16), name
            assert torch.equal(grad, theirs[name]), name
        assert error == 0.0


# ------------------------------------------------------------------------------ buffers and BatchNorm
class _ScaledBlock(Block):
    """A block with a float buffer used in its forward and an integer one that must stay integer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.9, 1.1, 10))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.seen = []

    def forward(self, x):
        self.seen.append(self.scale.dtype)
        self.calls += 1
        return super().forward(x) * self.scale.to(x.dtype)


def _buffers(buffer_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    base.blocks = nn.Sequential(*[_ScaledBlock() for _ in range(2)])
    results = []
    for model in _pair(base, wrap_classes=(_ScaledBlock,), param_dtype=torch.bfloat16, buffer_dtype=DTYPES[buffer_dtype]):
        losses = train(model, 3, world, rank)
        seen = [m.seen for m in model.modules() if isinstance(m, _ScaledBlock)]
        state = {k: (v.dtype, v) for k, v in model.state_dict().items() if "scale" in k or "calls" in k}
        results.append((losses, seen, state))
    return results


@pytest.mark.parametrize("buffer_dtype", ["bf16", None])
def test_buffers_compute_in_buffer_dtype_and_save_in_their_own(buffer_dtype):
    for ours, theirs in run_on_ranks(2, _buffers, buffer_dtype):
        (losses, seen, state), (their_losses, their_seen, their_state) = ours, theirs
        assert losses == their_losses
        assert seen == their_seen
        assert {dtype for block in seen for dtype in block} == {DTYPES[buffer_dtype] or torch.float32}
        assert state.keys() == their_state.keys()
        assert len(state) == 4
        for key, (dtype, value) in state.items():
            assert dtype == their_state[key][0] == (torch.long if "calls" in key else torch.float32), key
            assert torch.equal(value, their_state[key][1]), key


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
                                      for _ in range(2)])
        self.head = nn.Linear(3 * 5 * 5, 4)

    def forward(self, x):
        return self.head(self.blocks(x).flatten(1))


def _batchnorm(classes_to_ignore):
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = _ConvNet()
    # Without the override BatchNorm computes in fp16 and needs its running statistics in fp16 too.
    extra = {} if classes_to_ignore is None else dict(_module_classes_to_ignore=classes_to_ignore, buffer_dtype=torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models = _pair(base, wrap_classes=(nn.Sequential,), param_dtype=torch.float16, **extra)
    results = []
    for model in models:
        optim = sgd(model.parameters())
        losses = []
        for step in range(3):
            gen = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(4, 3, 5, 5, generator=gen), torch.randint(0, 4, (4,), generator=gen)
            loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        batchnorm_units = [m for m in model.modules() if type(m).__name__ == "FullyShardedDataParallel"
                           and isinstance(m.module, nn.BatchNorm2d)]
        results.append((losses, len(batchnorm_units), [u.mixed_precision for u in batchnorm_units]))
    warned = sum("mixed precision disabled" in str(w.message) for w in caught)
    return results, warned


@pytest.mark.parametrize("classes_to_ignore", [None, ()])
def test_batchnorm_gets_a_full_precision_unit_as_in_torch(classes_to_ignore):
    for ((losses, units, precisions), (their_losses, their_units, _)), warned in run_on_ranks(2, _batchnorm, classes_to_ignore):
        assert losses == their_losses
        if classes_to_ignore is None:  # the default: BatchNorm in its own unit, without mixed precision
            assert units == their_units == 2
            assert precisions == [None, None]
            assert warned == 2
        else:
            assert units == their_units == 0
            assert warned == 0


# ------------------------------------------------------------------------------ full precision where asked
def _full_precision_views(use_orig_params):
    """After bf16 steps: the FULL state dict and summon_full_params show the fp32 parameters (not
    rounded to bf16), equal to torch's; training goes on unchanged afterwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, theirs = _pair(make_gpt(), use_orig_params=use_orig_params, param_dtype=torch.bfloat16)
    train(ours, 2, world, rank), train(theirs, 2, world, rank)
    ours_state, their_state = ours.state_dict(), theirs.state_dict()
    with fsdp1.FullyShardedDataParallel.summon_full_params(ours):  # clean names there, as torch's
        summoned = {n: p.detach().clone() for n, p in ours.named_parameters()}
    rounded = all(torch.equal(v, v.bfloat16().float()) for v in ours_state.values())
    after = train(ours, 2, world, rank), train(theirs, 2, world, rank)
    return ours_state, their_state, summoned, rounded, after


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_state_dict_and_summon_full_params_are_full_precision(use_orig_params):
    for ours, theirs, summoned, rounded, (after, their_after) in run_on_ranks(2, _full_precision_views, use_orig_params):
        assert ours.keys() == theirs.keys() == summoned.keys()
        for key, value in ours.items():
            assert value.dtype == torch.float32, key
            assert torch.equal(value, theirs[key]), key
            assert torch.equal(value, summoned[key]), key
        assert not rounded
        assert after == their_after


def _eval_in_full_precision():
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        base = make_gpt()
        base.blocks = nn.Sequential(*[_ScaledBlock() for _ in range(2)])
        models = _pair(base, wrap_classes=(_ScaledBlock,), param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
    results = []
    for model in models:
        losses = train(model, 2, world, rank)
        model.eval()
        with torch.no_grad():
            logits = model(batch(5, rank, world)[0])
        buffer_dtypes = {m.seen[-1] for m in model.modules() if isinstance(m, _ScaledBlock)}
        model.train()
        losses += train(model, 2, world, rank)
        results.append((losses, logits, buffer_dtypes))
    return results


def test_full_precision_evaluation_under_the_environment_variable():
    for (losses, logits, buffers), (their_losses, their_logits, their_buffers) in run_on_ranks(2, _eval_in_full_precision):
        assert logits.dtype == torch.float32
        assert torch.equal(logits, their_logits)
        assert buffers == their_buffers == {torch.float32}
        assert losses == their_losses


# ------------------------------------------------------------------------------ real model families
def _family_in_bf16(family, use_orig_params):
    from test_hf_models import _family, _train

    rank = dist.get_rank()
    base, block = _family(family)
    ours, theirs = _pair(base, wrap_classes=(block,), use_orig_params=use_orig_params, param_dtype=torch.bfloat16,
                         reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    losses = [_train(model, family, rank) for model in (ours, theirs)]
    ours_state, their_state = ours.state_dict(), theirs.state_dict()
    return losses, {k: torch.equal(v, their_state[k]) and v.dtype == their_state[k].dtype for k, v in ours_state.items()}


@pytest.mark.parametrize("family, use_orig_params", [("gpt2", False), ("llama_tied", True), ("bert", False),
                                                     ("t5", True), ("vit", False)])
def test_family_in_bf16_matches_torch_fsdp1(family, use_orig_params):
    pytest.importorskip("transformers")
    for (ours, theirs), equal in run_on_ranks(2, _family_in_bf16, family, use_orig_params):
        assert ours == theirs, [k for k, v in equal.items() if not v]
        assert all(equal.values()), [k for k, v in equal.items() if not v]


def _clipped(keep_low):
    rank, world = dist.get_rank(), dist.get_world_size()
    norms = []
    for model in _pair(make_gpt(), param_dtype=torch.bfloat16, keep_low_precision_grads=keep_low):
        lm_loss(model, *batch(0, rank, world)).backward()
        norm = model.clip_grad_norm_(0.1)
        norms.append((norm.dtype, norm.item(), [p.grad.clone() for p in model.parameters()]))
    return norms


@pytest.mark.parametrize("keep_low", [False, True])
def test_clip_grad_norm_under_mixed_precision_matches_torch(keep_low):
    for (dtype, norm, grads), (their_dtype, their_norm, their_grads) in run_on_ranks(2, _clipped, keep_low):
        assert dtype == their_dtype == (torch.bfloat16 if keep_low else torch.float32)
        assert abs(norm - their_norm) <= 1e-6 * their_norm
        assert all(torch.allclose(g, t, rtol=1e-6, atol=0) for g, t in zip(grads, their_grads))


def _batchnorm_eval_in_full_precision():
    rank = dist.get_rank()
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        torch.manual_seed(0)
        models = _pair(_ConvNet(), wrap_classes=(nn.Sequential,), param_dtype=torch.float16)
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 3, 5, 5, generator=gen), torch.randint(0, 4, (4,), generator=gen)
    outputs = []
    for model in models:
        F.cross_entropy(model(x).float(), y).backward()  # a training step in fp16 first
        model.eval()
        with torch.no_grad():
            outputs.append(model(x))
    return outputs


def test_batchnorm_units_evaluate_in_full_precision_after_training():
    """The fp32 BatchNorm unit's outputs go back to the dtype of each call's inputs: fp16 in training,
    fp32 in full-precision evaluation (it kept casting to fp16 once it had seen it)."""
    for ours, theirs in run_on_ranks(2, _batchnorm_eval_in_full_precision):
        assert ours.dtype == theirs.dtype == torch.float32
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("field, value", [("param_dtype", torch.int64), ("reduce_dtype", torch.int32),
                                          ("param_dtype", torch.complex64), ("buffer_dtype", torch.bool),
                                          ("param_dtype", "bfloat16")])
def test_a_dtype_that_is_not_floating_point_is_refused_naming_the_field(field, value):
    from fsdp1._wrapper.mixed_precision_argument import checked_precision

    with pytest.raises(ValueError, match=f"MixedPrecision.{field}=.*floating-point torch.dtype"):
        checked_precision(fsdp1.MixedPrecision(**{field: value}))


# ------------------------------------------------------------------------------ .to(dtype) after wrapping
def _convert_after_wrapping(strategy, use_orig_params, conversion, trained_before):
    """Convert to float64 right after wrapping, or after a float32 step whose gradients were zeroed
    (they must stay zeroed); against a plain model doing the same, its gradients averaged by hand."""
    base = make_mlp()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    oracle = AveragedGrads(copy.deepcopy(base))
    if trained_before:
        train_each((ours, oracle), steps=1)
    for model in (ours, oracle):
        if conversion == "to":
            model.to(torch.float64)
        else:
            model.double()
    losses = train_each((ours, oracle), dtype=torch.float64)
    dtypes = sorted({str(p.dtype) for p in ours.parameters()} | {str(g.dtype) for g in fsdp1_full_params(ours).values()})
    return dtypes, losses, max_relative_error(fsdp1_full_params(ours), plain_params(oracle.module))


@pytest.mark.parametrize("trained_before", [False, True])
@pytest.mark.parametrize("conversion", ["to", "double"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_converting_the_dtype_after_wrapping(strategy, use_orig_params, conversion, trained_before):
    for dtypes, (ours, oracle), error in run_on_ranks(
        2, _convert_after_wrapping, strategy, use_orig_params, conversion, trained_before
    ):
        assert dtypes == ["torch.float64"]
        assert relative_errors(ours, oracle) <= 1e-12
        assert error <= 1e-12


# ------------------------------------------------------------------- fully_shard: MixedPrecisionPolicy
def _mixed_precision():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    policy_kwargs = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    ours = shard_gpt(make_gpt(), fsdp1.fully_shard, mp_policy=fsdp1.MixedPrecisionPolicy(**policy_kwargs))
    theirs = shard_gpt(make_gpt(), torchs_fully_shard(), mp_policy=TorchPolicy(**policy_kwargs))
    torch_policy_accepted = shard_gpt(make_gpt(), fsdp1.fully_shard, mp_policy=TorchPolicy(**policy_kwargs))
    losses = [train(model, 3, world_size, rank) for model in (ours, theirs, torch_policy_accepted)]
    dtypes = {p.dtype for p in ours.parameters()} | {p.grad.dtype for p in ours.parameters() if p.grad is not None}
    output = ours(batch(0, rank, world_size)[0])
    return losses, dtypes, output.dtype


def test_bf16_mixed_precision_policy_trains_like_torchs():
    for (ours, theirs, with_torch_policy), dtypes, output_dtype in run_on_ranks(2, _mixed_precision):
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 2e-3
        assert with_torch_policy == ours  # torch's policy object is accepted and means the same
        assert dtypes == {torch.float32}  # sharded parameters and gradients in fp32
        assert output_dtype == torch.bfloat16


# ------------------------------------------------------------------- fully_shard: cast_forward_inputs in a group
class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(6, 5)

    def forward(self, x):
        return self.a(x).float() + self.b(x).float()  # both modules see the fp32 input


def _cast_in_a_group(impl):
    shard = fully_shard_of(impl)
    policy_class = fsdp1.MixedPrecisionPolicy if impl == "fsdp1" else torch.distributed.fsdp.MixedPrecisionPolicy
    torch.manual_seed(0)
    model = _TwoHeads()
    shard([model.a, model.b], mp_policy=policy_class(param_dtype=torch.bfloat16, cast_forward_inputs=True))
    shard(model)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = model(x)
    out.sum().backward()
    return out.detach(), full_grads(model)


def test_cast_forward_inputs_casts_the_input_of_every_module_of_a_group_as_torchs():
    ours, theirs = run_both(_cast_in_a_group)
    assert torch.equal(ours[0], theirs[0])
    assert same_tensors(ours[1], theirs[1])


# ------------------------------------------------------------------- fully_shard: a group frozen in its first forward
def _frozen_first_then_unfrozen(impl, frozen_first):
    """bf16 compute, fp32 reduce; block 0's group frozen in the first step (``frozen_first``) or
    trainable with its step-1 gradient dropped (the same parameters after step 1), trainable after."""
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = (fsdp1.MixedPrecisionPolicy if impl == "fsdp1" else _torch_policy())(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard_gpt(make_gpt(), fully_shard_of(impl), mp_policy=policy)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    first = list(model.blocks[0].parameters())
    for step in range(3):
        for param in first:
            param.requires_grad_(not (frozen_first and step == 0))
        lm_loss(model, *batch(step, rank, world)).backward()
        if step == 0:
            for param in first:
                param.grad = None
        optim.step()
        optim.zero_grad()
    return [p.detach().full_tensor() for p in model.parameters()]


def _torch_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy


def test_a_group_frozen_in_its_first_forward_reduces_in_reduce_dtype_once_unfrozen():
    """The group's gradients are reduced in ``reduce_dtype`` whenever they come, as if it had been
    trainable from the start: torch's ``fully_shard`` does so from 2.14 (2.13 read the dtypes of a
    group with nothing trainable, reduced in ``param_dtype`` and failed assigning the bf16 gradient to
    the fp32 parameter); fsdp1 does on every release, and matches torch's bit for bit where torch's
    has it."""
    from fsdp1._torch_version import release

    frozen, trainable = (run_on_ranks(2, _frozen_first_then_unfrozen, "fsdp1", flag)[0] for flag in (True, False))
    assert same_tensors(frozen, trainable)
    if release(torch.__version__) >= (2, 14):
        assert same_tensors(frozen, run_on_ranks(2, _frozen_first_then_unfrozen, "torch", True)[0])
