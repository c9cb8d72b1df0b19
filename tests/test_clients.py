"""Tests ``fsdp1.use_as_torch_fsdp`` with the clients that reach for torch's class by name, running
their own code: HF Accelerate's ``save_fsdp_model`` / ``load_fsdp_model`` / ``save_fsdp_optimizer`` /
``load_fsdp_optimizer`` resume training bit for bit (FULL and SHARDED, both use_orig_params), and
``extract_model_from_parallel`` unwraps fsdp1's units. torch's own ``torch.distributed.checkpoint.
state_dict`` helpers, which recognise fsdp1's modules with or without the alias, give torch's keys
and shards and resume bit for bit in both forms, also from a checkpoint torch's FSDP1 wrote. Accelerate only enters
its FSDP mode on accelerators, so its functions are called directly here, with its plugin and a
stand-in for the ``Accelerator`` (the attributes they read). And the code of PyTorch's FSDP tutorial
(MNIST) as written, ranks seeded apart, trains as under torch's FSDP1, bit for bit."""

import contextlib
import functools
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp1

from _accelerate import accelerator_stand_in, load_with_accelerate, save_with_accelerate
from _harness import run_on_ranks
from _models import IMPLEMENTATIONS, Block, adam, fsdp_api, make_gpt, same_values, train_steps, wrap_fsdp1, wrap_torch_fsdp

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def test_use_as_torch_fsdp_puts_fsdp1_at_both_import_paths_and_back():
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.fully_sharded_data_parallel as torch_fsdp_module

    original = torch_fsdp.FullyShardedDataParallel
    with fsdp1.use_as_torch_fsdp():
        from torch.distributed.fsdp import FullyShardedDataParallel as ByPackage
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as ByModule

        assert ByPackage is ByModule is fsdp1.FullyShardedDataParallel
    assert torch_fsdp.FullyShardedDataParallel is torch_fsdp_module.FullyShardedDataParallel is original
    alias = fsdp1.use_as_torch_fsdp()  # the call form stays until undone
    assert torch_fsdp.FullyShardedDataParallel is fsdp1.FullyShardedDataParallel
    alias.undo()
    assert torch_fsdp.FullyShardedDataParallel is original


def test_use_as_torch_fsdp_undone_in_any_order_restores_torchs_class_once_none_is_in_effect():
    import torch.distributed.fsdp as torch_fsdp

    original = torch_fsdp.FullyShardedDataParallel
    library, user = fsdp1.use_as_torch_fsdp(), fsdp1.use_as_torch_fsdp()
    library.undo()  # the first one first: the user's is still in effect
    assert torch_fsdp.FullyShardedDataParallel is fsdp1.FullyShardedDataParallel
    user.undo()
    user.undo()
    assert torch_fsdp.FullyShardedDataParallel is original


def test_torchs_helpers_recognise_both_classes_whatever_the_import_order():
    """torch's modules that recognise FSDP modules by class (the state-dict helpers, the pipeline
    stages and schedules, ``_NamedOptimizer``) recognise torch's and fsdp1's once fsdp1 is imported:
    imported before fsdp1, after it, or while the alias is in effect (binding fsdp1's names), and
    after the alias is undone."""
    check = ("import torch.distributed.fsdp as f\n"
             "from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule as TorchModule\n"
             "def recognised(helpers, stage, schedules, named):\n"
             "    for cls in (helpers.FSDP, named.FSDP):\n"
             "        assert issubclass(f.fully_sharded_data_parallel.FullyShardedDataParallel, cls)\n"
             "        assert issubclass(fsdp1.FullyShardedDataParallel, cls)\n"
             "    for cls in (stage.FSDPModule, schedules.FSDPModule):\n"
             "        assert issubclass(TorchModule, cls) and issubclass(fsdp1.FSDPModule, cls)\n"
             "    assert not hasattr(stage, 'fully_shard') or stage.fully_shard.state is not None\n")  # before 2.15
    modules = ("import torch.distributed.checkpoint.state_dict as helpers, torch.distributed.pipelining.stage as stage\n"
               "import torch.distributed.pipelining.schedules as schedules, torch.distributed.optim.named_optimizer as named\n")
    orders = {
        "before": modules + "import fsdp1\n" + check + "recognised(helpers, stage, schedules, named)\n",
        "after": "import fsdp1\n" + check + modules + "recognised(helpers, stage, schedules, named)\n",
        "under the alias": ("import fsdp1\n" + check + "with fsdp1.use_as_torch_fsdp():\n    "
                            + modules.replace("\nimport", "\n    import") + "recognised(helpers, stage, schedules, named)\n"),
    }
    runs = {order: subprocess.Popen([sys.executable, "-W", "ignore", "-c", script], stderr=subprocess.PIPE, text=True)
            for order, script in orders.items()}
    for order, run in runs.items():
        _, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, (order, stderr[-2000:])


