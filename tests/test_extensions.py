"""Tests ``fully_shard``'s all-gather extensions: a parameter whose local tensor defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` is gathered through them, against torch's
``fully_shard`` doing the same: hooks set on a local tensor after sharding (as torch's own tests set
them), with their call counts, on a 1-D and an HSDP mesh; and real ones, torchao's int8 weight-only
quantized training with its ``_AdamW``, its float8 training with float8 all-gathers and QLoRA (frozen
NF4 base weights with LoRA adapters), trained bitwise as torch's."""

import contextlib
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from _harness import run_on_ranks
from _models import fully_shard_of, same_values


def _pre(local, calls, mesh, outer_size, outer_stride, module, mp_policy):
    """Gathers the weight in bf16, with a second tensor of another shape (a scale) beside it."""
    calls["pre"] += 1
    calls["mesh_size"] = mesh.size()
    return (local.to(torch.bfloat16), local.abs().amax(dim=-1, keepdim=True)), tuple(outer_size)


def _post(local, calls, outputs, metadata, param_dtype, *, out=None):
    calls["post"] += 1
    data, scale = outputs
    full = data.to(param_dtype) + 0 * scale
    if out is not None:  # a later gather refills what the first one made
        calls["out"] += 1
        with torch.no_grad():
            out.copy_(full)
        return None
    return full, (data, scale)


def _trained(model, optim, width, sent=None):
    """3 steps on this rank's inputs of ``width`` features; the losses. ``sent``: a dict that gets the
    bytes this rank sent in the second step's collectives, by kind (two gloo ranks exchange fsdp1's
    gathers and reductions pairwise: compare totals)."""
    from fsdp1._planner.dry_run import CommBytes

    losses = []
    for step in range(3):
        counter = CommBytes() if step == 1 and sent is not None else contextlib.nullcontext()
        with counter:
            loss = model(torch.randn(4, width, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))).pow(2).mean()
            loss.backward()
        if step == 1 and sent is not None:
            sent.update(counter.payload)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _trained_with_hooks(impl, reshard_after_forward, hsdp):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    shard = fully_shard_of(impl)
    shard(model[0], reshard_after_forward=reshard_after_forward, mesh=mesh)
    shard(model, mesh=mesh)
    calls = {"pre": 0, "post": 0, "out": 0}
    local = model[0].weight._local_tensor  # set after sharding, on the local tensor, as torch's tests do
    local.fsdp_pre_all_gather = functools.partial(_pre, local, calls)
    local.fsdp_post_all_gather = functools.partial(_post, local, calls)
    losses = _trained(model, torch.optim.Adam(model.parameters(), lr=1e-2), 8)
    return losses, [p.full_tensor().detach() for p in model.parameters()], calls


def _hooks_as_torchs(reshard_after_forward, hsdp):
    ours = _trained_with_hooks("fsdp1", reshard_after_forward, hsdp)
    return same_values(ours, _trained_with_hooks("torch", reshard_after_forward, hsdp)), ours[2]


