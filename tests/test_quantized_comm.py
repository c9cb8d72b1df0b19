"""Tests block-quantized communication (``comm_quantization=fsdp1.BlockQuantization(...)``, fsdp1's own,
on both APIs). The codec gives every value back within its stated bound; the forward computes exactly
on the weights the codec gives back; training under each setting stays close to the same run
unquantized, alone and composed with mixed precision, hybrid sharding, ``reshard_after_forward=k``,
gradient accumulation, CPU offload, activation checkpointing, ``clip_grad_norm_``, frozen and tied
parameters, on 2 and 4 ranks (every unit padded); and what must stay exact does: turned off, every
number is bitwise today's; state dicts, summoned parameters and checkpoints hold the full-precision
weights; the optimizer steps with exactly the reduced gradient; replicas stay equal."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp1
from fsdp1 import BlockQuantization
from fsdp1._engine.quantization import BlockCodec
from fsdp1._engine.unit_state import unit_states

from _harness import run_on_ranks
from _models import Block, batch, fsdp1_full_params, lm_loss, make_gpt, make_tied_gpt, relative_errors, shard_gpt, train

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

INT8 = BlockQuantization()
FP8 = BlockQuantization(weights=torch.float8_e4m3fn, gradients=torch.float8_e4m3fn)
SETTINGS = {"int8": INT8, "int8_weights": BlockQuantization(gradients=None), "int8_gradients": BlockQuantization(weights=None),
            "fp8": FP8}
CLOSE = {"int8": 1e-2, "int8_weights": 1e-2, "int8_gradients": 1e-2, "fp8": 2e-2}
"""How far a quantized run's loss may be from the unquantized run's at each of its first steps
(relative): measured at most 5e-3 (int8) and 5e-3 (fp8) on TinyGPT over 6 Adam steps."""


# ------------------------------------------------------------------ the codec
def _round_trip(codec, values, runs=None):
    plan = codec.plan(runs, values.device) if runs is not None else None
    encoded = torch.empty(codec.encoded_nbytes(values.numel(), plan), dtype=torch.uint8)
    codec.encode_into(values, encoded, plan)
    decoded = torch.empty_like(values)
    codec.decode_into(encoded, decoded, plan)
    return decoded, encoded


def _values_with_outliers(numel):
    generator = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=generator)
    values[:: 97] *= 50  # an outlier in some blocks costs only those blocks their precision
    return values


@pytest.mark.parametrize("block_size", [1, 7, 32, 256])
@pytest.mark.parametrize("numel", [1, 255, 1000, 300_001])
def test_int8_gives_every_value_back_within_half_a_step_of_its_block(block_size, numel):
    codec = BlockCodec(torch.int8, block_size)
    values = _values_with_outliers(numel)
    decoded, encoded = _round_trip(codec, values)
    blocks = codec.blocks(numel)
    assert encoded.numel() == -(-blocks * block_size // 4) * 4 + 4 * blocks  # codes (4-byte aligned), then the scales
    largest = torch.nn.functional.pad(values.abs(), (0, blocks * block_size - numel)).view(blocks, block_size).amax(1)
    bound = (largest / 254 + largest * 2**-22).repeat_interleave(block_size)[:numel]  # half a step, and float32's rounding
    assert bool(((decoded - values).abs() <= bound).all())


@pytest.mark.parametrize("block_size", [7, 256])
def test_float8_gives_every_value_back_within_a_sixteenth(block_size):
    codec = BlockCodec(torch.float8_e4m3fn, block_size)
    values = _values_with_outliers(10_000)
    decoded, _ = _round_trip(codec, values)
    blocks = codec.blocks(values.numel())
    largest = torch.nn.functional.pad(values.abs(), (0, blocks * block_size - values.numel())).view(blocks, -1).amax(1)
    subnormal = (largest / 448 * 2**-10).repeat_interleave(block_size)[: values.numel()]  # e4m3's subnormal step, halved
    assert bool(((decoded - values).abs() <= values.abs() * (1 / 16 + 2**-22) + subnormal).all())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_subnormal_blocks_come_back_finite(dtype):
    """A block of subnormal values has a subnormal scale, or one that underflows to zero: still no NaN,
    and nothing larger than the block's largest value."""
    codec = BlockCodec(dtype, 4)
    values = torch.tensor([1e-39, 2e-39, -3e-39, 0.0, 1e-44, -1e-44, 0.0, 5e-45, 1e-30, 0.0, 3e-38, -1e-40])
    decoded, _ = _round_trip(codec, values)
    assert bool(decoded.isfinite().all())
    largest = values.abs().view(3, 4).amax(1).repeat_interleave(4)
    assert bool((decoded.abs() <= largest * 1.5).all())


