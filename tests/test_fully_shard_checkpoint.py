"""Tests checkpoints of fsdp1's ``fully_shard`` (FSDP2's API on fsdp1's engine), each against ground
truth: torch's own ``fully_shard`` trained identically, DDP, the plain model, or the run that wrote
the checkpoint and went on training.

- ``model.state_dict()``: torch's keys in torch's order, DTensor parameters (``Shard(0)``, torch's
  global shapes, bitwise torch's local rows) and plain buffers; ``load_state_dict`` round trips,
  into fsdp1's and torch's ``fully_shard`` alike.
- DCP through ``torch.distributed.checkpoint.state_dict``'s helpers, model and AdamW: a checkpoint
  written by fsdp1's ``fully_shard`` resumes in fsdp1's and in torch's, and torch's resumes in
  fsdp1's, each continuing bit for bit as the writer did. Resumes load into copies of the templates,
  so that the values reach the model and the optimizer only through the ``set_*`` helpers (DCP
  would otherwise fill the model's and the optimizer's own tensors in place).
- FSDP1 → FSDP2 migration: a SHARDED_STATE_DICT checkpoint of fsdp1's ``FullyShardedDataParallel``
  resumes in ``fully_shard``, and back, bit for bit.
- Full state dicts (``full_state_dict=True``, with ``cpu_offload`` and ``broadcast_from_rank0``):
  the unsharded model's values (bitwise DDP's), and they load back.
- Beyond torch: plain full tensors (an unsharded model's ``state_dict()``) load into fsdp1's
  ``fully_shard`` model and train on exactly as when loaded through DTensors; torch's refuses them.
- ``model.state_dict()`` saves with ``torch.save`` and deep-copies (torch's cannot save its own).
- Local shards: fsdp1's share one storage per group (torch's: one per parameter) and, once cloned,
  save with safetensors to torch's values; parameters loaded one at a time with
  ``load_state_dict(..., assign=True)`` while iterating them, as torch's.
- ``fsdp1.checkpoint`` saves and loads a ``fully_shard`` model's state (also in the background), and
  ``python -m tools.checkpoint`` inspects and consolidates a checkpoint DCP wrote from one.
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1
from fsdp1 import FullyShardedDataParallel as FSDP
from fsdp1 import StateDictType

from _harness import run_on_ranks
from _models import (
    VOCAB,
    TinyGPT,
    batch,
    full_grads,
    fully_shard_of,
    global_batch,
    lm_loss,
    make_gpt,
    run_both,
    same_tensors,
    shard_gpt,
    train_steps,
    wrap_fsdp1,
)
from tools import checkpoint as checkpoint_tool

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

REPO = Path(__file__).resolve().parents[1]
FULLY_SHARD = {"fsdp1": fsdp1.fully_shard, "torch": torch_fully_shard}
STEPS = 2  # before the checkpoint, and again after it


class BufferedGPT(TinyGPT):
    """TinyGPT whose logits are scaled by a persistent buffer (drawn from the seed, so a model built
    from another seed holds other values until a load gives it the saved ones) and which keeps a
    non-persistent buffer, which no state dict holds."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("temperature", 1 + 0.1 * torch.rand(VOCAB))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * self.temperature


def make_model(seed: int = 0) -> BufferedGPT:
    torch.manual_seed(seed)
    return BufferedGPT()


