"""Tests optimizer state dicts: FULL equals torch's FSDP1's after identical training; saving model and
optimizer mid-run and loading both into fresh objects continues bit for bit like the uninterrupted run
(FULL in memory, SHARDED through DCP, both use_orig_params, several param groups, SGD with momentum,
Adam, AdamW, Adagrad), also through the HF Accelerate call sequence on a fresh optimizer, and after
resharding from 2 ranks to 4 and back. The older ``shard_full_optim_state_dict`` /
``scatter_full_optim_state_dict`` without ``optim=`` give torch's FSDP1's dict and warning."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp1
from fsdp1 import FullyShardedDataParallel as FSDP
from fsdp1 import StateDictType

from _harness import run_on_ranks
from _models import (
    adam,
    fsdp1_full_params,
    fsdp_api,
    make_gpt,
    make_tied_gpt,
    same_values,
    torch_fsdp_full_params,
    train_steps,
    wrap_fsdp1,
    wrap_torch_fsdp,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

OPTIMIZERS = {
    "adamw_groups": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.1),
}


def _optimizer(model, name):
    """The usual split into two groups by name, as HF's Trainer makes it: no weight decay on biases
    and norms (with use_orig_params=False a unit's flat parameter holds both and decays)."""
    named = list(model.named_parameters())
    def no_decay(n):
        return n.endswith("bias") or ".ln" in n or n.startswith("ln")
    decay = [p for n, p in named if not no_decay(n)]
    rest = [p for n, p in named if no_decay(n)]
    groups = [{"params": decay}] + ([{"params": rest, "weight_decay": 0.0}] if rest else [])
    return OPTIMIZERS[name](groups)


def _resume(kind, via_dcp, optimizer, use_orig_params, path, frozen=False):
    model = wrap_fsdp1(_maybe_frozen(make_tied_gpt(), frozen), use_orig_params=use_orig_params)
    optim = _optimizer(model, optimizer)
    train_steps(model, optim, 0, 3)
    with FSDP.state_dict_type(model, StateDictType[kind]):
        model_state, optim_state = model.state_dict(), FSDP.optim_state_dict(model, optim)
        if via_dcp:
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        else:
            model_state, optim_state = copy.deepcopy(model_state), copy.deepcopy(optim_state)
    uninterrupted = train_steps(model, optim, 3, 3)

    fresh = wrap_fsdp1(_maybe_frozen(make_tied_gpt(seed=5), frozen), use_orig_params=use_orig_params)
    fresh_optim = _optimizer(fresh, optimizer)
    with FSDP.state_dict_type(fresh, StateDictType[kind]):
        if via_dcp:  # HF Accelerate's sequence: templates from the fresh objects, filled by DCP
            state = {"model": fresh.state_dict(), "optim": FSDP.optim_state_dict(fresh, fresh_optim)}
            dcp.load(state, checkpoint_id=path)
            model_state, optim_state = state["model"], state["optim"]
        fresh.load_state_dict(model_state)
        fresh_optim.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optim, optim_state))
    resumed = train_steps(fresh, fresh_optim, 3, 3)
    return uninterrupted, resumed


def _maybe_frozen(model, frozen):
    """With ``frozen``, attention of the first block is frozen: its parameters never get state."""
    if frozen:
        model.blocks[0].qkv.requires_grad_(False)
        model.blocks[0].proj.requires_grad_(False)
    return model


def test_resume_with_frozen_parameters_that_have_no_state(tmp_path):
    for uninterrupted, resumed in run_on_ranks(2, _resume, "SHARDED_STATE_DICT", True, "adamw_groups", True, str(tmp_path), True):
        assert resumed == uninterrupted


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind, via_dcp", [("FULL_STATE_DICT", False), ("FULL_STATE_DICT", True), ("SHARDED_STATE_DICT", True),
                                           ("LOCAL_STATE_DICT", False)])