def test_a_block_with_an_overflow_comes_back_non_finite_and_zeros_come_back_zeros():
    """A gradient scaler still sees an overflow through a quantized reduction; an all-zero block has
    scale 0 and decodes to zeros, not NaN."""
    codec = BlockCodec(torch.int8, 4)
    values = torch.tensor([1.0, float("inf"), 2.0, 3.0, 0.0, 0.0, 0.0, 0.0, float("nan"), 1.0, 2.0])
    decoded, _ = _round_trip(codec, values)
    assert not bool(decoded[:4].isfinite().any())
    assert torch.equal(decoded[4:8], torch.zeros(4))
    assert not bool(decoded[8:].isfinite().any())


def test_a_block_two_runs_share_gives_each_its_own_scale_and_fill_values_come_back_zeros():
    """LayerNorm gains of 1.0 beside weights of 0.02 in one block: each run's values come back within
    half a step of that run's own largest magnitude in the block, not the gains'; a fill run (FSDP1's
    alignment padding, 42.0) comes back zeros and sets no scale."""
    from fsdp1._engine.layout import Run

    codec = BlockCodec(torch.int8, 8)
    runs = [Run(3), Run(2, fill=True), Run(6), Run(9), Run(1)]
    values = torch.cat([torch.tensor([0.01, -0.02, 0.015]), torch.full((2,), 42.0), torch.ones(6),
                        torch.linspace(-0.02, 0.02, 9), torch.tensor([3e-4])])
    decoded, encoded = _round_trip(codec, values, runs)
    plan = codec.plan(runs, values.device)
    assert encoded.numel() == codec.encoded_nbytes(values.numel()) + 4 * plan.segments  # a scale for each run's part of a cut block
    assert torch.equal(decoded[3:5], torch.zeros(2))
    cursor = 0
    for run in runs:
        part, got = values[cursor : cursor + run.numel], decoded[cursor : cursor + run.numel]
        if not run.fill:
            assert bool(((got - part).abs() <= part.abs().max() / 254 * (1 + 2**-20)).all()), (run, got, part)
        cursor += run.numel
    whole_block = _round_trip(codec, values)[0]  # one run: the gains set the scale of the weights beside them
    assert (whole_block[11:13] - values[11:13]).abs().max() > 0.1 * 0.02


@pytest.mark.parametrize("front", ["fsdp1", "fsdp1_orig_params", "fully_shard"])
def test_every_parameter_comes_back_within_half_a_step_of_its_own_largest_value(front):
    """What the forward computes on (the codec's round trip, by the test above it) is, parameter by
    parameter, within max|parameter| / 254 of the exact weight: no block lends one parameter's scale
    to another, in either front's layout, with alignment padding or not."""
    for within in run_on_ranks(2, _each_parameter_within_its_own_step, front):
        assert within == [True] * len(within)


def _each_parameter_within_its_own_step(front):
    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs = dict(use_orig_params=True) if front == "fsdp1_orig_params" else {}
    model = _wrapped(front.split("_orig")[0], make_gpt(), BlockQuantization(gradients=None), **kwargs)
    with torch.no_grad():
        model(batch(0, rank, world)[0])  # the units learn their paths
    exact = _decoded_weights(model, _Identity())
    decoded = _decoded_weights(model, BlockCodec(torch.int8, INT8.block_size))
    return [bool(((decoded[name] - value).abs() <= value.abs().max() / 254 * (1 + 2**-20)).all()) for name, value in exact.items()]