def _sharded(impl: str, seed: int = 0) -> BufferedGPT:
    """``make_model(seed)`` with ``fully_shard`` (fsdp1's or torch's) on each block, then on the root."""
    model = make_model(seed)
    for block in model.blocks:
        FULLY_SHARD[impl](block)
    FULLY_SHARD[impl](model)
    return model


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def _full_values(model) -> dict:
    """Every entry of ``model.state_dict()`` unsharded (collective): DTensors gathered, FSDP1's FULL
    state dict (its default) as it is."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone() for k, v in model.state_dict().items()}


def _copies(tree):
    """``tree`` with every tensor copied (a DTensor keeps its mesh, placements and global shape). The
    state dicts of a ``fully_shard`` model and of ``get_optimizer_state_dict`` hold the model's and
    the optimizer's own tensors, which ``dcp.load`` would fill in place; loading into copies instead
    makes the values reach the model and the optimizer only through the load calls under test."""
    if isinstance(tree, dict):
        return {key: _copies(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_copies(value) for value in tree]
    if isinstance(tree, DTensor):
        return DTensor.from_local(tree.to_local().detach().clone(), tree.device_mesh, tree.placements, run_check=False,
                                  shape=tree.shape, stride=tree.stride())
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    return tree


def _locals(state_dict: dict) -> dict:
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in state_dict.items()}


def _next_loss(model) -> float:
    """The loss of the step after the checkpoint (step ``STEPS``), forward only."""
    with torch.no_grad():
        return lm_loss(model, *batch(STEPS, dist.get_rank(), dist.get_world_size())).item()


def assert_bitwise(actual: dict, expected: dict, ordered: bool = True) -> None:
    """The same keys (in the same order unless ``ordered`` is False), dtypes and values, bit for bit."""
    if ordered:
        assert list(actual) == list(expected), (list(actual), list(expected))
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert torch.equal(actual[key], tensor), key


# ------------------------------------------------------------------------------- model.state_dict()
def _describe(state_dict: dict) -> list:
    """Per entry: key, exact type, placements, mesh, global shape and stride, local shape."""
    rows = []
    for key, value in state_dict.items():
        is_dtensor = isinstance(value, DTensor)
        rows.append((key, type(value).__name__,
                     str(value.placements) if is_dtensor else None,
                     (value.device_mesh.device_type, value.device_mesh.mesh.tolist()) if is_dtensor else None,
                     tuple(value.shape), value.stride(),
                     tuple(value.to_local().shape) if is_dtensor else None))
    return rows


def _state_dicts_of_both():
    models = {impl: _sharded(impl) for impl in FULLY_SHARD}
    for model in models.values():
        train_steps(model, _adamw(model.parameters()), 0, STEPS)
    state_dicts = {impl: model.state_dict() for impl, model in models.items()}
    parameter_names = [name for name, _ in models["fsdp1"].named_parameters()]
    return ({impl: _describe(sd) for impl, sd in state_dicts.items()},
            {impl: _locals(sd) for impl, sd in state_dicts.items()},
            parameter_names, list(make_model().state_dict()))


def test_state_dict_has_torch_fully_shards_keys_types_placements_shapes_and_local_values():
    for described, local_values, parameter_names, plain_keys in run_on_ranks(2, _state_dicts_of_both):
        assert described["fsdp1"] == described["torch"]
        assert [key for key, *_ in described["fsdp1"]] == plain_keys  # the plain model's keys, in its order
        types = {key: kind for key, kind, *_ in described["fsdp1"]}
        assert {key for key, kind in types.items() if kind == "DTensor"} == set(parameter_names)
        assert types["temperature"] == "Tensor"  # buffers plain
        assert "scratch" not in types  # non-persistent left out
        assert {placements for _, _, placements, *_ in described["fsdp1"]} == {"(Shard(dim=0),)", None}
        assert_bitwise(local_values["fsdp1"], local_values["torch"])


def _load_round_trip():
    writer = _sharded("fsdp1")
    optim = _adamw(writer.parameters())
    train_steps(writer, optim, 0, STEPS)
    saved = writer.state_dict()
    saved_locals, saved_full, expected_loss = _locals(saved), _full_values(writer), _next_loss(writer)
    readers, results = {}, {}
    for impl in FULLY_SHARD:
        reader = readers[impl] = _sharded(impl, seed=1)
        before = _locals(reader.state_dict())
        incompatible = reader.load_state_dict(saved)  # strict
        results[impl] = {
            "changed": not torch.equal(before["temperature"], saved_locals["temperature"]),
            "incompatible": (incompatible.missing_keys, incompatible.unexpected_keys),
            "locals": _locals(reader.state_dict()),
            "full": _full_values(reader),
            "loss": _next_loss(reader),
        }
    train_steps(writer, optim, STEPS, 1)
    for impl, reader in readers.items():
        results[impl]["after_writer_step"] = _locals(reader.state_dict())
    return saved_locals, saved_full, expected_loss, results


def test_load_state_dict_of_it_round_trips_into_fsdp1s_and_torchs_fully_shard():
    for saved_locals, saved_full, expected_loss, results in run_on_ranks(2, _load_round_trip):
        for impl, result in results.items():
            assert result["changed"], impl  # the reader (another seed) held other values, buffers too
            assert result["incompatible"] == ([], []), impl
            assert_bitwise(result["locals"], saved_locals)
            assert_bitwise(result["full"], saved_full)
            assert result["loss"] == expected_loss, impl  # bitwise
            assert_bitwise(result["after_writer_step"], saved_locals)  # copies: the writer's next step changed none


# ------------------------------------------------------------------- DCP with torch's state-dict helpers
def _app_state(model, optim, api: str) -> dict:
    if api == "get_state_dict":
        model_state, optim_state = get_state_dict(model, optim)
    else:
        model_state, optim_state = get_model_state_dict(model), get_optimizer_state_dict(model, optim)
    return {"model": model_state, "optim": optim_state}


def _save_then_continue(impl: str, api: str, path: str):
    """Train ``STEPS``, save model and AdamW state with DCP, train ``STEPS`` more: the losses after the
    checkpoint and the final values, which a resumed run must reproduce."""
    model = _sharded(impl)
    optim = _adamw(model.parameters())
    train_steps(model, optim, 0, STEPS)
    dcp.save(_app_state(model, optim, api), checkpoint_id=path)
    return train_steps(model, optim, STEPS, STEPS), _full_values(model)


def _resume(impl: str, api: str, path: str):
    model = _sharded(impl, seed=1)
    optim = _adamw(model.parameters())
    state = _copies(_app_state(model, optim, api))  # templates: a fresh optimizer's state is made first
    dcp.load(state, checkpoint_id=path)
    if api == "get_state_dict":
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
    return train_steps(model, optim, STEPS, STEPS), _full_values(model)


@pytest.mark.parametrize("api", ["get_model_and_optimizer_state_dict", "get_state_dict"])
@pytest.mark.parametrize("writer, readers", [("fsdp1", ("fsdp1", "torch")), ("torch", ("fsdp1",))])
def test_dcp_checkpoint_of_model_and_adamw_resumes_bit_for_bit_across_fsdp1_and_torch(tmp_path, writer, readers, api):
    path = str(tmp_path / "ckpt")
    continued = run_on_ranks(2, _save_then_continue, writer, api, path)
    for reader in readers:
        resumed = run_on_ranks(2, _resume, reader, api, path)
        for (losses, values), (expected_losses, expected_values) in zip(resumed, continued):
            assert losses == expected_losses, reader  # bitwise, on every rank
            assert_bitwise(values, expected_values)


def _async_save_while_training(path: str):
    """``dcp.async_save`` on a gloo group of its own, as torchtitan saves, while training goes on: the
    checkpoint holds the values of the step it was taken at."""
    model = _sharded("fsdp1")
    optim = _adamw(model.parameters())
    train_steps(model, optim, 0, STEPS)
    saved = _full_values(model)
    future = dcp.async_save(_app_state(model, optim, "get_state_dict"), checkpoint_id=path,
                            process_group=dist.new_group(backend="gloo"))
    train_steps(model, optim, STEPS, STEPS)  # the parameters change while the save runs
    future.result()
    return saved, _full_values(model)


def _torch_loads(path: str):
    model = _sharded("torch", seed=1)
    optim = _adamw(model.parameters())
    state = _copies(_app_state(model, optim, "get_state_dict"))
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full_values(model)


def test_dcp_async_save_while_training_loads_into_torchs_fully_shard(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(2, _async_save_while_training, path)
    for (at_save, after), loaded in zip(saved, run_on_ranks(2, _torch_loads, path)):
        assert_bitwise(loaded, at_save)
        assert any(not torch.equal(after[key], at_save[key]) for key in at_save)  # training went on meanwhile


# ------------------------------------------------------------------------------ FSDP1 <-> FSDP2 migration
def _fsdp1_wrapper(seed: int = 0):
    return wrap_fsdp1(make_model(seed), use_orig_params=True)


def _fsdp1_wrapper_saves_then_continues(path: str):
    model = _fsdp1_wrapper()
    optim = _adamw(model.parameters())
    train_steps(model, optim, 0, STEPS)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, checkpoint_id=path)
    return train_steps(model, optim, STEPS, STEPS), _full_values(model)


def _fully_shard_resumes(path: str):
    model = _sharded("fsdp1", seed=1)
    optim = _adamw(model.parameters())
    model_state = _copies({"model": model.state_dict()})
    dcp.load(model_state, checkpoint_id=path)
    model.load_state_dict(model_state["model"])
    optim_state = _copies({"optim": get_optimizer_state_dict(model, optim)})
    dcp.load(optim_state, checkpoint_id=path)
    set_optimizer_state_dict(model, optim, optim_state["optim"])
    return train_steps(model, optim, STEPS, STEPS), _full_values(model)


def _fully_shard_saves_then_continues(path: str):
    model = _sharded("fsdp1")
    optim = _adamw(model.parameters())
    train_steps(model, optim, 0, STEPS)
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=path)
    return train_steps(model, optim, STEPS, STEPS), _full_values(model)


def _fsdp1_wrapper_resumes(path: str):
    model = _fsdp1_wrapper(seed=1)
    optim = _adamw(model.parameters())
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    return train_steps(model, optim, STEPS, STEPS), _full_values(model)


@pytest.mark.parametrize("writer, reader", [
    (_fsdp1_wrapper_saves_then_continues, _fully_shard_resumes),  # FSDP1 SHARDED_STATE_DICT -> fully_shard
    (_fully_shard_saves_then_continues, _fsdp1_wrapper_resumes),  # and back
], ids=["fsdp1_to_fully_shard", "fully_shard_to_fsdp1"])
def test_checkpoints_move_between_fsdp1_sharded_state_dict_and_fully_shard_bit_for_bit(writer, reader, tmp_path):
    path = str(tmp_path / "checkpoint")
    continued = run_on_ranks(2, writer, path)
    resumed = run_on_ranks(2, reader, path)
    for (losses, values), (expected_losses, expected_values) in zip(resumed, continued):
        assert losses == expected_losses  # bitwise
        assert_bitwise(values, expected_values)


def _load_on(path: str):
    model = _sharded("fsdp1", seed=1)
    optim = _adamw(model.parameters())
    state = _copies({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)})
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    optim_state = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    return _full_values(model), {k: v["exp_avg_sq"].clone() for k, v in optim_state["state"].items()}


@pytest.mark.parametrize("world_size", [1, 4])
def test_a_checkpoint_written_on_two_ranks_loads_on_another_world_size(world_size, tmp_path):
    """Model and AdamW state of a fully_shard model written on 2 ranks, read on 1 and 4: every value,
    unsharded, is the writer's bit for bit (DCP moves the rows)."""
    path = str(tmp_path / "checkpoint")
    values, full_optim = run_on_ranks(2, _dcp_save_for_the_tool, path)[0]
    moments = {fqn: state["exp_avg_sq"] for fqn, state in full_optim.items()}
    for loaded, loaded_moments in run_on_ranks(world_size, _load_on, path):
        assert_bitwise(loaded, values)
        assert sorted(loaded_moments) == sorted(moments)
        assert all(torch.equal(loaded_moments[k], moments[k]) for k in moments)


