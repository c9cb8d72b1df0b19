"""Tests state dicts: FULL / SHARDED / LOCAL under ``state_dict_type``, against the plain model's own
``state_dict()`` (keys, order, values) and torch's FSDP1 trained identically (bitwise); round trips;
sharded checkpoints through ``torch.distributed.checkpoint`` resharded across world sizes, strategies
and wrappings; checkpoints exchanged with torch's FSDP1 both ways; torch's own enums and configs;
and loads that fail, which must change nothing; ``summon_full_params`` and its options, also after a
forward that no backward followed, between a forward and its backward (as torch's FSDP1), and with
``offload_to_cpu`` on a NO_SHARD unit (which torch's refuses)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import fsdp1
from fsdp1 import FullyShardedDataParallel as FSDP
from fsdp1 import StateDictType

from _harness import run_on_ranks
from _models import (
    IMPLEMENTATIONS,
    Block,
    LinearNet,
    batch,
    build,
    fsdp1_full_params,
    fsdp_api,
    fsdp_strategy,
    fsdp_wrapped,
    lm_loss,
    make_gpt,
    make_tied_gpt,
    max_relative_error,
    plain_params,
    relative_errors,
    same_values,
    summoned_full_params,
    train,
    wrap_fsdp1,
    wrap_torch_fsdp,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:The `NO_SHARD` sharding strategy is deprecated:FutureWarning",
    "ignore::FutureWarning",
)
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
SHARDED = ["FULL_SHARD", "SHARD_GRAD_OP"]
TOLERANCE = 1e-5


def _trained(strategy="FULL_SHARD", use_orig_params=False, tied=True, steps=1, wrap_classes=(Block,)):
    """fsdp1 around TiedGPT (or TinyGPT) after ``steps`` Adam steps, and the plain model it started from."""
    base = make_tied_gpt() if tied else make_gpt()
    model = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=wrap_classes)
    train(model, steps, dist.get_world_size(), dist.get_rank())
    return model, base


def _bitwise(a, b):
    assert list(a) == list(b), (list(a), list(b))
    return all(torch.equal(a[k], b[k]) for k in a)


def _full_params_and_buffers(model):
    """Ground truth for a FULL state dict: the units' parameters gathered by the test helper."""
    return fsdp1_full_params(model)


# ---------------------------------------------------------------------------------------- FULL
def _full_matches_plain_and_torch(strategy, use_orig_params):
    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_tied_gpt()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params)
    theirs = wrap_torch_fsdp(copy.deepcopy(base), strategy, use_orig_params)
    for model in (ours, theirs):
        train(model, 2, world, rank)
    sd = ours.state_dict()
    reference = theirs.state_dict()
    plain = copy.deepcopy(base)
    order_is_plain = list(sd) == list(plain.state_dict())
    plain.load_state_dict(sd)  # strict: the clean keys load straight into the unwrapped model
    # each name of the tied weight its own tensor, as torch's gives (safetensors.save_file needs that)
    tied_apart = sd["head.weight"].data_ptr() != sd["tok.weight"].data_ptr() and torch.equal(sd["head.weight"], sd["tok.weight"])
    return order_is_plain, sorted(sd) == sorted(reference), all(torch.equal(sd[k], reference[k]) for k in reference), tied_apart


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_state_dict_is_the_plain_models_and_equals_torch_fsdp1(strategy, use_orig_params):
    for order_is_plain, same_keys, bitwise, tied_apart in run_on_ranks(2, _full_matches_plain_and_torch, strategy, use_orig_params):
        assert order_is_plain
        assert same_keys
        assert bitwise
        assert tied_apart


def _rank0_only(use_orig_params, offload_to_cpu, torch_config):
    model, _ = _trained(use_orig_params=use_orig_params)
    if torch_config:
        from torch.distributed.fsdp import FullStateDictConfig
        from torch.distributed.fsdp import StateDictType as TorchStateDictType

        kind, config = TorchStateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=True)
    else:
        kind, config = StateDictType.FULL_STATE_DICT, fsdp1.FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=True)
    with FSDP.state_dict_type(model, kind, config):
        sd = model.state_dict()
    full = model.state_dict()
    return list(sd), dist.get_rank() != 0 or _bitwise(sd, full)