def _accelerate_save_and_resume(kind, use_orig_params, directory):
    from accelerate.utils import FullyShardedDataParallelPlugin, extract_model_from_parallel
    from torch.distributed.fsdp import StateDictType

    accelerator = accelerator_stand_in()
    with fsdp1.use_as_torch_fsdp():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type=StateDictType[kind],
                                                use_orig_params=use_orig_params)
        model = wrap_fsdp1(make_gpt(), use_orig_params=use_orig_params)
        optim = adam(model.parameters())
        train_steps(model, optim, 0, 3)
        save_with_accelerate(plugin, accelerator, model, optim, directory)
        uninterrupted = train_steps(model, optim, 3, 3)
        resumed_model = wrap_fsdp1(make_gpt(seed=7), use_orig_params=use_orig_params)
        resumed_optim = adam(resumed_model.parameters())
        load_with_accelerate(plugin, accelerator, resumed_model, resumed_optim, directory)
        resumed = train_steps(resumed_model, resumed_optim, 3, 3)
        unwrapped = extract_model_from_parallel(model)
    return uninterrupted, resumed, type(unwrapped).__name__


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_accelerate_saves_and_resumes_bitwise(kind, use_orig_params, tmp_path):
    pytest.importorskip("accelerate")
    for uninterrupted, resumed, unwrapped in run_on_ranks(2, _accelerate_save_and_resume, kind, use_orig_params, str(tmp_path)):
        assert resumed == uninterrupted
        assert unwrapped == "TinyGPT"


def _dcp_helpers_save_and_resume(full, use_orig_params, form, directory):
    """torch's FSDP1 trains 2 steps, saves through ``get_state_dict`` + ``dcp.save`` and trains on;
    fsdp1 (``import fsdp1`` alone, or under the alias) resumes from that checkpoint through
    ``set_state_dict``, then saves and resumes from its own. Returns torch's continuation and both of
    fsdp1's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(full_state_dict=full)

    def save(model, optim, path):
        model_state, optim_state = get_state_dict(model, optim, options=options)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)

    def resume(path):
        model = wrap_fsdp1(make_gpt(seed=7), use_orig_params=use_orig_params)
        optim = adam(model.parameters())
        model_state, optim_state = get_state_dict(model, optim, options=options)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
        return train_steps(model, optim, 2, 2)

    theirs = wrap_torch_fsdp(make_gpt(), use_orig_params=use_orig_params)
    their_optim = adam(theirs.parameters())
    train_steps(theirs, their_optim, 0, 2)
    save(theirs, their_optim, f"{directory}/torch")
    their_continuation = train_steps(theirs, their_optim, 2, 2)
    with fsdp1.use_as_torch_fsdp() if form == "alias" else contextlib.nullcontext():
        from_torch = resume(f"{directory}/torch")
        ours = wrap_fsdp1(make_gpt(), use_orig_params=use_orig_params)
        optim = adam(ours.parameters())
        train_steps(ours, optim, 0, 2)
        save(ours, optim, f"{directory}/fsdp1")
        uninterrupted = train_steps(ours, optim, 2, 2)
        from_fsdp1 = resume(f"{directory}/fsdp1")
    return their_continuation, from_torch, uninterrupted, from_fsdp1


@pytest.mark.parametrize("form", ["plain", "alias"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("full", [True, False], ids=["full", "sharded"])
def test_torch_state_dict_helpers_resume_bitwise_also_from_torchs_checkpoint(full, use_orig_params, form, tmp_path):
    for theirs, from_torch, uninterrupted, from_fsdp1 in run_on_ranks(2, _dcp_helpers_save_and_resume, full,
                                                                      use_orig_params, form, str(tmp_path)):
        assert from_torch == theirs == uninterrupted == from_fsdp1


def _local(value):
    """A state-dict value's local part: a ShardedTensor's one shard, a DTensor's local tensor."""
    if hasattr(value, "local_shards"):
        return ("sharded", value.local_shards()[0].tensor if value.local_shards() else None)
    if hasattr(value, "to_local"):
        return ("sharded", value.to_local())
    return ("whole", value)