# ------------------------------------------------------------------------------------ full state dicts
FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _plain_trained(steps: int = STEPS):
    """Ground truth: the plain model under DDP (bitwise, every rank), and in one process over the
    global batch (the same mean loss, rounded otherwise)."""
    world = dist.get_world_size()
    ddp = DDP(make_model())
    train_steps(ddp, _adamw(ddp.parameters()), 0, steps)
    single = make_model()
    optim = _adamw(single.parameters())
    for step in range(steps):
        lm_loss(single, *global_batch(step, world)).backward()
        optim.step()
        optim.zero_grad()
    return ddp.module.state_dict(), single.state_dict()


def _full_state_dict_and_loads():
    rank = dist.get_rank()
    model = _sharded("fsdp1")
    train_steps(model, _adamw(model.parameters()), 0, STEPS)
    on_cpu = get_model_state_dict(model, options=FULL_ON_CPU)  # rank 0 only
    everywhere = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    by_ddp, by_one_process = _plain_trained()
    loaded = {}
    for how, source, options in (
        ("broadcast", on_cpu if rank == 0 else {}, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)),
        ("every_rank", everywhere, StateDictOptions(full_state_dict=True)),
        ("ddp_module", by_ddp, StateDictOptions(full_state_dict=True)),
    ):
        reader = _sharded("fsdp1", seed=1)
        # a copy: torch's helper puts the DTensors it made into the dict it was given (and with
        # broadcast_from_rank0 frees the storages of rank 0's tensors)
        set_model_state_dict(reader, _copies(source), options=options)
        loaded[how] = (_full_values(reader), _locals(reader.state_dict()))
    return {
        "on_cpu": on_cpu, "on_cpu_devices": {str(v.device) for v in on_cpu.values()},
        "on_cpu_types": {type(v).__name__ for v in on_cpu.values()},
        "everywhere": everywhere, "ddp": by_ddp, "one_process": by_one_process,
        "loaded": loaded, "writer_locals": _locals(model.state_dict()),
    }