def test_resume_continues_bit_for_bit(tmp_path, kind, via_dcp, optimizer, use_orig_params):
    for uninterrupted, resumed in run_on_ranks(2, _resume, kind, via_dcp, optimizer, use_orig_params, str(tmp_path)):
        assert resumed == uninterrupted


def _full_equals_torch_and_ddp(use_orig_params):
    """Ground truth: DDP's optimizer state by parameter name (bitwise on 2 ranks), and torch's FSDP1's
    FULL optimizer state dict, which is right only without use_orig_params (with it, its gathered
    exp_avg is 0.29 off DDP's here)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours = wrap_fsdp1(make_tied_gpt(), use_orig_params=use_orig_params)
    theirs = wrap_torch_fsdp(make_tied_gpt(), use_orig_params=use_orig_params)
    ddp = DDP(make_tied_gpt())
    states = []
    for model, cls in ((ours, FSDP), (theirs, TorchFSDP)):
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        train_steps(model, optim, 0, 2)
        states.append(cls.optim_state_dict(model, optim))
    optim = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    train_steps(ddp, optim, 0, 2)
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    reference = {names[id(p)]: optim.state[p] for p in optim.param_groups[0]["params"]}
    a, b = states

    def equal(x, y):
        return sorted(x) == sorted(y) and all(sorted(x[k]) == sorted(y[k]) and all(torch.equal(x[k][n], y[k][n]) for n in x[k]) for k in x)

    return equal(a["state"], reference), equal(a["state"], b["state"]), a["param_groups"] == b["param_groups"]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_optim_state_dict_equals_ddp_and_torch_fsdp1(use_orig_params):
    for like_ddp, like_torch, same_groups in run_on_ranks(2, _full_equals_torch_and_ddp, use_orig_params):
        assert like_ddp
        assert same_groups
        assert like_torch or use_orig_params  # torch's is wrong with use_orig_params=True


def _save_for_reshard(path, use_orig_params):
    model = wrap_fsdp1(make_tied_gpt(), use_orig_params=use_orig_params)
    optim = _optimizer(model, "adamw_groups")
    train_steps(model, optim, 0, 3)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, checkpoint_id=path)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return FSDP.optim_state_dict(model, optim)["state"]


def _load_resharded(path, use_orig_params, save_to=None):
    model = wrap_fsdp1(make_tied_gpt(seed=5), "SHARD_GRAD_OP", use_orig_params)
    optim = _optimizer(model, "adamw_groups")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        FSDP.optim_state_dict_to_load(model, optim, state["optim"], load_directly=True)
        if save_to is not None:
            dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, checkpoint_id=save_to)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return FSDP.optim_state_dict(model, optim)["state"]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_sharded_optimizer_state_reshards_from_2_to_4_ranks_and_back(tmp_path, use_orig_params):
    saved = run_on_ranks(2, _save_for_reshard, str(tmp_path / "a"), use_orig_params)[0]
    on_four = run_on_ranks(4, _load_resharded, str(tmp_path / "a"), use_orig_params, str(tmp_path / "b"))
    back_on_two = run_on_ranks(2, _load_resharded, str(tmp_path / "b"), use_orig_params)
    for loaded in on_four + back_on_two:
        assert sorted(loaded) == sorted(saved)
        assert all(torch.equal(loaded[k][n], saved[k][n]) for k in saved for n in saved[k])


def _legacy_and_rank0(use_orig_params):
    """The older functions and FULL with rank0_only give what the current API gives; a rank-0-only
    FULL dict is scattered so that every rank resumes exactly; rekeying by position loads the state
    into the unwrapped model's optimizer."""
    import fsdp1

    rank = dist.get_rank()
    model = wrap_fsdp1(make_tied_gpt(), use_orig_params=use_orig_params)
    optim = _optimizer(model, "adam")
    train_steps(model, optim, 0, 2)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = FSDP.optim_state_dict(model, optim)
    legacy_full = FSDP.full_optim_state_dict(model, optim)  # rank 0 only, as torch's default
    config = fsdp1.FullOptimStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config):
        rank0 = FSDP.optim_state_dict(model, optim)
    def same(a, b):
        return all(torch.equal(a["state"][k][n], b["state"][k][n]) for k in a["state"] for n in a["state"][k])
    matches = (same(legacy_full, full) and same(rank0, full)) if rank == 0 else (legacy_full == {} and rank0 == {})
    expected = optim.state_dict()
    sharded = FSDP.sharded_optim_state_dict(model, optim)
    loaded = []
    for how in ("shard_full", "scatter", "rank0_config", "flatten_sharded"):
        fresh = wrap_fsdp1(make_tied_gpt(), use_orig_params=use_orig_params)
        fresh_optim = _optimizer(fresh, "adam")
        if how == "shard_full":
            state = FSDP.shard_full_optim_state_dict(full, fresh, optim=fresh_optim)
        elif how == "scatter":
            state = FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, fresh, optim=fresh_optim)
        elif how == "rank0_config":
            with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config):
                state = FSDP.optim_state_dict_to_load(fresh, fresh_optim, full if rank == 0 else {})
        else:
            state = FSDP.flatten_sharded_optim_state_dict(sharded, fresh, fresh_optim)
        fresh_optim.load_state_dict(state)
        got = fresh_optim.state_dict()
        loaded.append(all(
            sorted(got["state"][i]) == sorted(expected["state"][i])
            and all(torch.equal(got["state"][i][n], expected["state"][i][n]) for n in expected["state"][i])
            for i in expected["state"]
        ) and sorted(got["state"]) == sorted(expected["state"]))
    # into a model without FSDP: FULL dict -> positions of the unwrapped model's parameters
    plain = make_tied_gpt()
    named = list(plain.named_parameters())
    plain_optim = torch.optim.Adam(
        [{"params": [p for n, p in named if n in group["params"]]} for group in full["param_groups"]], lr=1e-2
    )
    by_position = FSDP.rekey_optim_state_dict(full, fsdp1.OptimStateKeyType.PARAM_ID, plain)
    plain_optim.load_state_dict(by_position)
    by_name = dict(plain.named_parameters())
    into_plain = all(torch.equal(plain_optim.state[by_name[k]][n], v) for k, s in full["state"].items() for n, v in s.items())
    back = FSDP.rekey_optim_state_dict(by_position, fsdp1.OptimStateKeyType.PARAM_NAME, plain)
    return matches, loaded, into_plain, sorted(back["state"]) == sorted(full["state"])


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_older_functions_rank0_only_and_rekeying(use_orig_params):
    for matches, loaded, into_plain, back in run_on_ranks(2, _legacy_and_rank0, use_orig_params):
        assert matches
        assert loaded == [True, True, True, True]
        assert into_plain
        assert back