def _helpers_state_dicts(impl, use_orig_params, form):
    """Two steps, then ``get_state_dict``: the model's and the optimizer's keys, each value's kind
    and local part."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    wrap = wrap_fsdp1 if impl == "fsdp1" else wrap_torch_fsdp
    with fsdp1.use_as_torch_fsdp() if form == "alias" else contextlib.nullcontext():
        model = wrap(make_gpt(), use_orig_params=use_orig_params)
        optim = adam(model.parameters())
        train_steps(model, optim, 0, 2)
        model_state, optim_state = get_state_dict(model, optim)
    flat_optim = {f"{key}.{name}": value for key, state in optim_state["state"].items() for name, value in state.items()}
    return ({key: _local(value) for key, value in model_state.items()}, {key: _local(value) for key, value in flat_optim.items()},
            [group["params"] for group in optim_state["param_groups"]])


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_torch_state_dict_helpers_give_torchs_keys_and_shards_in_both_forms(use_orig_params):
    """torch's ``get_state_dict`` on fsdp1's FSDP1 model, with ``import fsdp1`` alone and under the
    alias: the model's and the optimizer's keys, which values are sharded, and every local shard equal
    to what it gives for torch's FSDP1 (torch's ShardedTensors, fsdp1's DTensors: DCP's sharded forms
    both). Unrecognised, the helpers gave full tensors and the wrapper's prefixes in the optimizer's keys."""
    torchs = run_on_ranks(2, _helpers_state_dicts, "torch", use_orig_params, "plain")
    for form in ("plain", "alias"):
        for (model, optim, groups), (torch_model, torch_optim, torch_groups) in zip(
                run_on_ranks(2, _helpers_state_dicts, "fsdp1", use_orig_params, form), torchs):
            assert groups == torch_groups and list(model) == list(torch_model) and sorted(optim) == sorted(torch_optim), form
            for ours, theirs in [(model, torch_model), (optim, torch_optim)]:
                for key, (kind, local) in ours.items():
                    assert kind == theirs[key][0] and torch.equal(local, theirs[key][1]), (form, key)


def _torchs_units_the_helpers_refuse():
    """torch's FSDP1 model used while the alias is in effect (its own code then finds fsdp1's class in
    torch's place), and a model of both classes: ``get_state_dict`` and ``set_state_dict`` refuse
    each before reading or writing anything; the messages, and whether the parameters stayed."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict

    theirs = wrap_torch_fsdp(make_gpt(), use_orig_params=True)
    optim = adam(theirs.parameters())
    train_steps(theirs, optim, 0, 1)
    model_state, _ = get_state_dict(theirs, optim)  # torch's, without the alias
    inner = make_gpt()
    inner.blocks[0] = fsdp1.FullyShardedDataParallel(inner.blocks[0])
    mixed = wrap_torch_fsdp(inner, use_orig_params=True, wrap_classes=())
    before = [param.detach().clone() for param in theirs.parameters()]
    refusals = []
    with fsdp1.use_as_torch_fsdp():
        for call in (lambda: get_state_dict(theirs, optim), lambda: set_model_state_dict(theirs, model_state)):
            with pytest.raises(RuntimeError) as refused:
                call()
            refusals.append(str(refused.value))
    with pytest.raises(RuntimeError) as refused:
        get_state_dict(mixed, adam(mixed.parameters()))
    refusals.append(str(refused.value))
    return refusals, all(torch.equal(param.detach(), old) for param, old in zip(theirs.parameters(), before))