@pytest.mark.parametrize("torch_config", [False, True])
@pytest.mark.parametrize("offload_to_cpu", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_rank0_only_leaves_other_ranks_empty(use_orig_params, offload_to_cpu, torch_config):
    # torch's FSDP1 crashes here on CPU with offload_to_cpu ("setStorage ... storage of size 0").
    (keys0, equal0), (keys1, equal1) = run_on_ranks(2, _rank0_only, use_orig_params, offload_to_cpu, torch_config)
    assert len(keys0) == 27
    assert equal0
    assert keys1 == []
    assert equal1


def _under_plain_root(use_orig_params):
    """Units below a module that is not one: FULL keys keep the plain root's own entries, and
    state_dict_type reaches the units through it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = torch.nn.ModuleDict({"gpt": make_gpt(), "extra": torch.nn.Linear(3, 5)})
    reference = copy.deepcopy(plain).state_dict()
    plain["gpt"] = wrap_fsdp1(plain["gpt"], use_orig_params=use_orig_params)
    full = plain.state_dict()
    with FSDP.state_dict_type(plain, StateDictType.SHARDED_STATE_DICT):
        sharded = plain.state_dict()
        kinds = {type(v).__name__ for k, v in sharded.items() if k.startswith("gpt.")}
    with FSDP.state_dict_type(plain, StateDictType.FULL_STATE_DICT, fsdp1.FullStateDictConfig(rank0_only=True)):
        rank0_only = list(plain.state_dict())
    return _bitwise(full, reference), kinds, rank0_only, rank, world


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_state_dict_through_a_root_that_is_not_a_unit(use_orig_params):
    for equal, kinds, rank0_only, rank, _ in run_on_ranks(2, _under_plain_root, use_orig_params):
        assert equal
        assert kinds == {"DTensor"}
        assert rank0_only == (["extra.weight", "extra.bias"] if rank else rank0_only)
        assert rank or len(rank0_only) > 2


# ---------------------------------------------------------------------------------------- round trips
def _round_trip(kind, strategy, use_orig_params):
    model, _ = _trained(strategy, use_orig_params)
    saved_params = fsdp1_full_params(model)
    with FSDP.state_dict_type(model, StateDictType[kind]):
        saved = model.state_dict()
        saved = {k: _detached_copy(v) for k, v in saved.items()}
    train(model, 1, dist.get_world_size(), dist.get_rank())  # changes every parameter
    changed = not _bitwise(fsdp1_full_params(model), saved_params)
    with FSDP.state_dict_type(model, StateDictType[kind]):
        result = model.load_state_dict(saved)
    return changed, _bitwise(fsdp1_full_params(model), saved_params), list(result.missing_keys), list(result.unexpected_keys)


def _detached_copy(value):
    if isinstance(value, DTensor):
        return DTensor.from_local(value.to_local().clone(), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return value.clone()


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"])
def test_round_trip_restores_parameters_bitwise(kind, strategy, use_orig_params):
    for changed, restored, missing, unexpected in run_on_ranks(2, _round_trip, kind, strategy, use_orig_params):
        assert changed
        assert restored
        assert missing == []
        assert unexpected == []


# ---------------------------------------------------------------------------------------- DCP resharding
def _save_sharded(path, strategy, use_orig_params, world_only=None):
    model, _ = _trained(strategy, use_orig_params, steps=2)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save(model.state_dict(), checkpoint_id=path)
    return fsdp1_full_params(model)


def _load_sharded(path, strategy, use_orig_params, wrap_classes):
    model = wrap_fsdp1(make_tied_gpt(seed=7), strategy, use_orig_params, wrap_classes=wrap_classes)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        template = model.state_dict()
        dcp.load(template, checkpoint_id=path)
        model.load_state_dict(template)
    return model.state_dict()  # FULL, clean names: comparable whatever the wrapping


@pytest.mark.parametrize(
    "save_world, load_world, load_strategy, load_uop, load_wrap",
    [
        (2, 1, "FULL_SHARD", False, (Block,)),
        (2, 4, "FULL_SHARD", True, (Block,)),
        (4, 2, "SHARD_GRAD_OP", False, ()),
        (2, 2, "NO_SHARD", True, (Block,)),
    ],
)
def test_sharded_checkpoint_reshards_across_world_sizes_strategies_and_wrappings(tmp_path, save_world, load_world, load_strategy, load_uop, load_wrap):
    saved = run_on_ranks(save_world, _save_sharded, str(tmp_path), "FULL_SHARD", False)[0]
    for loaded in run_on_ranks(load_world, _load_sharded, str(tmp_path), load_strategy, load_uop, load_wrap):
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
        assert torch.equal(loaded["head.weight"], saved["tok.weight"])


# ---------------------------------------------------------------------------------------- torch interop
def _exchange_with_torch(kind, writer, use_orig_params, path):
    """One implementation trains and saves (FULL in memory, SHARDED through DCP); the other, freshly
    built from another seed, loads; both must then hold the same full parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    rank, world = dist.get_rank(), dist.get_world_size()
    wraps = {"fsdp1": (wrap_fsdp1, FSDP, StateDictType), "torch": (wrap_torch_fsdp, TorchFSDP, TorchStateDictType)}
    reader = "torch" if writer == "fsdp1" else "fsdp1"
    wrap_w, cls_w, kinds_w = wraps[writer]
    wrap_r, cls_r, kinds_r = wraps[reader]
    saving = wrap_w(make_tied_gpt(), "FULL_SHARD", use_orig_params)
    train(saving, 2, world, rank)
    loading = wrap_r(make_tied_gpt(seed=3), "SHARD_GRAD_OP", not use_orig_params)
    with cls_w.state_dict_type(saving, kinds_w[kind]):
        sd = saving.state_dict()
        if kind == "SHARDED_STATE_DICT":
            dcp.save(sd, checkpoint_id=path)
    with cls_r.state_dict_type(loading, kinds_r[kind]):
        if kind == "SHARDED_STATE_DICT":
            sd = loading.state_dict()
            dcp.load(sd, checkpoint_id=path)
        loading.load_state_dict(sd)
    with cls_w.state_dict_type(saving, kinds_w["FULL_STATE_DICT"]), cls_r.state_dict_type(loading, kinds_r["FULL_STATE_DICT"]):
        a, b = saving.state_dict(), loading.state_dict()
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("writer", ["fsdp1", "torch"])
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_checkpoints_move_between_fsdp1_and_torch_fsdp1(tmp_path, kind, writer, use_orig_params):
    assert all(run_on_ranks(2, _exchange_with_torch, kind, writer, use_orig_params, str(tmp_path)))


# ---------------------------------------------------------------------------------------- world size 1
def _sharded_at_world_size_one(path):
    model, _ = _trained()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
        kinds = {type(v).__name__ for v in sd.values()}
        dcp.save(sd, checkpoint_id=path)
    return kinds, fsdp1_full_params(model)


def test_sharded_state_dict_at_world_size_one_reloads_on_two_ranks(tmp_path):
    # torch's FSDP1 turns a one-rank group into NO_SHARD and returns full tensors (pytorch#109666).
    kinds, saved = run_on_ranks(1, _sharded_at_world_size_one, str(tmp_path))[0]
    assert kinds == {"DTensor"}
    for loaded in run_on_ranks(2, _load_sharded, str(tmp_path), "FULL_SHARD", False, (Block,)):
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)


