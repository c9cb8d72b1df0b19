"""Tests deferred initialisation: a model built on the meta device is materialised unit by
unit (``reset_parameters`` or the user's ``param_init_fn``) exactly as torch's FSDP1 does it, never
holding more than one unit unsharded; ``sync_module_states`` makes rank 0's values win, including
the pattern where only rank 0 builds real weights and the others build on the meta device. And
initialisation after wrapping: ``apply(init_fn)`` sees full parameters and trains as the plain model
initialised alike, and a parameter read outside forward is the rank's shard or a named error. Under
``fully_shard``, as torch's: parameters registered after sharding on the meta device (this rank's rows as
DTensors, also in another dtype, or plain full tensors) are taken at the first forward, and those left on
meta are named by torch's message, from the root (also in a group of several modules)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1
from fsdp1._planner.dry_run import fake_process_group
from fsdp1._planner.live_memory import LiveStorageTracker

from _harness import run_on_ranks
from _models import (
    D_MODEL,
    VOCAB,
    Block,
    TinyGPT,
    batch,
    fsdp1_full_params,
    full_grads,
    fully_shard_of,
    make_mlp,
    max_relative_error,
    plain_params,
    relative_errors,
    run_both,
    same_tensors,
    shard_gpt,
    torch_fsdp_full_params,
    train,
    train_each,
    wrap_fsdp1,
)

FSDP = fsdp1.FullyShardedDataParallel
TOLERANCE = 1e-5
POLICY_CLASSES = {Block}


def _lm(device=None) -> nn.Module:
    """A language model whose every parameter-owning module has ``reset_parameters``."""
    with torch.device(device or "cpu"):
        return nn.Sequential(nn.Embedding(VOCAB, D_MODEL), *[Block() for _ in range(6)], nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB))


def _wrap(model, **kwargs):
    return FSDP(model, auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy(POLICY_CLASSES), **kwargs)


def _from_meta(use_orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = _wrap(_lm("meta"), use_orig_params=use_orig_params)
    torch.manual_seed(0)
    theirs = TorchFSDP(_lm("meta"), auto_wrap_policy=ModuleWrapPolicy(POLICY_CLASSES), use_orig_params=use_orig_params,
                       device_id=torch.device("cpu"))
    init_error = max_relative_error(fsdp1_full_params(ours), torch_fsdp_full_params(theirs))
    reference = _lm()
    reference.load_state_dict(fsdp1_full_params(ours))
    ddp = DDP(reference)
    losses = [train(m, 3, world_size, rank) for m in (ours, theirs, ddp)]
    return init_error, losses


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_meta_model_initialises_as_torch_fsdp1_and_trains_like_ddp(use_orig_params):
    for init_error, (ours, theirs, ddp) in run_on_ranks(2, _from_meta, use_orig_params):
        assert init_error == 0.0  # the same values as torch's unit-by-unit reset_parameters()
        assert ours == theirs
        assert relative_errors(ours, ddp) <= 1e-5


def construction_peak(world_size=8):
    """Peak live bytes while wrapping the meta-built model, as rank 0 of a fake group; and the bytes
    of all local shards plus the largest unit's padded unsharded flat parameter. The meta model is
    built before counting starts: the tracker counts meta tensors at their size, for the estimator."""
    meta_model = _lm("meta")
    with fake_process_group(world_size), LiveStorageTracker() as tracker:
        model = _wrap(meta_model)
        handles = [u._handle for u in FSDP.fsdp_modules(model) if u._handle is not None]
        shards = sum(h.local_shard.nbytes for h in handles)
        largest_unit = max(h.layout.unsharded_numel * h.local_shard.element_size() for h in handles)
        return tracker.peak, shards, largest_unit


def test_construction_from_meta_never_holds_more_than_one_unit_unsharded():
    peak, shards, largest_unit = construction_peak()
    whole_model = sum(p.numel() * 4 for p in _lm("meta").parameters())
    # The default init resets each unit's parameters inside its flat buffer, so no unit is held twice.
    assert peak <= shards + largest_unit, (peak, shards, largest_unit)
    assert peak < whole_model / 2, (peak, whole_model)  # as rank 0 of 8


# ---------------------------------------------------------------------------------------------- sync_module_states
def _synced(pattern, use_orig_params):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    rank0_model = _lm()  # what rank 0 builds, the same on every rank, for the DDP oracle
    if pattern == "different seeds":
        torch.manual_seed(rank)
        ours = _wrap(_lm(), sync_module_states=True, use_orig_params=use_orig_params)
    elif pattern == "meta everywhere, different seeds":  # each unit reset in its flat buffer, then synced
        torch.manual_seed(rank)
        ours = _wrap(_lm("meta"), sync_module_states=True, use_orig_params=use_orig_params)
        rank0_model.load_state_dict(fsdp1_full_params(ours))
        dist.broadcast_object_list(holder := [rank0_model.state_dict()], src=0)
        rank0_model.load_state_dict(holder[0])
    else:  # rank 0 builds real weights, the others on the meta device
        local = copy.deepcopy(rank0_model) if rank == 0 else _lm("meta")
        ours = _wrap(local, sync_module_states=True, use_orig_params=use_orig_params,
                     param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False))
    init_error = max_relative_error(fsdp1_full_params(ours), plain_params(rank0_model))
    ddp = DDP(copy.deepcopy(rank0_model))
    losses = [train(m, 3, world_size, rank) for m in (ours, ddp)]
    return init_error, losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("pattern", ["different seeds", "rank 0 real, others meta", "meta everywhere, different seeds"])
def test_sync_module_states_makes_rank_0_win(pattern, use_orig_params):
    for init_error, (ours, ddp), error in run_on_ranks(2, _synced, pattern, use_orig_params):
        assert init_error == 0.0
        assert relative_errors(ours, ddp) <= 1e-5
        assert error <= 1e-5


def _synced_on_the_gpu(use_orig_params):
    """A CPU model with ``device_id`` on the GPU and an NCCL group, as the Transformers Trainer wraps:
    the states are broadcast where NCCL works, after the move (torch's order)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    nccl = dist.new_group(backend="nccl")
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = _lm()
    ours = _wrap(copy.deepcopy(model), sync_module_states=True, use_orig_params=use_orig_params, process_group=nccl,
                 device_id=device)
    theirs = TorchFSDP(copy.deepcopy(model), auto_wrap_policy=ModuleWrapPolicy({Block}), sync_module_states=True,
                       use_orig_params=use_orig_params, process_group=nccl, device_id=device)
    on_cpu = [{name: value.cpu() for name, value in full.items()} for full in (fsdp1_full_params(ours), torch_fsdp_full_params(theirs))]
    return (*on_cpu, {p.device.type for p in ours.parameters()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a GPU")
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_sync_module_states_broadcasts_on_the_compute_device(use_orig_params):
    [(ours, theirs, devices)] = run_on_ranks(1, _synced_on_the_gpu, use_orig_params)
    assert devices == {"cuda"}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


# ---------------------------------------------------------------------------------------------- after wrapping
def _init_fn(module):
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        nn.init.constant_(module.bias, 0.25)


def _apply_then_train(strategy, use_orig_params):
    base = make_mlp()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    shapes = []
    ours.apply(lambda m: shapes.append(tuple(m.weight.shape)) if isinstance(m, nn.Linear) else None)
    torch.manual_seed(7)
    ours.apply(_init_fn)
    torch.manual_seed(7)
    plain = copy.deepcopy(base).apply(_init_fn)
    ddp = DDP(plain)
    losses = train_each((ours, ddp))
    read = None
    try:
        ours.module[0].weight.sum()
    except RuntimeError as error:
        read = str(error)
    return shapes, losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp)), read


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_apply_gathers_full_parameters_and_reads_outside_forward_never_crash(strategy, use_orig_params):
    for shapes, (ours, ddp), error, read in run_on_ranks(2, _apply_then_train, strategy, use_orig_params):
        assert shapes == [(7, 5), (3, 7)]  # the initialiser saw full shapes
        assert relative_errors(ours, ddp) <= TOLERANCE
        assert error <= TOLERANCE
        if use_orig_params or strategy == "NO_SHARD":
            assert read is None  # the rank's shard (or the whole parameter) is readable
        else:
            assert "'0.weight' is sharded across the ranks" in read
            assert "summon_full_params" in read


# ---------------------------------------------------------------------------------------------- bad input
class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.scale


def _errors():
    messages = []
    for make in (
        lambda: FSDP(nn.Linear(2, 2), param_init_fn=3),
        lambda: FSDP(nn.Sequential(nn.Linear(3, 3, device="meta"), NoReset().to("meta"))),
        lambda: FSDP(nn.Linear(2, 2 + dist.get_rank()), sync_module_states=True),
    ):
        try:
            make()
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_bad_input_names_the_module_and_fails_on_every_rank():
    results = run_on_ranks(2, _errors)
    assert results[0][0] == ("fsdp1: Expected 3 to be callable but got <class 'int'>: param_init_fn must be callable (it "
                             "is called with each module to initialise).")
    assert results[0][1].startswith("fsdp1: module '1' (NoReset) is on the meta device but has no reset_parameters()")
    # The shape mismatch is found before any broadcast, on both ranks.
    assert results[0][2] == "fsdp1: sync_module_states: 'weight' is torch.float32 of shape (2, 2) on rank 0 but torch.float32 of shape (3, 2) on rank 1; build the same model on every rank."
    assert results[1][2] == "fsdp1: sync_module_states: 'weight' is torch.float32 of shape (3, 2) on rank 1 but torch.float32 of shape (2, 2) on rank 0; build the same model on every rank."


# ---------------------------------------------------------------------------------------------- fully_shard: parameters registered after sharding on meta
def _replaced_after_sharding_on_meta(impl, how):
    """Transformers' FSDP2 loading: shard the model on the meta device, then register real
    parameters in place of the sharded ones (this rank's rows as DTensors, or plain full tensors)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    shard = fully_shard_of(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TinyGPT()
    with torch.device("meta"):
        model = TinyGPT()
    shard_gpt(model, shard)
    mesh = model.pos.device_mesh
    skipped = {"blocks.1.fc.weight", "head.bias"} if how == "some_left_on_meta" else set()
    for (name, param), value in zip(list(model.named_parameters()), reference.parameters()):
        if name in skipped:
            continue
        module_path, _, attr = name.rpartition(".")
        module = model.get_submodule(module_path)
        if how == "plain":
            replacement = nn.Parameter(value.detach().clone())
        else:
            replacement = nn.Parameter(distribute_tensor(value.detach(), mesh, [Shard(0)]))
        setattr(module, attr, replacement)
    if how == "plain":  # each is taken as a new DTensor Parameter, which the optimizer must be built on
        with torch.no_grad():
            model(batch(0, rank, world_size)[0])
    try:
        losses = _train_steps(model, 3)
    except RuntimeError as error:
        return "RuntimeError", str(error).split("\n")[0]
    return losses, [p.detach().full_tensor() for p in model.parameters()]


def _train_steps(model, steps):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        inputs, targets = batch(step, rank, world_size)
        loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def test_parameters_registered_after_sharding_on_meta_are_taken_at_the_first_forward_as_torchs():
    ours, theirs = run_both(_replaced_after_sharding_on_meta, "dtensor")
    assert ours[0] == theirs[0]
    assert same_tensors(ours[1], theirs[1])
    plain = run_on_ranks(2, _replaced_after_sharding_on_meta, "fsdp1", "plain")[0]  # torch's needs DTensors
    assert plain[0] == ours[0]
    assert same_tensors(plain[1], ours[1])


def test_a_forward_with_parameters_still_on_meta_names_them_as_torchs():
    ours, theirs = run_both(_replaced_after_sharding_on_meta, "some_left_on_meta")
    assert ours[0] == theirs[0] == "RuntimeError"
    assert ours[1] == theirs[1]
    assert "still on meta device: ['head.bias']" in ours[1]  # the root's group is checked first


def _group_member_left_on_meta(impl):
    from torch.distributed.tensor import Shard, distribute_tensor

    shard = fully_shard_of(impl)
    torch.manual_seed(0)
    reference = TinyGPT()
    with torch.device("meta"):
        model = TinyGPT()
    shard([model.ln_f, model.head])
    shard(model)
    mesh = model.pos.device_mesh
    for (name, _), value in zip(list(model.named_parameters()), reference.parameters()):
        if name != "ln_f.bias":
            module_path, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_path), attr, nn.Parameter(distribute_tensor(value.detach(), mesh, [Shard(0)])))
    try:
        model(batch(0, dist.get_rank(), dist.get_world_size())[0])
    except RuntimeError as error:
        return str(error).split("\n")[0]
    return "no error"


def test_a_parameter_of_a_group_of_several_modules_is_named_from_the_root_as_torchs():
    ours, theirs = run_both(_group_member_left_on_meta)
    assert ours == theirs
    assert ours.endswith("still on meta device: ['ln_f.bias']")


def _replaced_on_meta_in_another_dtype(impl):
    from torch.distributed.tensor import Shard, distribute_tensor

    shard = fully_shard_of(impl)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    shard(model[0])
    shard(model)
    mesh = model[0].weight.device_mesh
    for (name, _), value in zip(list(model.named_parameters()), reference.parameters()):
        module_path, _, attr = name.rpartition(".")
        bf16 = distribute_tensor(value.detach().to(torch.bfloat16), mesh, [Shard(0)])
        setattr(model.get_submodule(module_path), attr, nn.Parameter(bf16))
    out = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank())).to(torch.bfloat16))
    out.float().sum().backward()
    return out.detach(), [p.dtype for p in model.parameters()], full_grads(model)


def test_parameters_registered_on_meta_in_another_dtype_are_taken_in_theirs_as_torchs():
    ours, theirs = run_both(_replaced_on_meta_in_another_dtype)
    assert ours[1] == theirs[1] == [torch.bfloat16] * 4
    assert torch.equal(ours[0], theirs[0])
    assert same_tensors(ours[2], theirs[2])