def _resume_across(kind, save_strategy, load_strategy, load_wrap, use_orig_params, path):
    """Save under one strategy and wrapping, resume under another: the losses continue as the
    uninterrupted run's (to 1e-6; a different wrapping changes the reduction order)."""
    from _models import Block

    model = wrap_fsdp1(make_tied_gpt(), save_strategy, use_orig_params)
    optim = _optimizer(model, "adam")
    train_steps(model, optim, 0, 2)
    with FSDP.state_dict_type(model, StateDictType[kind]):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, checkpoint_id=path)
    uninterrupted = train_steps(model, optim, 2, 2)
    fresh = wrap_fsdp1(make_tied_gpt(seed=5), load_strategy, use_orig_params, wrap_classes=(Block,) if load_wrap else ())
    fresh_optim = _optimizer(fresh, "adam")
    with FSDP.state_dict_type(fresh, StateDictType[kind]):
        state = {"model": fresh.state_dict(), "optim": FSDP.optim_state_dict(fresh, fresh_optim)}
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state["model"])
        FSDP.optim_state_dict_to_load(fresh, fresh_optim, state["optim"], load_directly=True)
    return uninterrupted, train_steps(fresh, fresh_optim, 2, 2)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize(
    "kind, save_strategy, load_strategy, load_wrap",
    [("SHARDED_STATE_DICT", "NO_SHARD", "FULL_SHARD", True), ("SHARDED_STATE_DICT", "FULL_SHARD", "NO_SHARD", True),
     ("FULL_STATE_DICT", "NO_SHARD", "NO_SHARD", True), ("SHARDED_STATE_DICT", "FULL_SHARD", "FULL_SHARD", False)],
)
def test_resume_under_another_strategy_or_wrapping(tmp_path, kind, save_strategy, load_strategy, load_wrap, use_orig_params):
    from _models import relative_errors

    for uninterrupted, resumed in run_on_ranks(2, _resume_across, kind, save_strategy, load_strategy, load_wrap,
                                               use_orig_params, str(tmp_path)):
        assert relative_errors(resumed, uninterrupted) <= 1e-6