# ---------------------------------------------------------------------------------------- failed loads
def _failed_load(kind, damage, use_orig_params):
    model, _ = _trained(use_orig_params=use_orig_params)
    before = fsdp1_full_params(model)
    with FSDP.state_dict_type(model, StateDictType[kind]):
        sd = dict(model.state_dict())
    other = wrap_fsdp1(make_tied_gpt(seed=5), use_orig_params=use_orig_params)
    with FSDP.state_dict_type(other, StateDictType[kind]):
        sd = dict(other.state_dict())
    if damage == "missing":
        del sd["blocks.1.fc.weight"]
    elif damage == "unexpected":
        sd["blocks.0.nonsense"] = torch.zeros(1)
    else:
        sd["blocks.1.fc.weight"] = torch.zeros(7, 3)
    with FSDP.state_dict_type(model, StateDictType[kind]):
        try:
            model.load_state_dict(sd)
            message = None
        except RuntimeError as error:
            message = str(error)
        unchanged = _bitwise(fsdp1_full_params(model), before)
        result = model.load_state_dict(sd, strict=False) if damage != "shape" else None
    after_lenient = fsdp1_full_params(model)
    loaded_rest = damage == "shape" or torch.equal(after_lenient["blocks.0.fc.weight"], fsdp1_full_params(other)["blocks.0.fc.weight"])
    keys = None if result is None else (list(result.missing_keys), list(result.unexpected_keys))
    return message, unchanged, keys, loaded_rest


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape"])
def test_a_failed_load_names_the_key_and_changes_nothing(kind, damage, use_orig_params):
    for message, unchanged, keys, loaded_rest in run_on_ranks(2, _failed_load, kind, damage, use_orig_params):
        assert unchanged
        assert loaded_rest
        assert "_fsdp_wrapped_module" not in message
        if damage == "missing":
            assert "missing key(s) 'blocks.1.fc.weight'" in message
            assert keys == (["blocks.1.fc.weight"], [])
        elif damage == "unexpected":
            assert "unexpected key(s) 'blocks.0.nonsense'" in message
            assert keys == ([], ["blocks.0.nonsense"])
        else:
            assert "'blocks.1.fc.weight'" in message
            assert "(7, 3)" in message
            assert "(31, 10)" in message