def test_full_state_dict_is_the_unsharded_models_and_loads_back():
    results = run_on_ranks(2, _full_state_dict_and_loads)
    for rank, result in enumerate(results):
        expected = result["ddp"]
        if rank == 0:
            assert result["on_cpu_types"] == {"Tensor"}
            assert result["on_cpu_devices"] == {"cpu"}
            assert_bitwise(result["on_cpu"], expected)  # the plain model's keys and order, DDP's values bitwise
        else:
            assert result["on_cpu"] == {}  # with cpu_offload the helper gathers onto rank 0 only
        assert_bitwise(result["everywhere"], expected)
        for name, tensor in result["one_process"].items():
            # one process over the global batch rounds its mean loss otherwise: equal to float32 rounding
            torch.testing.assert_close(result["everywhere"][name], tensor, rtol=1e-5, atol=1e-6)
        for how, (full, local) in result["loaded"].items():
            assert_bitwise(full, expected)
            assert_bitwise(local, result["writer_locals"])  # each rank its rows, as the writer's


# ----------------------------------------------------------------------- beyond torch: plain full tensors
def _error_of(call) -> tuple:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return type(error).__name__, str(error)
    return None, ""


def _plain_full_state_dict_loads():
    plain = make_model(seed=1)
    plain_state = plain.state_dict()  # plain tensors of the full shapes
    expected = _copies(plain_state)
    by_plain = _sharded("fsdp1")
    incompatible = by_plain.load_state_dict(plain_state)  # strict
    plain_state_after = _copies(plain_state)
    with torch.no_grad():
        for tensor in plain_state.values():
            tensor.add_(1.0)  # the model took copies: this changes nothing it holds
    loaded = _full_values(by_plain)
    by_dtensors = _sharded("fsdp1")
    by_dtensors.load_state_dict(_sharded("fsdp1", seed=1).state_dict())
    reference = _sharded("torch", seed=1)  # torch's fully_shard built on the same values
    theirs = _sharded("torch")
    refusal = _error_of(lambda: theirs.load_state_dict(make_model(seed=1).state_dict()))
    trained = {}
    for name, model in (("plain", by_plain), ("dtensors", by_dtensors), ("torch", reference)):
        trained[name] = (train_steps(model, _adamw(model.parameters()), 0, STEPS), _full_values(model))
    return (incompatible.missing_keys, incompatible.unexpected_keys), expected, plain_state_after, loaded, trained, refusal


