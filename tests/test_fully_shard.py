"""Tests ``fsdp1.fully_shard`` (torch's FSDP2 API on fsdp1's engine) against torch's own ``fully_shard``
and DDP doing the same: the API surface, the class swap, DTensor parameters (placements, global and
local shapes, values), training bitwise torch's (blocks + root, prefetching, accumulation, HSDP on a
2-D mesh, 4 ranks), what is registered after forward / backward / an evaluation forward for each
``reshard_after_forward``, mixed precision, ``unshard``/``reshard``, offload, ignored parameters,
Hugging Face families, and the errors for bad input."""

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import Block, adam, batch, lm_loss, make_gpt, train

transformers = pytest.importorskip("transformers")


def _shard_gpt(model, shard, **kwargs):
    """Blocks first, then the root, as torch's documentation does."""
    for block in model.blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def _torch_fully_shard():
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _locals(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------- API
def test_the_names_signatures_and_methods_are_torchs():
    from torch.distributed import fsdp as torch_fsdp

    for name in ["fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy",
                 "CPUOffloadPolicy", "register_fsdp_forward_method"]:
        assert name in fsdp1.__all__ and hasattr(fsdp1, name)

    def parameters(fn):
        return [(p.name, p.kind, repr(p.default)) for p in inspect.signature(fn).parameters.values()]

    assert parameters(fsdp1.fully_shard) == parameters(torch_fsdp.fully_shard)
    assert parameters(fsdp1.MixedPrecisionPolicy) == parameters(torch_fsdp.MixedPrecisionPolicy)
    assert parameters(fsdp1.CPUOffloadPolicy) == parameters(torch_fsdp.CPUOffloadPolicy)
    assert issubclass(fsdp1.CPUOffloadPolicy, fsdp1.OffloadPolicy)
    torch_methods = {n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_") and n not in dir(nn.Module)}
    assert len(torch_methods) == 23
    for name in torch_methods:
        assert parameters(getattr(fsdp1.FSDPModule, name)) == parameters(getattr(torch_fsdp.FSDPModule, name)), name


# ---------------------------------------------------------------------------------------------- layout and training
def _layout_and_training():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ours = _shard_gpt(make_gpt(), fsdp1.fully_shard)
    theirs = _shard_gpt(make_gpt(), _torch_fully_shard())
    ddp = DDP(make_gpt())
    same_layout = all(
        isinstance(p, DTensor) and isinstance(p, nn.Parameter) and p.placements == q.placements
        and p.shape == q.shape and p.to_local().shape == q.to_local().shape and torch.equal(p.to_local(), q.to_local())
        for p, q in zip(ours.parameters(), theirs.parameters())
    )
    names = [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    classes = (type(ours).__name__, type(ours.blocks[0]).__name__, isinstance(ours.blocks[0], fsdp1.FSDPModule),
               isinstance(ours.blocks[0], Block), isinstance(ours.blocks[0].ln1, fsdp1.FSDPModule))
    losses = [train(model, 4, world_size, rank) for model in (ours, theirs, ddp)]
    same_after = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(ours.parameters(), theirs.parameters()))
    full_ours = {n: p.full_tensor() for n, p in ours.named_parameters()}
    ddp_params = dict(ddp.module.named_parameters())
    ddp_error = max((full_ours[n] - ddp_params[n]).abs().max().item() for n in full_ours)
    return same_layout, names, classes, losses, same_after, ddp_error


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parameters_are_torchs_dtensors_and_training_is_bitwise_torchs_fully_shard(world_size):
    for same_layout, names, classes, (ours, theirs, ddp), same_after, ddp_error in run_on_ranks(world_size, _layout_and_training):
        assert same_layout and names  # placements, global and local shapes and values, names in order
        assert classes == ("FSDPTinyGPT", "FSDPBlock", True, True, False)
        assert ours == theirs and same_after  # bitwise, losses and parameters after 4 Adam steps
        assert max(abs(a - b) for a, b in zip(ours, ddp)) < 1e-5 and ddp_error < 1e-5


def _hybrid_and_prefetch(mode):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    kwargs = {}
    if mode == "hybrid":
        kwargs["mesh"] = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    if mode == "no_reshard":
        kwargs["reshard_after_forward"] = False
    models = []
    for shard in (fsdp1.fully_shard, _torch_fully_shard()):
        model = make_gpt()
        if mode == "list":  # one group of two modules: returned as a list, both swapped
            kinds = [type(m).__name__ for m in shard([model.ln_f, model.head])]
        models.append(_shard_gpt(model, shard, **kwargs))
    if mode == "prefetch":
        for model in models:
            blocks = list(model.blocks)
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1: i + 2])
                block.set_modules_to_backward_prefetch(blocks[i - 1: i] if i else [])
    placements = [p.placements for p in models[0].parameters()] == [p.placements for p in models[1].parameters()]
    losses = [train(model, 3, world_size, rank) for model in models]
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(*(m.parameters() for m in models)))
    if mode == "list":
        same = same and kinds == ["FSDPLayerNorm", "FSDPLinear"]
    return placements, losses, same