def test_torch_state_dict_helpers_refuse_torchs_fsdp1_under_the_alias_and_mixed_models():
    for refusals, unchanged in run_on_ranks(2, _torchs_units_the_helpers_refuse):
        assert unchanged
        assert all("torch's FullyShardedDataParallel units" in refusal for refusal in refusals)
        assert all("use_as_torch_fsdp() is in effect" in refusal for refusal in refusals[:2])
        assert "and fsdp1's" in refusals[2]


def _upcast_after_wrapping(use_orig_params):
    """HF Accelerate's FSDP1 preparation of a model loaded in bf16 with bf16 mixed precision: after
    wrapping, each unit's flat parameter is upcast in place (``Accelerator.prepare_model``; its three
    lines are repeated here, as that path only runs on an accelerator)."""
    mp = fsdp1.MixedPrecision(param_dtype=torch.bfloat16)
    upcast = fsdp1.FullyShardedDataParallel(make_gpt().to(torch.bfloat16), mixed_precision=mp, use_orig_params=use_orig_params,
                                            auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}))
    for module in fsdp1.FullyShardedDataParallel.fsdp_modules(upcast):
        if module._has_params and module._flat_param.dtype != torch.float32:
            module._flat_param.data = module._flat_param.data.to(torch.float32)
            module._handle._orig_param_dtype = torch.float32
    reference = fsdp1.FullyShardedDataParallel(make_gpt().to(torch.bfloat16).float(), mixed_precision=mp,
                                               use_orig_params=use_orig_params,
                                               auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}))
    results = []
    for model in (upcast, reference):
        optim = adam(model.parameters())
        losses = train_steps(model, optim, 0, 3)
        state = model.state_dict()
        results.append((losses, {k: (v.dtype, v) for k, v in state.items()},
                        {p.dtype for p in model.parameters()}))
    return results


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_accelerates_upcast_of_the_flat_parameters_is_adopted(use_orig_params):
    for (losses, state, dtypes), (their_losses, their_state, their_dtypes) in run_on_ranks(2, _upcast_after_wrapping, use_orig_params):
        assert losses == their_losses
        assert dtypes == their_dtypes == {torch.float32}
        assert state.keys() == their_state.keys()
        assert all(dtype == their_state[k][0] == torch.float32 and torch.equal(v, their_state[k][1])
                   for k, (dtype, v) in state.items())


# ------------------------------------------------------------------- the FSDP tutorial's MNIST code, as written
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
        fsdp, cpu = fsdp_api(name)
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
    """``model = FSDP(LinearNet().to(rank))`` (and with its size-based policy) with ranks seeded apart: torch's
    FSDP1 trains the mix of the ranks' draws, and so does fsdp1, bit for bit, after a warning that
    names the first differing parameter (it used to refuse)."""
    for result in run_on_ranks(2, _mnist_tutorial, with_policy):
        torch_loss, torch_test, torch_states, _ = result["torch"]
        loss, test, states, warned = result["fsdp1"]
        assert same_values((loss, test, states), (torch_loss, torch_test, torch_states))
        assert warned