def test_plain_full_state_dict_loads_into_fully_shard_and_trains_as_loaded_through_dtensors():
    results = run_on_ranks(2, _plain_full_state_dict_loads)
    for incompatible, expected, plain_state_after, loaded, trained, refusal in results:
        assert incompatible == ([], [])
        assert_bitwise(plain_state_after, expected)  # the load left its source as it was
        assert_bitwise(loaded, expected)  # each rank took its rows: together the full values
        for name in ("plain", "dtensors"):
            assert trained[name][0] == trained["torch"][0], name  # the same losses, bitwise
            assert_bitwise(trained[name][1], trained["torch"][1])
        kind, message = refusal
        # torch's fully_shard refuses them: the global shapes agree, so no size mismatch, but copying a
        # plain tensor into a DTensor parameter fails
        assert kind == "RuntimeError", refusal
        assert 'While copying the parameter named "pos"' in message
        assert "got mixed torch.Tensor and DTensor" in message


# ------------------------------------------------------------------------- fsdp1.checkpoint and the tool
def _fsdp1_checkpoint_saves_then_continues(path: str, async_path: str):
    from fsdp1 import checkpoint

    model = _sharded("fsdp1")
    optim = _adamw(model.parameters())
    train_steps(model, optim, 0, STEPS)
    checkpoint.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim), "step": STEPS}, path)
    saver = checkpoint.AsyncSaver()
    saver.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim), "step": STEPS}, async_path)
    losses = train_steps(model, optim, STEPS, STEPS)  # while the background save runs: it saved a snapshot
    saver.wait()
    return losses, _full_values(model)