class _ZeroSized(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return x + self.empty.sum()


def _a_unit_of_nothing_trains_as_unquantized(front):
    """A unit whose only parameter has no element sends nothing, quantized or not."""
    losses = []
    for quantization in (INT8, None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), _ZeroSized(), torch.nn.Linear(2, 2))
        if front == "fully_shard":
            fsdp1.fully_shard(model[1], comm_quantization=quantization)
            fsdp1.fully_shard(model, comm_quantization=quantization)
        else:
            model[1] = fsdp1.FullyShardedDataParallel(model[1], comm_quantization=quantization)
            model = fsdp1.FullyShardedDataParallel(model, comm_quantization=quantization)
        loss = model(torch.ones(4, 2)).square().sum()
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("front", ["fsdp1", "fully_shard"])
def test_a_unit_whose_parameters_have_no_element_trains_quantized(front):
    for quantized, plain in run_on_ranks(2, _a_unit_of_nothing_trains_as_unquantized, front):
        assert abs(quantized - plain) <= 1e-2 * abs(plain)


@pytest.mark.parametrize("kwargs, message", [
    (dict(weights=torch.bfloat16), "weights=torch.bfloat16"),
    (dict(gradients=torch.int4 if hasattr(torch, "int4") else torch.int16), "gradients="),
    (dict(block_size=0), "block_size=0"),
    (dict(block_size=True), "block_size=True"),
    (dict(block_size=1 << 17), "block_size=131072"),
    (dict(block_size=2.0), "block_size=2.0"),
    (dict(weights="int8"), "weights='int8'"),
])
def test_a_setting_it_cannot_send_is_refused_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        BlockQuantization(**kwargs)


def test_a_block_size_of_any_integer_type_is_kept_as_an_int():
    numpy = pytest.importorskip("numpy")
    quantization = BlockQuantization(block_size=numpy.int64(64))
    assert type(quantization.block_size) is int and quantization == BlockQuantization(block_size=64)


# ------------------------------------------------------------------ training
def _wrapped(front, model, quantization, **kwargs):
    if front == "fsdp1":
        return fsdp1.FullyShardedDataParallel(model, auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}),
                                              comm_quantization=quantization, **kwargs)
    return shard_gpt(model, fsdp1.fully_shard, comm_quantization=quantization, **kwargs)


def _decoded_weights(model, codec):
    """What each parameter is when every unit's shards make the round trip through ``codec`` (each
    rank's own, its alignment padding taken for zeros), by clean FQN."""
    weights = {}
    for unit in unit_states(model):
        handle = unit.handle
        if handle is None:
            continue
        layout, own = handle.layout, handle.local_shard.detach()
        decoded = _round_trip(codec, own, layout.sent_runs(layout.rank))[0]
        rows = [torch.empty_like(decoded) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, decoded)
        unsharded = layout.new_unsharded(torch.float32, torch.device("cpu"))
        layout.copy_out(unsharded, iter(enumerate(rows)))
        for slot, value in zip(handle.views.slots, layout.unflatten(unsharded)):
            weights[handle.views.clean_fqn(slot)] = value.clone()
    return weights