@pytest.mark.parametrize("mode", ["prefetch", "no_reshard", "list"])
def test_explicit_prefetch_no_reshard_and_a_group_of_two_modules_train_bitwise_like_torch(mode):
    for placements, (ours, theirs), same in run_on_ranks(2, _hybrid_and_prefetch, mode):
        assert placements and ours == theirs and same


def test_hsdp_on_a_2d_mesh_trains_bitwise_like_torch():
    for placements, (ours, theirs), same in run_on_ranks(4, _hybrid_and_prefetch, "hybrid"):
        assert placements and ours == theirs and same  # (Replicate(), Shard(0)) on a 2x2 mesh


# ---------------------------------------------------------------------------------------------- what is registered
def _kinds(model):
    """'D' for a DTensor parameter, 'P' for a plain tensor, for the root's own and a block's."""
    return ("D" if isinstance(model.head.weight, DTensor) else "P") + ("D" if isinstance(model.blocks[0].fc.weight, DTensor) else "P")


def _registered(reshard_after_forward):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seen = []
    for shard in (fsdp1.fully_shard, _torch_fully_shard()):
        model = _shard_gpt(make_gpt(), shard, reshard_after_forward=reshard_after_forward)
        kinds = [_kinds(model)]
        loss = lm_loss(model, *batch(0, rank, world_size))
        kinds.append(_kinds(model))  # between forward and backward
        loss.backward()
        kinds.append(_kinds(model))
        with torch.no_grad():
            model(batch(1, rank, world_size)[0])
        kinds.append(_kinds(model))  # after an evaluation forward
        model.reshard()
        kinds.append(_kinds(model))
        seen.append(kinds)
    return seen


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_what_is_registered_after_forward_and_backward_is_torchs_and_after_evaluation_the_dtensors(reshard_after_forward):
    for ours, theirs in run_on_ranks(2, _registered, reshard_after_forward):
        assert ours[:3] == theirs[:3]  # before forward, between forward and backward, after backward
        # After a forward without grad every module holds its DTensors again (and after reshard()):
        # torch's keeps the root (or any reshard_after_forward=False module) gathered, so an optimizer
        # or clip_grad_norm_ built on parameters() then sees the unsharded copies and trains the root
        # silently wrong.
        assert ours[3:] == ["DD", "DD"]


def _reshard_onto_two_ranks():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seen = []
    for shard in (fsdp1.fully_shard, _torch_fully_shard()):
        model = _shard_gpt(make_gpt(), shard, reshard_after_forward=2)
        optim = adam(model.parameters())
        losses, between = [], []
        for step in range(3):
            loss = lm_loss(model, *batch(step, rank, world_size))
            weight = model.blocks[0].fc.weight  # between forward and backward: rows over 2 ranks
            between.append((type(weight).__name__, tuple(weight.placements), tuple(weight.device_mesh.mesh.shape),
                            tuple(weight.to_local().shape), weight.full_tensor().sum().item()))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        after = model.blocks[0].fc.weight
        seen.append((losses, between, tuple(after.placements), _locals(model)))
    (ours, ours_between, ours_after, ours_params), (theirs, theirs_between, theirs_after, theirs_params) = seen
    same = all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params))
    return ours, theirs, ours_between, theirs_between, ours_after, theirs_after, same