def _fsdp1_checkpoint_resumes(path: str):
    from fsdp1 import checkpoint

    model = _sharded("fsdp1", seed=1)
    optim = _adamw(model.parameters())
    state = _copies({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim), "step": 0})
    checkpoint.load(state, path, validate_finite=True)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    return state["step"], train_steps(model, optim, STEPS, STEPS), _full_values(model)


def test_fsdp1_checkpoint_saves_and_loads_a_fully_shard_model_and_optimizer_bit_for_bit(tmp_path):
    paths = [str(tmp_path / "step_2"), str(tmp_path / "step_2_async")]
    continued = run_on_ranks(2, _fsdp1_checkpoint_saves_then_continues, *paths)
    for path in paths:
        assert (Path(path) / "fsdp1_manifest.json").is_file()  # committed
        resumed = run_on_ranks(2, _fsdp1_checkpoint_resumes, path)
        for (step, losses, values), (expected_losses, expected_values) in zip(resumed, continued):
            assert step == STEPS
            assert losses == expected_losses, path  # bitwise
            assert_bitwise(values, expected_values)


def _dcp_save_for_the_tool(path: str):
    model = _sharded("fsdp1")
    optim = _adamw(model.parameters())
    train_steps(model, optim, 0, STEPS)
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=path)
    full_optim = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    return _full_values(model), {fqn: _copies(state) for fqn, state in full_optim["state"].items()}