def _forward_on_decoded_weights(front):
    """The quantized model's first loss, and the plain model's on the weights the codec gives back."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = make_gpt()
    kwargs = dict(use_orig_params=True) if front == "fsdp1_orig_params" else {}
    model = _wrapped(front.split("_orig")[0], copy.deepcopy(plain), BlockQuantization(gradients=None), **kwargs)
    with torch.no_grad():
        model(batch(0, rank, world)[0])  # the units learn their paths
    weights = _decoded_weights(model, BlockCodec(torch.int8, INT8.block_size))
    plain.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return lm_loss(model, *batch(1, rank, world)).item(), lm_loss(plain, *batch(1, rank, world)).item()


@pytest.mark.parametrize("front", ["fsdp1", "fsdp1_orig_params", "fully_shard"])
def test_the_forward_computes_on_exactly_the_weights_the_codec_gives_back(front):
    """use_orig_params aligns every parameter, its padding filled with 42.0: taken for zeros, or it would
    set the scale of every block it shares with a parameter."""
    for quantized, plain in run_on_ranks(2, _forward_on_decoded_weights, front):
        assert quantized == plain


def _losses_with_and_without(front, setting, world):
    rank = dist.get_rank()
    return [train(_wrapped(front, make_gpt(), quantization), 4, world, rank)
            for quantization in (SETTINGS[setting], None)]


@pytest.mark.parametrize("front, setting, world", [(front, setting, 2) for front in ("fsdp1", "fully_shard") for setting in SETTINGS]
                         + [("fsdp1", "int8", 4), ("fully_shard", "int8", 4)])
def test_each_setting_trains_close_to_the_unquantized_run(front, setting, world):
    quantized, plain = run_on_ranks(world, _losses_with_and_without, front, setting, world)[0]
    assert quantized != plain  # something was quantized
    assert relative_errors(quantized, plain) <= CLOSE[setting], (quantized, plain)


def _off_is_bitwise_today(front):
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = []
    for quantization in (None, BlockQuantization(weights=None, gradients=None)):
        model = _wrapped(front, make_gpt(), quantization)
        runs.append((train(model, 3, world, rank), fsdp1_full_params(model) if front == "fsdp1" else
                     [p.full_tensor() for p in model.parameters()]))
    (losses, params), (off_losses, off_params) = runs
    same = all(torch.equal(a, b) for a, b in zip(params.values(), off_params.values())) if front == "fsdp1" else \
        all(torch.equal(a, b) for a, b in zip(params, off_params))
    return losses == off_losses and same


@pytest.mark.parametrize("front", ["fsdp1", "fully_shard"])
def test_with_nothing_quantized_every_number_is_bitwise_the_unquantized_run(front):
    assert all(run_on_ranks(2, _off_is_bitwise_today, front))


# ------------------------------------------------------------------ compositions
def _composed(front, pattern, quantization):
    """One run of ``pattern`` (4 steps on TinyGPT, or the tied one); its losses, and whether every
    replica holds the same shard (hybrid patterns)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs = {}
    model = make_tied_gpt() if pattern == "tied" else make_gpt()
    if pattern == "frozen":
        for block in model.blocks:
            block.qkv.requires_grad_(False)
        if front == "fsdp1":
            kwargs["use_orig_params"] = True
    if pattern == "bf16":
        kwargs["mixed_precision" if front == "fsdp1" else "mp_policy"] = (
            fsdp1.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if front == "fsdp1"
            else fsdp1.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if pattern == "hybrid":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        kwargs.update(dict(sharding_strategy=fsdp1.ShardingStrategy.HYBRID_SHARD, device_mesh=mesh) if front == "fsdp1"
                      else dict(mesh=mesh))
    if pattern == "reshard_to_2":
        kwargs["reshard_after_forward"] = 2
    if pattern == "no_shard":
        kwargs["sharding_strategy"] = fsdp1.ShardingStrategy.NO_SHARD
    if pattern == "offload":
        kwargs.update(dict(cpu_offload=fsdp1.CPUOffload(offload_params=True)) if front == "fsdp1"
                      else dict(offload_policy=fsdp1.CPUOffloadPolicy()))
    if pattern == "checkpointed":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    model = _wrapped(front, model, quantization, **kwargs)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if pattern == "bf16":  # a bf16 loss is too coarse to tell the runs apart: the loss of float32 logits
        model.register_forward_hook(lambda module, args, output: output.float())
    losses = []
    for step in range(4):
        if pattern == "accumulate":
            if front == "fsdp1":
                with model.no_sync():
                    lm_loss(model, *batch(100 + step, rank, world)).backward()
            else:
                model.set_requires_gradient_sync(False)
                lm_loss(model, *batch(100 + step, rank, world)).backward()
                model.set_requires_gradient_sync(True)
        loss = lm_loss(model, *batch(step, rank, world))
        loss.backward()
        if pattern == "clip":
            if front == "fsdp1":
                model.clip_grad_norm_(0.5)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    replicas_equal = True
    if pattern == "hybrid":
        shards = [p.to_local() if front == "fully_shard" else p for p in model.parameters()]
        for shard in shards:
            copies = [torch.empty_like(shard) for _ in range(2)]
            dist.all_gather(copies, shard.detach().contiguous(), group=mesh.get_group("replicate"))
            replicas_equal = replicas_equal and torch.equal(copies[0], copies[1])
    return losses, replicas_equal


def _composed_with_and_without(front, pattern):
    return [_composed(front, pattern, quantization) for quantization in (INT8, None)]


COMPOSED = {  # pattern: (ranks, fronts)
    "bf16": (2, ("fsdp1", "fully_shard")),
    "hybrid": (4, ("fsdp1", "fully_shard")),
    "reshard_to_2": (4, ("fully_shard",)),
    "no_shard": (2, ("fsdp1",)),
    "accumulate": (2, ("fsdp1", "fully_shard")),
    "offload": (2, ("fsdp1", "fully_shard")),
    "checkpointed": (2, ("fsdp1",)),
    "clip": (2, ("fsdp1", "fully_shard")),
    "frozen": (2, ("fsdp1", "fully_shard")),
    "tied": (2, ("fsdp1", "fully_shard")),
}


@pytest.mark.parametrize("front, pattern", [(front, pattern) for pattern, (_, fronts) in COMPOSED.items() for front in fronts])
def test_int8_composes_and_trains_close_to_the_same_run_unquantized(front, pattern):
    (quantized, replicas_equal), (plain, _) = run_on_ranks(COMPOSED[pattern][0], _composed_with_and_without, front, pattern)[0]
    assert quantized != plain
    assert relative_errors(quantized, plain) <= CLOSE["int8"], (quantized, plain)
    assert replicas_equal  # every replica decodes the same bytes


def _float8_training_with_and_without():
    """torchao's float8 training, its weights gathered as float8 by their extension: the unit's other
    values (the biases) travel int8 in the same gather, and the gradients int8."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    rank = dist.get_rank()
    runs = []
    for quantization in (INT8, None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        for module in (model[0], model[2], model):
            fsdp1.fully_shard(module, comm_quantization=quantization)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)  # Adam turns this tiny loss's noise into lr-sized steps
        losses = []
        for step in range(4):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        runs.append(losses)
    return runs


def test_an_all_gather_extensions_tensors_travel_beside_quantized_values():
    quantized, plain = run_on_ranks(2, _float8_training_with_and_without)[0]
    assert quantized != plain
    assert relative_errors(quantized, plain) <= CLOSE["int8"], (quantized, plain)


# ------------------------------------------------------------------ what stays exact
def _kept_exact(front):
    """After quantized training: the full state dict, the summoned parameters and the shards' exact
    gather agree bitwise, and differ from the weights the codec gives back."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _wrapped(front, make_gpt(), INT8)
    train(model, 2, world, rank)
    decoded = _decoded_weights(model, BlockCodec(torch.int8, INT8.block_size))
    exact = _decoded_weights(model, _Identity())
    if front == "fsdp1":
        FSDP = fsdp1.FullyShardedDataParallel
        with FSDP.state_dict_type(model, fsdp1.StateDictType.FULL_STATE_DICT, fsdp1.FullStateDictConfig(rank0_only=False)):
            full = model.state_dict()
        with FSDP.summon_full_params(model):
            summoned = {name: p.detach().clone() for name, p in model.named_parameters()}
        summoned = {name.replace("_fsdp_wrapped_module.", ""): p for name, p in summoned.items()}
    else:
        full = {name: value.full_tensor() for name, value in model.state_dict().items()}
        summoned = {name: p.full_tensor() for name, p in model.named_parameters()}
    return (all(torch.equal(full[name], value) for name, value in exact.items()),
            all(torch.equal(summoned[name], value) for name, value in exact.items()),
            any(not torch.equal(decoded[name], value) for name, value in exact.items()))


class _Identity:
    """A codec that sends values as they are: the shards' exact gather."""

    block_size = 1

    def plan(self, runs, device):
        return None

    def encoded_nbytes(self, numel, plan=None):
        return 4 * numel

    def encode_into(self, values, encoded, plan=None):
        encoded.view(torch.float32).copy_(values)

    def decode_into(self, encoded, out, plan=None):
        out.copy_(encoded.view(torch.float32))


@pytest.mark.parametrize("front", ["fsdp1", "fully_shard"])
def test_state_dicts_and_summoned_parameters_hold_the_full_precision_weights(front):
    for full_exact, summoned_exact, quantization_differs in run_on_ranks(2, _kept_exact, front):
        assert full_exact and summoned_exact and quantization_differs


def _sgd_steps_with_the_reduced_gradient():
    """With SGD (lr 0.5, no momentum), each shard after the step is exactly shard - 0.5 * its .grad."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _wrapped("fsdp1", make_gpt(), INT8)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    lm_loss(model, *batch(0, rank, world)).backward()
    expected = [(p.detach() - 0.5 * p.grad).clone() for p in model.parameters()]
    optim.step()
    return all(torch.equal(p.detach(), want) for p, want in zip(model.parameters(), expected))


def test_the_optimizer_steps_with_exactly_the_reduced_gradient():
    assert all(run_on_ranks(2, _sgd_steps_with_the_reduced_gradient))


def _resumed_from_a_checkpoint(directory):
    """Two quantized steps, a SHARDED checkpoint through fsdp1.checkpoint, two more steps; then a fresh
    model and optimizer loaded from it run the same two steps."""
    from fsdp1 import checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    FSDP = fsdp1.FullyShardedDataParallel

    def state(model, optim):
        with FSDP.state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT):
            return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}

    def trained(model, optim, first):
        losses = []
        for step in range(first, first + 2):
            loss = lm_loss(model, *batch(step, rank, world))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        return losses

    model = _wrapped("fsdp1", make_gpt(), INT8)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    trained(model, optim, 0)
    checkpoint.save(state(model, optim), f"{directory}/step_000002")
    straight = trained(model, optim, 2)
    resumed_model = _wrapped("fsdp1", make_gpt(seed=1), INT8)
    resumed_optim = torch.optim.Adam(resumed_model.parameters(), lr=1e-2)
    resumed_model(batch(0, rank, world)[0]).sum().backward()  # the optimizer's state exists, to be overwritten
    resumed_optim.step()
    resumed_optim.zero_grad()
    loaded = state(resumed_model, resumed_optim)
    checkpoint.load(loaded, f"{directory}/step_000002")
    with FSDP.state_dict_type(resumed_model, fsdp1.StateDictType.SHARDED_STATE_DICT):
        resumed_model.load_state_dict(loaded["model"])
        resumed_optim.load_state_dict(FSDP.optim_state_dict_to_load(resumed_model, resumed_optim, loaded["optim"]))
    return straight, trained(resumed_model, resumed_optim, 2)


def test_a_run_resumed_from_a_checkpoint_trains_on_bitwise_as_the_uninterrupted_one(tmp_path):
    for straight, resumed in run_on_ranks(2, _resumed_from_a_checkpoint, str(tmp_path)):
        assert resumed == straight


# ------------------------------------------------------------------ both import forms, and what is refused
def _through_torchs_names():
    """Under use_as_torch_fsdp, torch's FSDP1 class and fully_shard take the argument too: the same losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = [train(_wrapped(front, make_gpt(), INT8), 2, world, rank) for front in ("fsdp1", "fully_shard")]
    with fsdp1.use_as_torch_fsdp():
        from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        as_torch = FullyShardedDataParallel(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), comm_quantization=INT8)
        torch_losses = [train(as_torch, 2, world, rank),
                        train(shard_gpt(make_gpt(), functools.partial(fully_shard, comm_quantization=INT8)), 2, world, rank)]
    return losses == torch_losses