@pytest.mark.parametrize("hsdp", [False, True], ids=["1-D", "hsdp"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_hooks_on_a_local_tensor_gather_and_train_as_torchs(reshard_after_forward, hsdp):
    """The same losses, parameters and call counts: a pre- and a post-hook call per gather (forward,
    and backward again where the unit reshards after forward), the post-hook given ``out=`` from the
    second on, and the shard group's mesh."""
    world_size = 4 if hsdp else 2
    for same, calls in run_on_ranks(world_size, _hooks_as_torchs, reshard_after_forward, hsdp):
        assert same
        gathers = 6 if reshard_after_forward else 3
        assert calls == {"pre": gathers, "post": gathers, "out": gathers - 1, "mesh_size": 2}


class _RecordedAllGather:
    """torch's ``AllGather`` interface over ``all_gather_into_tensor``, recording each call's dtype."""

    def __init__(self):
        self.dtypes = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.dtypes.append(output_tensor.dtype)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _hooks_through_a_custom_all_gather(impl):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    shard = fully_shard_of(impl)
    shard(model[0])
    shard(model)
    gather = _RecordedAllGather()
    model[0].set_custom_all_gather(gather)
    calls = {"pre": 0, "post": 0, "out": 0}
    local = model[0].weight._local_tensor
    local.fsdp_pre_all_gather = functools.partial(_pre, local, calls)
    local.fsdp_post_all_gather = functools.partial(_post, local, calls)
    losses = _trained(model, torch.optim.Adam(model.parameters(), lr=1e-2), 8)
    return losses, [p.full_tensor().detach() for p in model.parameters()], calls, gather.dtypes


def _custom_all_gather_as_torchs():
    ours = _hooks_through_a_custom_all_gather("fsdp1")
    return same_values(ours, _hooks_through_a_custom_all_gather("torch")), ours[3]


def test_the_custom_all_gather_carries_an_extensions_tensors_as_torchs():
    """A module whose custom all-gather runs its gathers: the extension's tensors travel in it with
    the rest of the module's shard, in bytes (a bf16 weight and an fp32 scale), one call per gather:
    losses, parameters, hook calls and the calls' dtypes as torch's."""
    for same, dtypes in run_on_ranks(2, _custom_all_gather_as_torchs):
        assert same
        assert dtypes == [torch.uint8] * 6  # forward and backward, 3 steps


class _Checkpointed(nn.Module):
    """``module`` under non-reentrant activation checkpointing."""

    def __init__(self, module):
        super().__init__()
        self.inner = module

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def _trained_two_tensors(impl, reshard, variant):
    """torch's own test model: Linear weights that are ``TwoTensor``s (a wrapper subclass of two
    tensors, here unequal) gathered through an extension whose post-hook returns a ``TwoTensor``, so
    the loss and the gathered weights' gradients are ``TwoTensor``s; 3 SGD steps. ``variant``
    "biased": plain biases beside them (whose gradients are ``TwoTensor``s too) and each Linear under
    activation checkpointing. The losses' two halves, the first weight's first gradient and both
    weights' two halves at the end."""
    from torch.testing._internal.two_tensor import TwoTensor

    def pre(self, mesh):
        return (self.a, self.b), None

    def post(self, outputs, metadata, param_dtype, *, out=None):
        if out is None:
            return TwoTensor(*outputs).to(param_dtype), outputs

    torch.manual_seed(0)
    biased = variant == "biased"
    model = nn.Sequential(nn.Linear(8, 8, bias=biased), nn.ReLU(), nn.Linear(8, 8, bias=biased))
    for index in (0, 2):
        weight = model[index].weight
        model[index].weight = nn.Parameter(TwoTensor(weight.detach(), 2 * weight.detach()))
        if biased:
            model[index] = _Checkpointed(model[index])
    TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather = pre, post
    try:
        shard = fully_shard_of(impl)
        shard(model[0], reshard_after_forward=reshard)
        shard(model, reshard_after_forward=reshard)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, first_grad = [], None
        for step in range(3):
            loss = model(torch.randn(2, 8, generator=torch.Generator().manual_seed(step + dist.get_rank()))).sum()
            loss.backward()
            losses.append((loss.a.item(), loss.b.item()))
            if first_grad is None:
                first_grad = [param.grad.to_local().clone() for param in model.parameters()]
            optim.step()
            optim.zero_grad()
        weights = [(weight.to_local().a.clone(), weight.to_local().b.clone()) for name, weight in model.named_parameters()
                   if name.endswith("weight")]
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather
    return losses, first_grad, weights


def _two_tensors_as_torchs(reshard, variant):
    ours, theirs = _trained_two_tensors("fsdp1", reshard, variant), _trained_two_tensors("torch", reshard, variant)
    return same_values(ours, theirs), {type(grad).__name__ for grad in ours[1]}, ours[0][0][0] != ours[0][0][1]


@pytest.mark.parametrize("reshard, variant", [(True, "plain"), (False, "plain"), (True, "biased"), (False, "biased")])
def test_a_wrapper_subclass_gradient_trains_as_under_torchs(reshard, variant):
    """A gradient that is a tensor subclass of several tensors (torch's ``TwoTensor``) trains as
    under torch's: the subclass writes itself into the plain reduction input, as it does into
    torch's, so the sharded gradient is a plain tensor with torch's values, and losses, gradients and
    both halves of the weights are bitwise torch's. It crashed deep in fsdp1 ("resize_() on an
    invalid python storage"), and so did a plain bias beside such a weight, whose gradient is one
    too; activation checkpointing around such a weight failed in backward (its recomputation computed
    on a weight outside autograd, saving other tensors than the forward)."""
    for same, grad_kinds, halves_differ in run_on_ranks(2, _two_tensors_as_torchs, reshard, variant):
        assert same
        assert grad_kinds == {"Tensor"}
        assert halves_differ  # the two halves train apart: a mix-up of them would show


def _trained_int8(impl):
    """torchao's int8 weight-only quantized training: its weights are a tensor subclass whose
    extension gathers the int8 data and the scales; its ``_AdamW`` steps them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao import quantize_
        from torchao.optim import _AdamW
        from torchao.prototype.quantized_training import int8_weight_only_quantized_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    quantize_(model, int8_weight_only_quantized_training())
    shard = fully_shard_of(impl)
    shard(model[0])
    shard(model[2])
    shard(model)
    sent = {}
    losses = _trained(model, _AdamW(model.parameters(), lr=1e-2), 16, sent)
    weight = model[0].weight.to_local()
    return (losses, type(weight).__name__, weight.int_data.clone(), weight.scale.clone(),
            model[0].bias.to_local().detach().clone()), sum(sent.values())


def _int8_as_torchs():
    ours, our_gathered = _trained_int8("fsdp1")
    theirs, their_gathered = _trained_int8("torch")
    return same_values(ours, theirs), ours[1], our_gathered, their_gathered


def test_torchao_int8_training_weights_train_as_under_torchs():
    """The weights stay torchao's subclass, sharded (its optimizer steps them), and training is
    bitwise torch's: losses, int8 data and scales, biases; no more bytes than torch's (the int8 data
    and scales in the unit's one gather, nothing for the weights' places in its shard)."""
    for same, kind, our_gathered, their_gathered in run_on_ranks(2, _int8_as_torchs):
        assert same
        assert kind == "Int8QuantizedTrainingLinearWeight"
        assert our_gathered <= their_gathered


def _trained_float8(impl, on_meta=False):
    """torchao's float8 training with its float8 all-gather: the weights cast themselves to float8
    before the gather, which gloo moves as bytes. ``on_meta``: built on the meta device, sharded,
    then materialised (``to_empty``) and initialised before training."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    shard = fully_shard_of(impl)
    shard(model[0])
    shard(model[2])
    shard(model)
    if on_meta:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for param in model.parameters():
            nn.init.trunc_normal_(param, std=0.1)
    sent = {}
    losses = _trained(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 32, sent)
    weight = model[0].weight.to_local()
    return (losses, type(weight).__name__, [p.to_local().detach().as_subclass(torch.Tensor).clone() for p in model.parameters()]
            ), sum(sent.values())


def _float8_as_torchs(on_meta):
    ours, our_gathered = _trained_float8("fsdp1", on_meta)
    theirs, their_gathered = _trained_float8("torch", on_meta)
    return same_values(ours, theirs), ours[1], our_gathered, their_gathered


@pytest.mark.parametrize("on_meta", [False, True], ids=["built", "meta-initialised"])
def test_torchao_float8_training_with_float8_gathers_trains_as_under_torchs(on_meta):
    """Bitwise torch's, and no more bytes gathered (fsdp1 moved its weights' places in the shard,
    4 bytes each, besides the float8 gather). Built on the meta device and materialised after
    sharding too: its weights, whose values are their own tensors, are materialised with the shard
    (they were left on meta, and the first forward refused them as never materialised)."""
    for same, kind, our_gathered, their_gathered in run_on_ranks(2, _float8_as_torchs, on_meta):
        assert same
        assert kind == "WeightWithDynamicFloat8CastTensor"
        assert our_gathered <= their_gathered  # the float8 weights in the unit's one gather, 1 byte each


class _QLoRALinear(nn.Module):
    """A frozen base weight quantized to torchao's NF4 with LoRA adapters beside it, as torchtune's
    QLoRA recipe builds its linear layers (and then applies ``fully_shard`` to them)."""

    def __init__(self, in_features, out_features, rank=4):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        super().__init__()
        self.weight = nn.Parameter(to_nf4(torch.randn(out_features, in_features) * 0.05, block_size=64, scaler_block_size=64),
                                   requires_grad=False)
        self.lora_a = nn.Linear(in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_features, bias=False)

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


def _trained_qlora(impl, reshard_after_forward):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        blocks = [nn.Sequential(_QLoRALinear(64, 128), nn.ReLU(), _QLoRALinear(128, 64)) for _ in range(2)]
    model = nn.Sequential(*blocks)
    shard = fully_shard_of(impl)
    for block in model:
        shard(block, reshard_after_forward=reshard_after_forward)
    shard(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    sent = {}
    losses = _trained(model, torch.optim.AdamW(trainable, lr=1e-2), 64, sent)
    base = model[0][0].weight.to_local()
    return (losses, type(base).__name__, [p.full_tensor().detach() for p in trainable],
            base.quantized_data.clone(), base.quantized_scalers.clone()), sum(sent.values())


def _qlora_as_torchs(reshard_after_forward):
    ours, our_sent = _trained_qlora("fsdp1", reshard_after_forward)
    theirs, their_sent = _trained_qlora("torch", reshard_after_forward)
    return same_values(ours, theirs), ours[1], our_sent, their_sent


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_torchao_nf4_frozen_weights_with_lora_train_as_under_torchs(reshard_after_forward):
    """QLoRA: NF4 base weights, frozen, sharded by their own tensor operations as torch's shards them
    and gathered through their extension, with trainable LoRA adapters beside them: losses, adapters
    and the NF4 shards bitwise torch's, and no more bytes (the frozen weights' places in the shard
    are neither gathered nor reduced: fsdp1 reduce-scattered their zeros, 4 bytes a weight)."""
    for same, kind, our_sent, their_sent in run_on_ranks(2, _qlora_as_torchs, reshard_after_forward):
        assert same
        assert kind == "NF4Tensor"
        assert our_sent <= their_sent


def _one_hook_only(impl):
    model = fully_shard_of(impl)(nn.Linear(4, 4))
    model.weight._local_tensor.fsdp_pre_all_gather = lambda *args: None
    try:
        model(torch.randn(2, 4)).sum().backward()
    except Exception as error:  # noqa: BLE001 - compared with torch's
        return type(error).__name__, str(error).split(":")[0]
    return "no error", ""


def test_a_pre_hook_without_its_post_hook_is_refused_as_torchs():
    ours, theirs = (run_on_ranks(2, _one_hook_only, impl)[0] for impl in ("fsdp1", "torch"))
    assert ours == theirs
    assert ours[0] == "AssertionError"


def _unpadded_inputs():
    """5 rows on 2 ranks: the second rank holds 2 of the first rank's 3; a pre-hook that does not pad
    them would gather unequal inputs."""
    calls = {"pre": 0, "post": 0, "out": 0}
    model = fully_shard_of("fsdp1")(nn.Linear(4, 5))
    local = model.weight._local_tensor
    local.fsdp_pre_all_gather = functools.partial(_pre, local, calls)
    local.fsdp_post_all_gather = functools.partial(_post, local, calls)
    model(torch.randn(2, 4))


def test_a_pre_hook_that_does_not_pad_an_uneven_shard_is_refused_as_torchs():
    from _harness import RankFailure

    with pytest.raises(RankFailure, match="fsdp_pre_all_gather must return all-gather inputs with the padded sharded size"):
        run_on_ranks(2, _unpadded_inputs)


def _kept_rows_of_an_extension():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_weight_only_quantized_training

    model = nn.Sequential(nn.Linear(16, 32))
    quantize_(model, int8_weight_only_quantized_training())
    try:
        fully_shard_of("fsdp1")(model, reshard_after_forward=2)
    except NotImplementedError as error:
        return str(error), type(model[0].weight).__name__
    return "no error", ""


def test_rows_kept_over_fewer_ranks_are_refused_for_an_extension_parameter():
    """torch's fails in the first backward; fsdp1 kept the whole unsharded weight between forward and
    backward without a word."""
    message, kept = run_on_ranks(4, _kept_rows_of_an_extension)[0]
    assert "'0.weight', gathered by its all-gather extension" in message
    assert kept == "Int8QuantizedTrainingLinearWeight"  # the refused call changed nothing