def test_tool_inspects_and_consolidates_a_dcp_checkpoint_of_a_fully_shard_model(tmp_path):
    directory = tmp_path / "ckpt"
    full_model, full_optim = run_on_ranks(2, _dcp_save_for_the_tool, str(directory))[0]
    listing = subprocess.run([sys.executable, "-m", "tools.checkpoint", "inspect", str(directory), "--json"], cwd=REPO,
                             capture_output=True, text=True, check=True)
    entries = {entry["key"]: entry for entry in json.loads(listing.stdout)["entries"]}
    for key, tensor in full_model.items():
        entry = entries[f"model.{key}"]
        assert (entry["shape"], entry["dtype"]) == (list(tensor.shape), "float32"), key
        # a parameter: one chunk per rank (each holds rows); a buffer: one, every rank holding the same
        assert entry["chunks"] == (1 if key == "temperature" else 2), key
    for fqn, state in full_optim.items():
        assert entries[f"optim.state.{fqn}.exp_avg"]["chunks"] == 2, fqn

    model_file, everything_file = tmp_path / "model.pt", tmp_path / "all.pt"
    assert checkpoint_tool.main(["consolidate", str(directory), str(model_file), "--prefix", "model."]) == 0
    assert checkpoint_tool.main(["consolidate", str(directory), str(everything_file)]) == 0
    consolidated = torch.load(model_file, weights_only=True)
    assert_bitwise(consolidated, full_model, ordered=False)  # a checkpoint keeps no order
    plain = make_model(seed=1)
    plain.load_state_dict(consolidated, strict=True)  # the plain model takes it as it is
    assert_bitwise(plain.state_dict(), full_model)
    everything = torch.load(everything_file, weights_only=False)
    assert_bitwise(everything["model"], full_model, ordered=False)
    assert sorted(everything["optim"]["state"]) == sorted(full_optim)
    for fqn, state in full_optim.items():
        assert_bitwise({k: everything["optim"]["state"][fqn][k] for k in state}, state)  # AdamW's moments, full


# ------------------------------------------------------------------- torch.save and deepcopy of the state dict
def _saved_and_copied():
    import io

    model = shard_gpt(make_gpt(), fsdp1.fully_shard)
    state = model.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)  # DTensors viewing one shard; torch's own cannot save them
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(state)
    return all(torch.equal(loaded[k].to_local(), v.to_local()) and torch.equal(copied[k].to_local(), v.to_local())
               for k, v in state.items())


def test_a_state_dict_saves_with_torch_save_and_deep_copies():
    assert all(run_on_ranks(2, _saved_and_copied))


# ------------------------------------------------------------------- local shards and loading with assign
def _local_shards_saved_with_safetensors(impl, directory):
    import os

    from safetensors.torch import load_file, save_file

    shard = fully_shard_of(impl)
    torch.manual_seed(0)
    model = TinyGPT()
    shard_gpt(model, shard)
    locals_ = {k: v.to_local() for k, v in model.state_dict().items()}
    block = [v for k, v in locals_.items() if k.startswith("blocks.0.") and v.numel()]
    shares_storage = len({v.untyped_storage().data_ptr() for v in block}) == 1
    path = os.path.join(directory, f"{impl}_{dist.get_rank()}.safetensors")
    save_file({k: v.clone() for k, v in locals_.items()}, path)  # fsdp1's need the clone: see docs/fully_shard.md, "Differences"
    return shares_storage, load_file(path)


def test_local_shards_share_the_groups_storage_and_save_with_safetensors_once_cloned(tmp_path):
    ours, theirs = (run_on_ranks(2, _local_shards_saved_with_safetensors, impl, str(tmp_path)) for impl in ("fsdp1", "torch"))
    for rank in range(2):
        assert ours[rank][0] is True  # one flat shard per group (torch's: a storage per parameter)
        assert theirs[rank][0] is False
        assert ours[rank][1].keys() == theirs[rank][1].keys()
        assert all(torch.equal(ours[rank][1][k], theirs[rank][1][k]) for k in theirs[rank][1])


def _loaded_piece_by_piece_while_iterating(impl):
    from torch.distributed.tensor import distribute_tensor

    shard = fully_shard_of(impl)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    for module in model:
        shard(module)
    shard(model)
    for index, (name, param) in enumerate(model.named_parameters()):  # loading does not change the registrations
        torch.manual_seed(index)
        piece = distribute_tensor(torch.randn(param.size()), param.device_mesh, param.placements)
        model.load_state_dict({name: piece}, assign=True, strict=False)
    out = model(torch.ones(2, 4))
    out.sum().backward()
    return out.detach(), full_grads(model)


def test_parameters_loaded_one_by_one_with_assign_while_iterating_them_as_torchs():
    ours, theirs = run_both(_loaded_piece_by_piece_while_iterating)
    assert torch.equal(ours[0], theirs[0])
    assert same_tensors(ours[1], theirs[1])