def _missing_in_checkpoint(path):
    model, _ = _trained()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
        del sd["ln_f.weight"]
        dcp.save(sd, checkpoint_id=path)
        template = model.state_dict()
        try:
            dcp.load(template, checkpoint_id=path)
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            return type(error).__name__, "ln_f.weight" in str(error)
    return None, False


def test_a_key_missing_from_a_sharded_checkpoint_is_an_error(tmp_path):
    # A SHARDED dict missing a key is refused by load_state_dict itself (test above; torch's FSDP1
    # logs and skips the weight); through DCP the template's keys must all be in the checkpoint.
    for name, names_key in run_on_ranks(2, _missing_in_checkpoint, str(tmp_path)):
        assert name is not None
        assert names_key


# ---------------------------------------------------------------------------------------- settings
def _settings():
    from torch.distributed.fsdp import ShardedStateDictConfig as TorchSharded
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    model, _ = _trained()
    default = FSDP.get_state_dict_type(model)
    previous = FSDP.set_state_dict_type(model, TorchStateDictType.SHARDED_STATE_DICT, TorchSharded(offload_to_cpu=True))
    now = FSDP.get_state_dict_type(model)
    try:
        FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT, fsdp1.FullStateDictConfig())
        error = None
    except RuntimeError as e:
        error = str(e)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        inside = FSDP.get_state_dict_type(model).state_dict_type
    after = FSDP.get_state_dict_type(model)
    return default, previous, now, error, inside, after


def test_state_dict_type_settings_accept_torchs_objects_and_restore():
    default, previous, now, error, inside, after = run_on_ranks(2, _settings)[0]
    assert default.state_dict_type is StateDictType.FULL_STATE_DICT
    assert previous == default
    assert now.state_dict_type is StateDictType.SHARDED_STATE_DICT
    assert now.state_dict_config == fsdp1.ShardedStateDictConfig(offload_to_cpu=True)
    assert "LocalStateDictConfig" in error
    assert "FullStateDictConfig" in error
    assert inside is StateDictType.FULL_STATE_DICT
    assert after == now