def test_reshard_after_forward_onto_two_of_four_ranks_is_torchs():
    for ours, theirs, ours_between, theirs_between, ours_after, theirs_after, same in run_on_ranks(4, _reshard_onto_two_ranks):
        assert ours == theirs and same  # bitwise, backward gathering over 2 ranks only
        assert ours_between == theirs_between  # (Replicate(), Shard(0)) on a 2x2 mesh, torch's rows and values
        assert ours_after == theirs_after  # Shard(0) over 4 ranks again after backward


def _unshard_and_reshard():
    model = _shard_gpt(make_gpt(), fsdp1.fully_shard)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    block = model.blocks[0]
    handle = block.unshard(async_op=True)
    kinds = [type(handle).__name__, isinstance(block.fc.weight, DTensor)]
    handle.wait()
    kinds += [isinstance(block.fc.weight, DTensor), torch.equal(block.fc.weight, full["blocks.0.fc.weight"]),
              isinstance(model.head.weight, DTensor)]  # not recursive
    block.reshard()
    kinds.append(isinstance(block.fc.weight, DTensor))
    kinds.append(model.unshard())
    model.reshard()
    return kinds


def test_unshard_and_reshard_act_on_one_module_as_torchs():
    for kinds in run_on_ranks(2, _unshard_and_reshard):
        assert kinds == ["UnshardHandle", True, False, True, True, True, None]


# ---------------------------------------------------------------------------------------------- accumulation
def _accumulate(reshard_after_backward):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    models = [_shard_gpt(make_gpt(), shard) for shard in (fsdp1.fully_shard, _torch_fully_shard())]
    ddp = DDP(make_gpt())
    results = []
    for model in models:
        optim = adam(model.parameters())
        losses, grads_after_unsynced = [], []
        for step in range(2):
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(reshard_after_backward)
            loss = lm_loss(model, *batch(2 * step, rank, world_size))
            loss.backward()
            grads_after_unsynced.append(all(p.grad is None for p in model.parameters()))
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
            loss2 = lm_loss(model, *batch(2 * step + 1, rank, world_size))
            loss2.backward()
            optim.step()
            optim.zero_grad()
            losses.append((loss.item(), loss2.item()))
        results.append((losses, grads_after_unsynced, _locals(model)))
    optim = adam(ddp.parameters())
    ddp_losses = []
    for step in range(2):
        with ddp.no_sync():
            loss = lm_loss(ddp, *batch(2 * step, rank, world_size))
            loss.backward()
        loss2 = lm_loss(ddp, *batch(2 * step + 1, rank, world_size))
        loss2.backward()
        optim.step()
        optim.zero_grad()
        ddp_losses.append((loss.item(), loss2.item()))
    (ours, ours_none, ours_params), (theirs, theirs_none, theirs_params) = results
    same = all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params))
    return ours, theirs, ddp_losses, ours_none, theirs_none, same


@pytest.mark.parametrize("reshard_after_backward", [True, False])
def test_gradient_accumulation_without_sync_is_torchs_and_ddps_no_sync(reshard_after_backward):
    for ours, theirs, ddp, ours_none, theirs_none, same in run_on_ranks(2, _accumulate, reshard_after_backward):
        assert ours == theirs and same
        assert max(abs(a - b) for pair in zip(ours, ddp) for a, b in zip(*pair)) < 1e-5
        # After an unsynchronised backward the sharded parameters have no .grad; kept gathered, the
        # module holds the unsharded parameters, whose .grad is the unreduced sum (as torch's).
        assert ours_none == theirs_none == [reshard_after_backward] * 2


# ---------------------------------------------------------------------------------------------- mixed precision, offload, ignored
def _mixed_precision():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    policy_kwargs = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    ours = _shard_gpt(make_gpt(), fsdp1.fully_shard, mp_policy=fsdp1.MixedPrecisionPolicy(**policy_kwargs))
    theirs = _shard_gpt(make_gpt(), _torch_fully_shard(), mp_policy=TorchPolicy(**policy_kwargs))
    torch_policy_accepted = _shard_gpt(make_gpt(), fsdp1.fully_shard, mp_policy=TorchPolicy(**policy_kwargs))
    losses = [train(model, 3, world_size, rank) for model in (ours, theirs, torch_policy_accepted)]
    dtypes = {p.dtype for p in ours.parameters()} | {p.grad.dtype for p in ours.parameters() if p.grad is not None}
    output = ours(batch(0, rank, world_size)[0])
    return losses, dtypes, output.dtype