def _fresh_template_and_steps(use_orig_params):
    """Asking a fresh optimizer for its state changes nothing that follows, and each name gets a
    step of its own (an optimizer adds to it in place)."""
    model = wrap_fsdp1(make_tied_gpt(), use_orig_params=use_orig_params)
    twin = wrap_fsdp1(make_tied_gpt(), use_orig_params=use_orig_params)
    optim, twin_optim = _optimizer(model, "adam"), _optimizer(twin, "adam")
    template = FSDP.optim_state_dict(model, optim)
    complete = len(template["state"]) == 26 and all(float(s["step"]) == 0.0 for s in template["state"].values())
    same = train_steps(model, optim, 0, 2) == train_steps(twin, twin_optim, 0, 2)
    full = FSDP.optim_state_dict(model, optim)
    steps = [s["step"] for s in full["state"].values()]
    own_steps = len({id(step) for step in steps}) == len(steps)
    return complete, same, own_steps


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_fresh_optimizers_template_is_complete_and_changes_nothing(use_orig_params):
    for complete, same, own_steps in run_on_ranks(2, _fresh_template_and_steps, use_orig_params):
        assert complete
        assert same
        assert own_steps


def _hybrid_rank0_only(use_orig_params):
    """HYBRID_SHARD (2 replicas × 2): a FULL dict held by rank 0 alone reaches every replica."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp1

    mesh = init_device_mesh("cpu", (2, 2))
    from _models import Block

    def build(seed):
        return FSDP(make_tied_gpt(seed), sharding_strategy=fsdp1.ShardingStrategy.HYBRID_SHARD, device_mesh=mesh,
                    use_orig_params=use_orig_params, auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}))
    model = build(0)
    optim = _optimizer(model, "adam")
    train_steps(model, optim, 0, 2)
    config = fsdp1.FullOptimStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config):
        full = FSDP.optim_state_dict(model, optim)
    expected = optim.state_dict()["state"]
    fresh = build(5)
    fresh_optim = _optimizer(fresh, "adam")
    with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config):
        FSDP.optim_state_dict_to_load(fresh, fresh_optim, full, load_directly=True)
    got = fresh_optim.state_dict()["state"]
    return sorted(got) == sorted(expected) and all(torch.equal(got[i][n], expected[i][n]) for i in expected for n in expected[i])


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_rank0_only_load_reaches_every_replica_of_hybrid_sharding(use_orig_params):
    assert all(run_on_ranks(4, _hybrid_rank0_only, use_orig_params))


def _reused_and_mismatched(use_orig_params):
    """One FULL dict kept in memory and loaded into two fresh optimizers: both resume exactly (the
    optimizers' ``step`` tensors are copies, not the dict's); then rank 0's dict of another model
    under rank0_only is refused on every rank (rank 0 alone failed and the others waited)."""
    import fsdp1

    model = wrap_fsdp1(make_tied_gpt(), use_orig_params=use_orig_params)
    optim = _optimizer(model, "adam")
    train_steps(model, optim, 0, 2)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        saved = FSDP.optim_state_dict(model, optim)
        model_state = model.state_dict()
    steps_before = [s["step"].item() for s in saved["state"].values()]
    resumed = []
    for _ in range(2):
        fresh = wrap_fsdp1(make_tied_gpt(seed=3), use_orig_params=use_orig_params)
        fresh_optim = _optimizer(fresh, "adam")
        with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
            fresh.load_state_dict(model_state)
            fresh_optim.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optim, saved))
        resumed.append(train_steps(fresh, fresh_optim, 2, 2))
    steps_after = [s["step"].item() for s in saved["state"].values()]
    other = wrap_fsdp1(make_tied_gpt(), use_orig_params=use_orig_params)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    wide = {"state": {k: {n: torch.cat([v, v]) if v.dim() else v for n, v in s.items()} for k, s in saved["state"].items()},
            "param_groups": saved["param_groups"]} if dist.get_rank() == 0 else {}
    config = fsdp1.FullOptimStateDictConfig(rank0_only=True)
    other_optim = _optimizer(other, "adam")
    try:
        with FSDP.state_dict_type(other, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config):
            FSDP.optim_state_dict_to_load(other, other_optim, wide)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return resumed, steps_before == steps_after, refusal


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_dict_loads_twice_alike_and_a_wrong_rank0_dict_is_refused_everywhere(use_orig_params):
    for (first, second), unchanged, refusal in run_on_ranks(2, _reused_and_mismatched, use_orig_params):
        assert first == second
        assert unchanged
        assert refusal is not None
        assert "has shape" in refusal
        assert "rank 0's dict" in refusal


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
        fsdp = fsdp_api(name)[0].FullyShardedDataParallel
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
        assert same_values(ours_sharded, theirs_sharded)
        assert same_values(ours_scattered, theirs_scattered)
        assert same_values(ours_params, theirs_params)  # after a step from the loaded state
        assert ours_warned == theirs_warned == [("FutureWarning", True, True)] * 2


def _renamed_key(kind, use_orig_params):
    """A FULL (also rank0_only, where only rank 0 holds the dict) or SHARDED optimizer state dict with
    one parameter's key renamed: refused on every rank, naming the key, with the optimizer untouched
    (torch's FSDP1 drops that parameter's state without a word)."""
    import fsdp1

    model = wrap_fsdp1(make_gpt(), use_orig_params=use_orig_params)
    optim = _optimizer(model, "adam")
    train_steps(model, optim, 0, 1)
    rank0_only = kind == "rank0_only"
    settings = ((StateDictType.SHARDED_STATE_DICT,) if kind == "sharded" else
                (StateDictType.FULL_STATE_DICT, None, fsdp1.FullOptimStateDictConfig(rank0_only=rank0_only)))
    with FSDP.state_dict_type(model, *settings):
        saved = FSDP.optim_state_dict(model, optim)
        if not rank0_only or dist.get_rank() == 0:
            saved["state"]["blocks.0.fc.weightX"] = saved["state"].pop("blocks.0.fc.weight")
        fresh = _optimizer(model, "adam")
        try:
            FSDP.optim_state_dict_to_load(model, fresh, saved, load_directly=True)
            refusal = None
        except ValueError as error:
            refusal = str(error)
    return refusal, len(fresh.state)


@pytest.mark.parametrize("kind", ["full", "rank0_only", "sharded"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_state_for_a_name_no_parameter_has_is_refused_on_every_rank(kind, use_orig_params):
    for refusal, states in run_on_ranks(2, _renamed_key, kind, use_orig_params):
        assert refusal is not None and "'blocks.0.fc.weightX'" in refusal and "rank 0's" in refusal
        assert "_fsdp_wrapped_module" not in refusal
        assert states == 0