# ---------------------------------------------------------------------------------------- torch's DCP state-dict API
def _dcp_state_dict_api(path):
    """torch's helpers recognise fsdp1's class with ``import fsdp1`` alone: by default a SHARDED dict
    of DTensors whatever the model's own setting, as they give torch's FSDP1 its sharded one."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    model, _ = _trained()
    sd = get_model_state_dict(model)
    default_kinds = {type(v).__name__ for v in sd.values()}
    rank0_copy = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = get_model_state_dict(model)
        kinds = {type(v).__name__ for v in sharded.values()}
        dcp.save(sharded, checkpoint_id=path)
    before = fsdp1_full_params(model)
    train(model, 1, dist.get_world_size(), dist.get_rank())
    set_model_state_dict(model, sd)
    full_restored = _bitwise(fsdp1_full_params(model), before)
    train(model, 1, dist.get_world_size(), dist.get_rank())
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        template = get_model_state_dict(model)
        dcp.load(template, checkpoint_id=path)
        set_model_state_dict(model, template)
    sharded_restored = _bitwise(fsdp1_full_params(model), before)
    return (sorted(sd) == sorted(model.state_dict()), full_restored, kinds | default_kinds, sharded_restored,
            len(rank0_copy))


def test_torch_dcp_get_and_set_model_state_dict_work_on_fsdp1_models(tmp_path):
    results = run_on_ranks(2, _dcp_state_dict_api, str(tmp_path))
    for same_keys, full_restored, kinds, sharded_restored, _ in results:
        assert same_keys
        assert full_restored
        assert kinds == {"DTensor"}
        assert sharded_restored
    assert [copied for *_, copied in results] == [27, 0]  # full_state_dict + cpu_offload: rank 0 only


def _missing_key_through_torchs_helper():
    """torch's ``set_model_state_dict`` fills a key a full dict lacks with the rank's own shard: the
    key, fsdp1's refusal, and whether the model stayed as it was."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model, _ = _trained()
    options = StateDictOptions(full_state_dict=True)
    state = get_model_state_dict(model, options=options)
    key = next(key for key in state if key.endswith("weight"))
    del state[key]
    before = fsdp1_full_params(model)
    with pytest.raises(RuntimeError) as refused:
        set_model_state_dict(model, state, options=options)
    return key, str(refused.value), _bitwise(fsdp1_full_params(model), before)


def test_a_key_missing_from_a_full_dict_given_to_torchs_helper_is_named_as_missing():
    for key, refusal, unchanged in run_on_ranks(2, _missing_key_through_torchs_helper):
        assert unchanged and f"missing key '{key}'" in refusal and "size mismatch" not in refusal


# ---------------------------------------------------------------------------------------- real model families
def _hf_round_trip(name, use_orig_params, path):
    from test_hf_models import _family, _inputs, _train

    rank = dist.get_rank()
    base, block = _family(name)
    plain_keys = list(base.state_dict())
    model = wrap_fsdp1(copy.deepcopy(base), "FULL_SHARD", use_orig_params, wrap_classes=[block])
    _train(model, name, rank)
    full = model.state_dict()
    plain = copy.deepcopy(base)
    plain.load_state_dict(full)  # strict, into the unwrapped Hugging Face model
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save(model.state_dict(), checkpoint_id=path)
    fresh, _ = _family(name)
    torch.manual_seed(11)
    fresh.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    reloaded = wrap_fsdp1(fresh, "SHARD_GRAD_OP", not use_orig_params, wrap_classes=[block])
    with FSDP.state_dict_type(reloaded, StateDictType.SHARDED_STATE_DICT):
        template = reloaded.state_dict()
        dcp.load(template, checkpoint_id=path)
        reloaded.load_state_dict(template)
    again = reloaded.state_dict()
    same_outputs = torch.equal(plain(**_inputs(name, 9, rank)).logits, reloaded(**_inputs(name, 9, rank)).logits)
    return list(full) == plain_keys, _bitwise(again, full), same_outputs


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("name", ["gpt2", "llama_tied", "bert", "t5", "vit"])
def test_hugging_face_models_round_trip_full_and_sharded(tmp_path, name, use_orig_params):
    pytest.importorskip("transformers")
    for plain_keys, restored, same_outputs in run_on_ranks(2, _hf_round_trip, name, use_orig_params, str(tmp_path)):
        assert plain_keys
        assert restored
        assert same_outputs