def test_torchs_names_under_use_as_torch_fsdp_take_the_argument_and_train_the_same():
    assert all(run_on_ranks(2, _through_torchs_names))


def _refusals():
    model = _wrapped("fsdp1", make_gpt(), INT8)
    errors = []
    try:
        model.register_comm_hook(fsdp1.comm_hooks.DefaultState(dist.group.WORLD), fsdp1.comm_hooks.reduce_scatter_hook)
    except ValueError as error:
        errors.append(str(error))
    sharded = _wrapped("fully_shard", make_gpt(), INT8)
    for setter in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        try:
            getattr(sharded.blocks[0], setter)(object())
        except ValueError as error:
            errors.append(str(error))
    for wrong in ("int8", torch.int8):
        try:
            fsdp1.fully_shard(make_gpt(), comm_quantization=wrong)
        except TypeError as error:
            errors.append(str(error))
    return errors


def test_what_replaces_a_quantized_collective_is_refused_naming_the_unit_and_the_fix():
    errors = run_on_ranks(2, _refusals)[0]
    assert len(errors) == 5, errors
    assert "register_comm_hook" in errors[0] and "gradients=None" in errors[0]
    assert "set_custom_all_gather on 'blocks.0'" in errors[1] and "weights=None" in errors[1]
    assert "set_custom_reduce_scatter on 'blocks.0'" in errors[2] and "gradients=None" in errors[2]
    assert all("expects fsdp1.BlockQuantization" in error for error in errors[3:])