def test_bf16_mixed_precision_policy_trains_like_torchs():
    for (ours, theirs, with_torch_policy), dtypes, output_dtype in run_on_ranks(2, _mixed_precision):
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 2e-3
        assert with_torch_policy == ours  # torch's policy object is accepted and means the same
        assert dtypes == {torch.float32} and output_dtype == torch.bfloat16  # sharded parameters and gradients in fp32


def _offload_and_ignored():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    offloaded = _shard_gpt(make_gpt(), fsdp1.fully_shard, offload_policy=fsdp1.CPUOffloadPolicy())  # pin_memory=True
    plain = _shard_gpt(make_gpt(), fsdp1.fully_shard)
    losses = [train(model, 3, world_size, rank) for model in (offloaded, plain)]
    model = make_gpt()
    ignored = {model.ln_f.weight, model.ln_f.bias}
    _shard_gpt(model, fsdp1.fully_shard, ignored_params=ignored)
    kinds = [isinstance(model.ln_f.weight, DTensor), isinstance(model.head.weight, DTensor)]
    lm_loss(model, *batch(0, rank, world_size)).backward()
    return losses, kinds, model.ln_f.weight.grad.clone()


def test_cpu_offload_with_pinned_memory_works_on_a_cpu_host_and_ignored_params_stay_plain():
    results = run_on_ranks(2, _offload_and_ignored)
    for (offloaded, plain), kinds, _ in results:
        assert offloaded == plain  # torch's fails here with pin_memory=True
        assert kinds == [False, True]
    assert not torch.equal(results[0][2], results[1][2])  # an ignored parameter's gradient is not reduced


# ---------------------------------------------------------------------------------------------- beyond torch
def _beyond_torch():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _shard_gpt(make_gpt(), fsdp1.fully_shard)
    plain = make_gpt()
    with model.summon_full_params():
        summoned = all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
        kinds = {type(p).__name__ for p in model.parameters()}
    with model.no_sync():
        lm_loss(model, *batch(0, rank, world_size)).backward()
    no_grad_yet = all(p.grad is None for p in model.parameters())
    lm_loss(model, *batch(1, rank, world_size)).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    reference = _shard_gpt(make_gpt(), fsdp1.fully_shard)
    reference.set_requires_gradient_sync(False)
    lm_loss(reference, *batch(0, rank, world_size)).backward()
    reference.set_requires_gradient_sync(True)
    lm_loss(reference, *batch(1, rank, world_size)).backward()
    same_grads = all(torch.equal(a, p.grad.full_tensor()) for a, p in zip(grads, reference.parameters()))
    return summoned, kinds, no_grad_yet, same_grads


def test_summon_full_params_and_no_sync_work_on_fully_shard_modules():
    for summoned, kinds, no_grad_yet, same_grads in run_on_ranks(2, _beyond_torch):
        assert summoned and kinds == {"Parameter"}
        assert no_grad_yet and same_grads  # no_sync() is set_requires_gradient_sync(False) for its duration


def _forward_method_and_conversion():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    plain = make_gpt()
    model = _shard_gpt(make_gpt(), fsdp1.fully_shard)

    def embed(self, idx):
        return self.tok(idx) + self.pos[: idx.shape[1]]

    type(plain).embed = embed
    fsdp1.register_fsdp_forward_method(model, "embed")
    fsdp1.register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # a plain module: nothing happens
    idx = batch(0, rank, world_size)[0]
    same_embedding = torch.equal(model.embed(idx), plain.embed(idx))
    del type(plain).embed
    model.double()
    dtypes = {p.dtype for p in model.parameters()} | {p.to_local().dtype for p in model.parameters()}
    loss = lm_loss(model, *batch(1, rank, world_size))
    loss.backward()
    try:
        copy.deepcopy(model)
        deepcopy_error = None
    except AssertionError as error:
        deepcopy_error = str(error)
    return same_embedding, dtypes, loss.dtype, deepcopy_error


def test_forward_methods_conversions_and_deepcopy_behave_as_torchs():
    for same_embedding, dtypes, loss_dtype, deepcopy_error in run_on_ranks(2, _forward_method_and_conversion):
        assert same_embedding
        assert dtypes == {torch.float64} and loss_dtype == torch.float64
        assert deepcopy_error == "FSDP does not support deepcopy"