# ---------------------------------------------------------------------------------------- summon_full_params
def _summon_options(use_orig_params):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_tied_gpt()
    model = wrap_fsdp1(copy.deepcopy(base), "FULL_SHARD", use_orig_params)
    ddp = DDP(copy.deepcopy(base))
    for m in (model, ddp):
        lm_loss(m, *batch(0, rank, world)).backward()
    expected_grads = {n: p.grad for n, p in ddp.module.named_parameters()}
    expected = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    with FSDP.summon_full_params(model, with_grads=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads = {n.replace("_fsdp_wrapped_module.", ""): g for n, g in grads.items()}
    grads_ok = all((grads[n] - g).abs().max() <= 1e-6 * g.abs().max() for n, g in expected_grads.items())
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
        shapes = {n.replace("_fsdp_wrapped_module.", ""): tuple(p.shape) for n, p in model.named_parameters()}
    full_shapes = {n: tuple(p.shape) for n, p in expected.items()}
    rank0_only_ok = (shapes == {n: s for n, s in full_shapes.items() if n in shapes}) if rank == 0 else shapes != full_shapes
    try:
        with FSDP.summon_full_params(model), torch.no_grad():
            model.module.ln_f.weight.add_(1.0)
            raise KeyError("body")
    except KeyError:
        pass
    after_raise = fsdp1_full_params(model)["ln_f.weight"]
    with torch.no_grad():
        ddp.module.ln_f.weight.add_(1.0)
    try:
        with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
            pass
        refused = None
    except NotImplementedError as error:  # torch's type
        refused = str(error)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    optim.step()  # gradients survived summon(with_grads=True) untouched
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp_optim.step()
    stepped = fsdp1_full_params(model)
    stepped_ok = all((stepped[n] - p.detach()).abs().max() <= 1e-5 for n, p in ddp.module.named_parameters() if n in stepped)
    edited_ok = torch.equal(after_raise, expected["ln_f.weight"] + 1.0)
    return grads_ok, rank0_only_ok, edited_ok, refused, stepped_ok


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_summon_full_params_options(use_orig_params):
    for grads_ok, rank0_only_ok, edited_ok, refused, stepped_ok in run_on_ranks(2, _summon_options, use_orig_params):
        assert grads_ok
        assert rank0_only_ok
        assert stepped_ok
        assert edited_ok  # in-place edits are written back even when the body raises; the state is restored
        assert "writeback=True, rank0_only=True" in refused


def _summon_after_a_forward_without_backward(strategy, use_orig_params):
    """backward, a metric forward with grad enabled (no backward for it), step, then
    summon_full_params: it must show the stepped values, and its writeback must keep them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world_size = dist.get_rank(), dist.get_world_size()
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
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert error <= TOLERANCE


# ---------------------------------------------------------------------------------------- offline tool
def _summon_between_forward_and_backward(strategy, use_orig_params):
    results = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = fsdp_wrapped(name, LinearNet(), sharding_strategy=fsdp_strategy(name, strategy), use_orig_params=use_orig_params)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4) + dist.get_rank()).sum()
        with fsdp_api(name)[0].FullyShardedDataParallel.summon_full_params(model):
            pass
        loss.backward()
        optim.step()
        results[name] = summoned_full_params(name, model)
    return results


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_summon_full_params_between_forward_and_backward_leaves_the_backward_intact(strategy, use_orig_params):
    """fsdp1's write-back bumped the version counter autograd checks, so the backward failed."""
    for result in run_on_ranks(2, _summon_between_forward_and_backward, strategy, use_orig_params):
        assert same_values(result["fsdp1"], result["torch"])


def _offload_to_cpu_on_no_shard():
    """A documented difference: torch's refuses ``offload_to_cpu=True`` for a NO_SHARD unit even on
    CPU; fsdp1 gives the full parameters, as for the other strategies."""
    found = {}
    for name in IMPLEMENTATIONS:
        api, kwargs = fsdp_api(name)
        torch.manual_seed(0)
        model = api.FullyShardedDataParallel(LinearNet(), sharding_strategy=api.ShardingStrategy.NO_SHARD, **kwargs)
        try:
            with api.FullyShardedDataParallel.summon_full_params(model, offload_to_cpu=True):
                found[name] = [(n.replace("_fsdp_wrapped_module.", ""), p.detach().clone()) for n, p in model.named_parameters()]
        except NotImplementedError:
            found[name] = "NotImplementedError"
    torch.manual_seed(0)
    return found, list(LinearNet().named_parameters())


def test_offload_to_cpu_on_a_no_shard_unit_works_where_torchs_refuses():
    for found, plain in run_on_ranks(2, _offload_to_cpu_on_no_shard):
        assert found["torch"] == "NotImplementedError"
        assert [n for n, _ in found["fsdp1"]] == [n for n, _ in plain]
        assert all(torch.equal(ours, theirs) for (_, ours), (_, theirs) in zip(found["fsdp1"], plain))


def test_checkpoint_tool_consolidates_an_fsdp1_checkpoint_into_the_plain_model(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    saved = run_on_ranks(2, _save_sharded, str(tmp_path / "ckpt"), "FULL_SHARD", True)[0]
    tool = Path(__file__).resolve().parents[1] / "tools" / "checkpoint.py"
    for out in ("model.pt", "model.safetensors"):
        subprocess.run([sys.executable, str(tool), "consolidate", str(tmp_path / "ckpt"), str(tmp_path / out)], check=True)
        if out.endswith(".pt"):
            consolidated = torch.load(tmp_path / out, weights_only=True)
        else:
            from safetensors.torch import load_file

            consolidated = load_file(str(tmp_path / out))
        plain = make_tied_gpt(seed=9)
        plain.load_state_dict(consolidated)  # strict
        assert all(torch.equal(p, saved[n]) for n, p in plain.named_parameters())


def _tied_names_disagree(kind, use_orig_params):
    """A dict whose two names of one tied weight hold different values: the last one wins, as the
    plain model's load_state_dict decides."""
    model = wrap_fsdp1(make_tied_gpt(), use_orig_params=use_orig_params)
    with FSDP.state_dict_type(model, StateDictType[kind]):
        sd = model.state_dict()
    plain = make_tied_gpt()
    full = plain.state_dict()
    full["tok.weight"], full["head.weight"] = torch.full_like(full["tok.weight"], 3.0), torch.full_like(full["tok.weight"], 5.0)
    plain.load_state_dict(full)
    if kind == "SHARDED_STATE_DICT":
        for name, value in (("tok.weight", 3.0), ("head.weight", 5.0)):
            local = sd[name].to_local()
            sd[name] = DTensor.from_local(torch.full_like(local, value), sd[name].device_mesh, sd[name].placements,
                                          run_check=False, shape=sd[name].shape, stride=sd[name].stride())
    else:
        sd = full
    with FSDP.state_dict_type(model, StateDictType[kind]):
        model.load_state_dict(sd)
    return torch.equal(fsdp1_full_params(model)["tok.weight"], plain.tok.weight.detach())


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_tied_names_holding_different_values_load_as_the_plain_model_does(kind, use_orig_params):
    assert all(run_on_ranks(2, _tied_names_disagree, kind, use_orig_params))


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 5, 3)
        self.bn = torch.nn.BatchNorm2d(5)
        self.head = torch.nn.Linear(5, 7)

    def forward(self, x):
        return self.head(self.bn(self.conv(x)).mean((2, 3)))


def _batchnorm_buffer_missing():
    torch.manual_seed(0)
    model = FSDP(_ConvNet(), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({torch.nn.BatchNorm2d}))
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    other = {k: v + 1 if v.is_floating_point() else v for k, v in before.items()}
    del other["bn.running_mean"]
    try:
        model.load_state_dict(other)
        message = None
    except RuntimeError as error:
        message = str(error)
    return message, _bitwise(model.state_dict(), before)


def test_a_missing_batchnorm_buffer_is_refused_before_anything_loads():
    for message, unchanged in run_on_ranks(2, _batchnorm_buffer_missing):
        assert "missing key(s) 'bn.running_mean'" in message
        assert unchanged


# ---------------------------------------------------------------------------------------- activation checkpointing
def _checkpointed_state_dicts(order, use_orig_params, path):
    """torch's checkpoint wrapper around each block, applied before or after wrapping: state-dict keys
    stay the plain model's, and FULL and SHARDED dicts load back bitwise."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing, checkpoint_wrapper

    base = make_tied_gpt()
    plain_keys = list(base.state_dict())
    model = copy.deepcopy(base)
    if order == "before":
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, Block))
        model = FSDP(model, auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    else:
        model = wrap_fsdp1(model, use_orig_params=use_orig_params)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, Block))
    train(model, 1, dist.get_world_size(), dist.get_rank())
    full = model.state_dict()
    saved = fsdp1_full_params(model)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded_keys = list(model.state_dict())
        dcp.save(model.state_dict(), checkpoint_id=path)
    train(model, 1, dist.get_world_size(), dist.get_rank())
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        template = model.state_dict()
        dcp.load(template, checkpoint_id=path)
        model.load_state_dict(template)
    restored = _bitwise(fsdp1_full_params(model), saved)
    model.load_state_dict(full)
    return list(full) == plain_keys, sharded_keys == plain_keys, restored, _bitwise(fsdp1_full_params(model), saved)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("order", ["before", "after"])
def test_state_dicts_stay_clean_with_activation_checkpointing(tmp_path, order, use_orig_params):
    for full_clean, sharded_clean, sharded_restored, full_restored in run_on_ranks(
        2, _checkpointed_state_dicts, order, use_orig_params, str(tmp_path)
    ):
        assert full_clean
        assert sharded_clean
        assert sharded_restored
        assert full_restored


def _full_inside_summon(use_orig_params):
    """PEFT saves adapters with ``state_dict()`` inside ``summon_full_params``, which torch's allows:
    the same keys and values as torch's there, on the wrapper and on its wrapped module."""
    results = []
    for wrap in (wrap_fsdp1, wrap_torch_fsdp):
        model = wrap(make_gpt(), use_orig_params=use_orig_params)
        with type(model).summon_full_params(model):
            results.append([{key: value.clone() for key, value in module.state_dict().items()}
                            for module in (model, model.module)])
    return results


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_full_state_dict_inside_summon_full_params_equals_torchs(use_orig_params):
    for ours, theirs in run_on_ranks(2, _full_inside_summon, use_orig_params):
        for mine, torchs in zip(ours, theirs):
            assert list(mine) == list(torchs)
            assert all(torch.equal(mine[k], torchs[k]) for k in torchs)


def _offloaded_summons(impl, use_orig_params):
    """The full values ``summon_full_params(offload_to_cpu=True)`` shows after a step, with and without
    ``rank0_only``, and the writeback of a change made inside; against DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_gpt()
    api, cpu = fsdp_api(impl)
    model = api.FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=api.wrap.ModuleWrapPolicy({Block}),
                                         use_orig_params=use_orig_params, **cpu)
    ddp = DDP(copy.deepcopy(base))
    for each in (model, ddp):
        lm_loss(each, *batch(0, rank, world)).backward()
        torch.optim.SGD(each.parameters(), lr=0.1).step()
    expected = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    shown = {}
    for rank0_only in (False, True):
        with api.FullyShardedDataParallel.summon_full_params(model, writeback=False, offload_to_cpu=True,
                                                             rank0_only=rank0_only):
            shown[rank0_only] = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    with api.FullyShardedDataParallel.summon_full_params(model, offload_to_cpu=True), torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    with api.FullyShardedDataParallel.summon_full_params(model):
        written = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    return (all(torch.equal(shown[False][n], v) for n, v in expected.items()),
            rank != 0 or all(torch.equal(shown[True][n], v) for n, v in expected.items()),
            all(torch.equal(written[n], v + 1.0) for n, v in expected.items()))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_summon_full_params_offloaded_to_the_cpu_shows_and_writes_back_the_full_values(use_orig_params):
    """On a CPU, where the unsharded values already are: torch's FSDP1 fails there before 2.14, reading
    the storage it has just freed ("out of bounds for storage of size 0"); fsdp1 shows DDP's values on
    every release, as torch's does from 2.14."""
    from fsdp1._torch_version import release

    impls = ["fsdp1"] + (["torch"] if release(torch.__version__) >= (2, 14) else [])
    for impl in impls:
        assert all(all(ranks) for ranks in run_on_ranks(2, _offloaded_summons, impl, use_orig_params)), impl