def _everyday_against_ddp(pattern):
    """fully_shard and DDP (or torch's fully_shard) doing the same thing; what each trained."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    for wrap in ("fully_shard", "ddp" if pattern == "optimizer_after_eval" else "torch_fully_shard"):
        torch.manual_seed(0)
        if pattern == "meta_init":
            with torch.device("meta"):
                model = make_gpt()
        else:
            model = make_gpt()
        if pattern == "frozen_root":  # frozen parts of the root, which stays gathered for backward
            model.tok.requires_grad_(False)
            model.head.bias.requires_grad_(False)
        if wrap == "fully_shard":
            model = _shard_gpt(model, fsdp1.fully_shard)
        elif wrap == "torch_fully_shard":
            model = _shard_gpt(model, _torch_fully_shard())
        if pattern == "meta_init":
            model.to_empty(device="cpu")
            torch.manual_seed(1)
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            with torch.no_grad():
                model.pos.normal_()
        model = DDP(model) if wrap == "ddp" else model
        if pattern == "optimizer_after_eval":  # an evaluation forward before the optimizer exists
            with torch.no_grad():
                model(batch(0, rank, world_size)[0])
        optim = adam(model.parameters())
        losses = []
        for step in range(3):
            loss = lm_loss(model, *batch(step, rank, world_size))
            loss.backward()
            if pattern == "optimizer_after_eval":  # a metric before clipping
                with torch.no_grad():
                    model(batch(step, rank, world_size)[0])
                norm = nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                losses.append(norm.full_tensor().item() if isinstance(norm, DTensor) else norm.item())
            if pattern == "frozen_root" and step == 1:
                model_ = model.module if wrap == "ddp" else model
                model_.head.bias.requires_grad_(True)  # unfrozen between steps
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        named = (model.module if wrap == "ddp" else model).named_parameters()
        results.append((losses, {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in named}))
    (ours, ours_params), (oracle, oracle_params) = results
    return ours, oracle, max((ours_params[n] - oracle_params[n]).abs().max().item() for n in oracle_params)


@pytest.mark.parametrize("pattern", ["frozen_root", "meta_init"])
def test_frozen_root_parameters_and_meta_init_train_bitwise_like_torchs(pattern):
    """The root stays gathered for backward, with frozen parts, one unfrozen between steps (DDP cannot
    be the oracle: its reducer keeps the parameters that needed a gradient when it was built); and
    torch's meta-device recipe, to_empty then reset_parameters on the DTensors (each rank draws its
    own rows, so the values are torch's, not a plain model's)."""
    for ours, theirs, error in run_on_ranks(2, _everyday_against_ddp, pattern):
        assert ours == theirs and error == 0.0


def test_an_optimizer_built_and_a_norm_clipped_after_evaluation_forwards_train_like_ddp():
    """Both silently wrong under torch's fully_shard, which leaves the root's unsharded parameters
    registered after an evaluation forward, for the optimizer and clip_grad_norm_ to pick up."""
    for ours, ddp, error in run_on_ranks(2, _everyday_against_ddp, "optimizer_after_eval"):
        assert max(abs(a - b) for a, b in zip(ours, ddp)) < 1e-5 and error < 1e-5


def _checkpointed_and_compiled(mode):
    """Activation checkpointing of every block (torch's wrapper, applied after fully_shard) or
    torch.compile of the whole model: against torch's fully_shard doing the same."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    runs = []
    for shard in (fsdp1.fully_shard, _torch_fully_shard()):
        model = _shard_gpt(make_gpt(), shard)
        if mode == "checkpointing":
            apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
        runs.append(train(torch.compile(model) if mode == "compile" else model, 3, world_size, rank))
    return runs


@pytest.mark.parametrize("mode", ["checkpointing", "compile"])
def test_activation_checkpointing_and_torch_compile_train_like_torchs_fully_shard(mode):
    for ours, theirs in run_on_ranks(2, _checkpointed_and_compiled, mode):
        if mode == "checkpointing":
            assert ours == theirs  # bitwise
        else:  # compiled graphs may fuse differently between the two
            assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-5


def _saved_and_copied():
    import io

    model = _shard_gpt(make_gpt(), fsdp1.fully_shard)
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


# ---------------------------------------------------------------------------------------------- Hugging Face
def _gpt2():
    rank = dist.get_rank()
    t = transformers
    torch.manual_seed(0)
    config = t.GPT2Config(vocab_size=61, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = t.GPT2LMHeadModel(config)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    for model, shard in zip(models, (fsdp1.fully_shard, _torch_fully_shard())):
        for block in model.transformer.h:
            shard(block)
        shard(model)
    tied = models[0].lm_head.weight is models[0].transformer.wte.weight
    losses = []
    for model in models:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run = []
        for step in range(3):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(1, 61, (2, 9), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            run.append(loss.item())
        losses.append(run)
    keys = list(models[0].state_dict()) == list(models[1].state_dict())
    prompt = torch.tensor([[5, 7, 11]])
    with torch.no_grad():
        tokens = models[0].generate(prompt, max_new_tokens=5, do_sample=False)
    reference = copy.deepcopy(base)
    reference.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in models[0].state_dict().items()})
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=5, do_sample=False)
    return tied, losses, keys, torch.equal(tokens, expected)


def test_hf_gpt2_per_block_and_root_keeps_the_tie_trains_and_generates_as_torchs():
    for tied, (ours, theirs), keys, same_tokens in run_on_ranks(2, _gpt2):
        assert tied and ours == theirs and keys and same_tokens


# ---------------------------------------------------------------------------------------------- errors
def _errors():
    messages = {}

    def refused(name, call, error=ValueError):
        try:
            call()
            messages[name] = "no error"
        except error as caught:
            messages[name] = str(caught)

    refused("module_list", lambda: fsdp1.fully_shard(nn.ModuleList([nn.Linear(2, 2)])))
    scalar = nn.Linear(2, 2)
    scalar.scale = nn.Parameter(torch.tensor(1.0))
    refused("scalar", lambda: fsdp1.fully_shard(scalar))
    refused("int_not_dividing", lambda: fsdp1.fully_shard(nn.Linear(2, 2), reshard_after_forward=3))
    twice = fsdp1.fully_shard(nn.Linear(2, 2))
    refused("twice", lambda: fsdp1.fully_shard(twice), AssertionError)
    refused("fsdp1_inside", lambda: fsdp1.fully_shard(nn.Sequential(fsdp1.FullyShardedDataParallel(nn.Linear(2, 2)))))
    refused("fully_shard_inside", lambda: fsdp1.FullyShardedDataParallel(nn.Sequential(fsdp1.fully_shard(nn.Linear(2, 2)))))
    from torch.distributed.tensor import Shard

    refused("shard_dim_1", lambda: fsdp1.fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None),
            NotImplementedError)
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    parallel = nn.Linear(2, 2)  # a tensor-parallel parameter: already a DTensor
    parallel.weight = nn.Parameter(distribute_tensor(parallel.weight.detach(), init_device_mesh("cpu", (2,)), [Replicate()]))
    refused("dtensor_param", lambda: fsdp1.fully_shard(parallel), NotImplementedError)
    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    fsdp1.fully_shard(tied[0])
    refused("tied_across_groups", lambda: fsdp1.fully_shard(tied))
    return messages


def test_bad_input_is_refused_naming_the_module_or_parameter_and_the_fix():
    messages = run_on_ranks(2, _errors)[0]
    assert messages["module_list"].startswith("fully_shard does not support containers that do not implement forward")
    assert "Change scale to a 1D tensor" in messages["scalar"]
    assert "reshard_after_forward=3 must be a positive divisor of the shard world size 2" in messages["int_not_dividing"]
    assert "fully_shard was already applied to it" in messages["twice"]
    assert "contains the FullyShardedDataParallel unit '0'" in messages["fsdp1_inside"]
    assert "contains the fully_shard module '0'" in messages["fully_shard_inside"]
    assert "only Shard(0) (or None) is supported yet" in messages["shard_dim_1"]
    assert "parameter 'weight' is already a DTensor (tensor parallelism)" in messages["dtensor_param"]
    assert "Parameter '1.weight' is shared with a parameter already managed by another FSDP group ('0.weight')" in messages["tied_across_groups"]
