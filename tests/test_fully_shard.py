"""Tests what only ``fsdp1.fully_shard`` (torch's FSDP2 API on fsdp1's engine) has, against torch's own
``fully_shard`` and DDP doing the same: the class swap, DTensor parameters (placements, global and local
shapes, values) and training bitwise torch's (blocks + root, on 1, 2 and 4 ranks), what is registered
after forward / backward / an evaluation forward for each ``reshard_after_forward``, an integer
``reshard_after_forward`` on 4 ranks, ``unshard``/``reshard`` and a late ``UnshardHandle.wait()``, the leaf
Parameters of a module kept gathered after forward, post-accumulate-grad hooks on the DTensor parameters
(optimizer-in-backward), None gradients for the modules of a group that did not run,
``set_gradient_divide_factor`` on the module's own group, the collectives of a step (none on one rank),
torch's composable ``replicate`` inside or around ``fully_shard`` modules, ``summon_full_params`` and
``no_sync`` on its modules, forward methods, dtype conversions (also with swapped module parameters) and
deepcopy, each as torch's ``fully_shard`` does it. Its other features are tested with the
same feature under ``FullyShardedDataParallel`` (test_accumulation, test_mixed_precision,
test_cpu_offload, test_prefetch, test_hybrid_shard, test_fully_shard_checkpoint, test_errors, ...)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    VOCAB,
    Block,
    TinyGPT,
    adam,
    batch,
    full_grads,
    fully_shard_of,
    lm_loss,
    local_shards,
    make_gpt,
    make_trunk,
    run_both,
    same_tensors,
    shard_gpt,
    torchs_fully_shard,
    train,
    train_steps,
)


# ---------------------------------------------------------------------------------------------- layout and training
def _layout_and_training():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ours = shard_gpt(make_gpt(), fsdp1.fully_shard)
    theirs = shard_gpt(make_gpt(), torchs_fully_shard())
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
        assert same_layout  # placements, global and local shapes and values
        assert names  # names in order
        assert classes == ("FSDPTinyGPT", "FSDPBlock", True, True, False)
        assert ours == theirs  # bitwise, losses and parameters after 4 Adam steps
        assert same_after
        assert max(abs(a - b) for a, b in zip(ours, ddp)) < 1e-5
        assert ddp_error < 1e-5


# ---------------------------------------------------------------------------------------------- what is registered
def _kinds(model):
    """'D' for a DTensor parameter, 'P' for a plain tensor, for the root's own and a block's."""
    return ("D" if isinstance(model.head.weight, DTensor) else "P") + ("D" if isinstance(model.blocks[0].fc.weight, DTensor) else "P")


def _registered(reshard_after_forward):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seen = []
    for shard in (fsdp1.fully_shard, torchs_fully_shard()):
        model = shard_gpt(make_gpt(), shard, reshard_after_forward=reshard_after_forward)
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


def _reshard_onto_two_ranks(hsdp):
    from torch.distributed.device_mesh import init_device_mesh

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard")) if hsdp else None
    seen = []
    for shard in (fsdp1.fully_shard, torchs_fully_shard()):
        model = shard_gpt(make_gpt(), shard, reshard_after_forward=2, mesh=mesh)
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
        seen.append((losses, between, tuple(after.placements), local_shards(model)))
    (ours, ours_between, ours_after, ours_params), (theirs, theirs_between, theirs_after, theirs_params) = seen
    same = all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params))
    return ours, theirs, ours_between, theirs_between, ours_after, theirs_after, same


@pytest.mark.parametrize("hsdp", [False, True], ids=["4 ranks", "hsdp 2x4"])
def test_reshard_after_forward_onto_two_of_four_ranks_is_torchs(hsdp):
    """On 4 ranks, and on 8 as 2 replicas of 4 shards (HSDP): both keep rows over consecutive pairs."""
    for ours, theirs, ours_between, theirs_between, ours_after, theirs_after, same in run_on_ranks(8 if hsdp else 4, _reshard_onto_two_ranks, hsdp):
        assert ours == theirs  # bitwise, backward gathering over 2 ranks only
        assert same
        assert ours_between == theirs_between  # (Replicate(), Shard(0)) on a (world / 2, 2) mesh, torch's rows and values
        assert ours_after == theirs_after  # Shard(0) over the shard ranks again after backward


def _late_wait_while_rows_are_kept():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seen = []
    for shard in (fsdp1.fully_shard, torchs_fully_shard()):
        model = shard_gpt(make_gpt(), shard, reshard_after_forward=2)
        optim = adam(model.parameters())
        handle = model.blocks[0].unshard(async_op=True)
        losses, kept = [], []
        for step in range(2):
            loss = lm_loss(model, *batch(step, rank, world_size))
            if step == 0:
                handle.wait()  # the forward used its gather; the block keeps its rows over 2 ranks now
            weight = model.blocks[0].fc.weight
            kept.append((tuple(weight.placements), weight.full_tensor().sum().item()))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        seen.append((losses, kept, local_shards(model)))
    (ours, ours_kept, ours_params), (theirs, theirs_kept, theirs_params) = seen
    return ours, theirs, ours_kept, theirs_kept, all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params))


def test_a_late_wait_on_a_module_that_keeps_its_rows_after_forward_does_nothing_as_torchs():
    for ours, theirs, ours_kept, theirs_kept, same in run_on_ranks(4, _late_wait_while_rows_are_kept):
        assert ours == theirs  # bitwise losses over 2 Adam steps
        assert ours_kept == theirs_kept  # the rows the block shows after the wait: (Replicate(), Shard(0)), torch's values
        assert same  # parameters after the steps


def _unshard_and_reshard():
    model = shard_gpt(make_gpt(), fsdp1.fully_shard)
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


# ---------------------------------------------------------------------------------------------- gathering
def _late_wait(impl):
    shard = fully_shard_of(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    shard_gpt(model, shard)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = model.blocks[0].unshard(async_op=True)
    F.cross_entropy(model(batch(0, rank, world_size)[0]).reshape(-1, VOCAB), batch(0, rank, world_size)[1].reshape(-1)).backward()
    optim.step()
    handle.wait()  # its gather was used by the forward and freed since
    loss = F.cross_entropy(model(batch(1, rank, world_size)[0]).reshape(-1, VOCAB), batch(1, rank, world_size)[1].reshape(-1))
    return loss.item(), [type(p).__name__ for p in model.blocks[0].parameters()]


def test_a_wait_on_an_unshard_handle_whose_gather_was_used_since_does_nothing_as_torchs():
    ours, theirs = run_both(_late_wait)
    assert ours == theirs


def _kept_gathered_registration(impl):
    shard = fully_shard_of(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        shard(block, reshard_after_forward=False)
    shard(model)
    inputs, targets = batch(0, rank, world_size)
    loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
    kinds = [(type(p).__name__, p.is_leaf, p.requires_grad) for p in model.parameters()]
    model.blocks[1].requires_grad_(False)  # between forward and backward: Parameters, as torch's registers them
    loss.backward()
    return kinds, [p.requires_grad for p in model.parameters()], full_grads(model)


def test_a_module_kept_gathered_after_forward_holds_leaf_parameters_as_torchs():
    ours, theirs = run_both(_kept_gathered_registration)
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1]
    frozen_in_between = range(13, 24)  # blocks.1: torch's (and a plain model's) backward drops their gradients,
    # fsdp1's computes them: its forward read them through the flat parameter (a documented difference)
    assert all(ours[2][i] is not None for i in frozen_in_between)
    assert all(theirs[2][i] is None for i in frozen_in_between)
    assert same_tensors([g for i, g in enumerate(ours[2]) if i not in frozen_in_between],
                 [g for i, g in enumerate(theirs[2]) if i not in frozen_in_between])


# ---------------------------------------------------------------------------------------------- gradients
def _optimizer_in_backward(impl):
    """torchtune's optimizer-in-backward: an optimizer per parameter, stepped by the parameter's
    post-accumulate-grad hook, which then drops the gradient."""
    shard = fully_shard_of(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    shard_gpt(model, shard)
    optims = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}
    calls = []

    def step(param):
        calls.append(param.grad.to_local().norm().item())
        optims[param].step()
        optims[param].zero_grad()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(step)
    losses = []
    for step_index in range(3):
        inputs, targets = batch(step_index, rank, world_size)
        loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        losses.append(loss.item())
    return losses, len(calls), sorted(calls), [p.detach().full_tensor() for p in model.parameters()], full_grads(model)


def test_post_accumulate_grad_hooks_on_the_sharded_parameters_run_once_a_backward_as_torchs():
    ours, theirs = run_both(_optimizer_in_backward)
    assert ours[1] == theirs[1] == 3 * 28  # every parameter's hook once a backward
    assert ours[0] == theirs[0]
    assert ours[2] == theirs[2]
    assert same_tensors(ours[3], theirs[3])
    assert same_tensors(ours[4], theirs[4])  # all None: the hooks dropped them


def _unused_module_of_a_group(impl):
    shard = fully_shard_of(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_trunk()
    shard_gpt(model, shard, head_group=True)
    for step_index in range(2):  # the head never runs
        model(batch(step_index, rank, world_size)[0]).sum().backward()
    return full_grads(model)


def test_a_module_of_a_group_that_never_ran_has_no_gradient_as_torchs():
    ours, theirs = run_both(_unused_module_of_a_group)
    assert ours[-2:] == [None, None]  # the head's
    assert same_tensors(ours, theirs)


class _OptionalSecond(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.use_b = True

    def forward(self, x):
        h = self.a(x)
        return h + self.b(h) if self.use_b else h


def _module_unused_after_a_step(impl):
    shard = fully_shard_of(impl)
    torch.manual_seed(0)
    model = _OptionalSecond()
    shard([model.a, model.b])
    shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for step in range(3):
        model.use_b = step == 0  # b runs in the first step only: AdamW must then skip it
        model(torch.randn(2, 4, generator=torch.Generator().manual_seed(step * 2 + dist.get_rank()))).sum().backward()
        grads.append(full_grads(model))
        optim.step()
        optim.zero_grad(set_to_none=True)
    return grads, [p.detach().full_tensor() for p in model.parameters()]


def test_a_module_unused_after_a_step_has_no_gradient_and_adamw_skips_it_as_torchs():
    ours, theirs = run_both(_module_unused_after_a_step)
    assert ours[0][1][2] is None  # b.weight in the second step
    assert all(same_tensors(a, b) for a, b in zip(ours[0], theirs[0]))
    assert same_tensors(ours[1], theirs[1])


def _divide_factor_of_the_root(impl):
    shard = fully_shard_of(impl)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    shard(model[1])
    shard(model)
    model.set_gradient_divide_factor(4.0)
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):  # gloo has no PREMUL_SUM: torch's then sums
            module.set_force_sum_reduction_for_comms(True)
    model(torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
    return full_grads(model)


def test_set_gradient_divide_factor_acts_on_the_modules_own_group_only_as_torchs():
    ours, theirs = run_both(_divide_factor_of_the_root)
    assert same_tensors(ours, theirs)


def _zero_divide_factor(impl):
    """The error a divide factor of zero gets: torch's at its reduction, fsdp1's when it is set."""
    model = nn.Linear(4, 4)
    fully_shard_of(impl)(model)
    try:
        model.set_gradient_divide_factor(0.0)
        model(torch.randn(2, 4)).sum().backward()
    except ZeroDivisionError as error:
        return str(error)
    return None


def test_a_divide_factor_of_zero_raises_torchs_error_when_it_is_set():
    ours, theirs = run_both(_zero_divide_factor)
    assert theirs is not None and ours is not None and "pass the number of ranks" in ours


def _all_reduce_hook(impl, device_type, with_stream):
    """A hook on the module's reduced gradient shard that doubles it, on a stream of the device's
    own (``with_stream``) or the current one: the gradients, and for each call whether the stream
    given was current."""
    shard = fully_shard_of(impl)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).to(device_type)
    shard(model)
    streams = torch.get_device_module(device_type)
    stream = streams.Stream() if with_stream else None
    calls = []

    def hook(reduced):
        calls.append(streams.current_stream() == stream if stream is not None else None)
        reduced.mul_(2)

    model.set_all_reduce_hook(hook, stream=stream)
    for step in range(2):
        inputs = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank())).to(device_type)
        model(inputs).sum().backward()
    return [grad.cpu() for grad in full_grads(model)], calls


def test_the_all_reduce_hook_sees_each_reduced_shard_as_torchs():
    """Once per backward, after the reduce-scatter, in place: gradients bitwise torch's."""
    (ours, our_calls), (theirs, their_calls) = run_both(_all_reduce_hook, "cpu", False)
    assert same_tensors(ours, theirs)
    assert our_calls == their_calls == [None, None]


def test_the_all_reduce_hook_runs_on_the_cpu_stream_it_was_given():
    """``set_all_reduce_hook(hook, stream=torch.cpu.Stream())`` on a CPU mesh: the hook runs with that
    stream current, as torch's does; the gradients are torch's."""
    (ours, our_calls), (theirs, their_calls) = run_both(_all_reduce_hook, "cpu", True)
    assert same_tensors(ours, theirs)
    assert our_calls == their_calls == [True, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams need a GPU")
def test_the_all_reduce_hook_runs_on_the_stream_it_was_given():
    """``set_all_reduce_hook(hook, stream=s)`` on a 1-D mesh: the hook runs with ``s`` current."""
    (ours, our_calls), (theirs, their_calls) = run_both(_all_reduce_hook, "cuda", True, world_size=1)
    assert same_tensors(ours, theirs)
    assert our_calls == their_calls == [True, True]


def _converted_with_swapped_params(impl):
    shard = fully_shard_of(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    shard_gpt(model, shard)
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    inputs, targets = batch(0, rank, world_size)
    loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    return loss.item(), [p.dtype for p in model.parameters()], full_grads(model)


def test_a_conversion_with_swapped_module_parameters_keeps_gradients_as_torchs():
    ours, theirs = run_both(_converted_with_swapped_params)
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1] == [torch.float64] * 28
    assert same_tensors(ours[2], theirs[2])


# ---------------------------------------------------------------------------------------------- collectives and composition
def _collectives_of_a_step(impl):
    from torch.distributed.tensor.debug import CommDebugMode

    shard = fully_shard_of(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    shard_gpt(model, shard)
    inputs, targets = batch(0, rank, world_size)
    model(inputs).sum().backward()  # the first iteration (fsdp1 compares the ranks' unit orders once)
    with CommDebugMode() as mode:
        F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1)).backward()
    return {str(op).split(".")[-1]: count for op, count in mode.get_comm_counts().items()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_step_issues_torchs_collectives_and_none_on_one_rank(world_size):
    ours, theirs = run_both(_collectives_of_a_step, world_size=world_size)
    if world_size == 2:  # two gloo ranks exchange each all-gather's and reduce-scatter's chunk in one all-to-all
        assert ours == {"alltoall_base_": sum(theirs.values())}
        assert theirs == {"_allgather_base_": 5, "_reduce_scatter_base_": 3}
    else:
        assert ours == theirs == ({} if world_size == 1 else {"_allgather_base_": 5, "_reduce_scatter_base_": 3})


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.out_proj(self.in_proj(x).relu())


def _with_replicate(impl, where):
    from torch.distributed._composable import replicate

    shard = fully_shard_of(impl)
    torch.manual_seed(0)
    if where == "inside":  # torch's: replicate() a submodule, fully_shard the rest
        model = nn.Sequential(_MLP(), _MLP(), _MLP())
        replicate(model[0])
        shard(model[2])
        shard(model)
    else:  # fully_shard submodules, then replicate() the model around them
        model = nn.Sequential(nn.Linear(4, 4), _MLP())
        shard(model[1].in_proj, reshard_after_forward=False)
        shard(model[1])
        replicate(model)
    for _ in range(2):
        model(torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
    return [type(p).__name__ for p in model.parameters()], [
        None if p.grad is None else (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for p in model.parameters()
    ]


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_modules_managed_by_torchs_replicate_compose_as_with_torchs(where):
    ours, theirs = run_both(_with_replicate, where)
    assert ours[0] == theirs[0]
    assert same_tensors(ours[1], theirs[1])



# ---------------------------------------------------------------------------------------------- beyond torch
def _beyond_torch():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = shard_gpt(make_gpt(), fsdp1.fully_shard)
    plain = make_gpt()
    with model.summon_full_params():
        summoned = all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
        kinds = {type(p).__name__ for p in model.parameters()}
    with model.no_sync():
        lm_loss(model, *batch(0, rank, world_size)).backward()
    no_grad_yet = all(p.grad is None for p in model.parameters())
    lm_loss(model, *batch(1, rank, world_size)).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    reference = shard_gpt(make_gpt(), fsdp1.fully_shard)
    reference.set_requires_gradient_sync(False)
    lm_loss(reference, *batch(0, rank, world_size)).backward()
    reference.set_requires_gradient_sync(True)
    lm_loss(reference, *batch(1, rank, world_size)).backward()
    same_grads = all(torch.equal(a, p.grad.full_tensor()) for a, p in zip(grads, reference.parameters()))
    return summoned, kinds, no_grad_yet, same_grads


def test_summon_full_params_and_no_sync_work_on_fully_shard_modules():
    for summoned, kinds, no_grad_yet, same_grads in run_on_ranks(2, _beyond_torch):
        assert summoned
        assert kinds == {"Parameter"}
        assert no_grad_yet
        assert same_grads  # no_sync() is set_requires_gradient_sync(False) for its duration


def _forward_method_and_conversion():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    plain = make_gpt()
    model = shard_gpt(make_gpt(), fsdp1.fully_shard)

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
        assert dtypes == {torch.float64}
        assert loss_dtype == torch.float64
        assert deepcopy_error == "FSDP does not support deepcopy"


# ---------------------------------------------------------------------------------------------- custom collectives
class _RecordedAllGather:
    """torch's ``AllGather`` interface over ``all_gather_into_tensor``, recording what it is given."""

    def __init__(self):
        self.calls = []
        self.allocated = []  # the user's buffers are the user's: fsdp1 must not free them

    def allocate(self, size, *, dtype, device):
        self.allocated.append(torch.empty(size, dtype=dtype, device=device))
        return self.allocated[-1]

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append((tuple(output_tensor.shape), tuple(input_tensor.shape), output_tensor.dtype))
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _RecordedReduceScatter(_RecordedAllGather):
    """torch's ``ReduceScatter`` interface over ``reduce_scatter_tensor``, synchronous, taking no
    ``async_op`` (torch's FSDP2 passes none)."""

    def __call__(self, output_tensor, input_tensor, group, op):
        self.calls.append((tuple(output_tensor.shape), tuple(input_tensor.shape), output_tensor.dtype))
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)


def _trained_with_custom_collectives(impl):
    model = shard_gpt(make_gpt(), fully_shard_of(impl))
    gather, reduce = _RecordedAllGather(), _RecordedReduceScatter()
    for module in (model, *model.blocks):
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(reduce)
    losses = train_steps(model, adam(model.parameters()), 0, 2)
    kept = all(t.untyped_storage().size() == t.numel() * t.element_size() for t in gather.allocated + reduce.allocated)
    return losses, local_shards(model), gather.calls, reduce.calls, kept


def _custom_collectives_as_torchs():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # reduce_scatter_tensor's new name
        ours, theirs = _trained_with_custom_collectives("fsdp1"), _trained_with_custom_collectives("torch")
    return ours[0] == theirs[0], same_tensors(ours[1], theirs[1]), ours[2] == theirs[2], ours[3] == theirs[3], len(ours[2]), ours[4]


def test_custom_all_gather_and_reduce_scatter_are_called_as_torchs():
    """Every gather and reduction goes through the user's collectives, with torch's buffer sizes and
    dtypes, and training is bitwise torch's (fsdp1's reduce-scatter is a sum it divides after)."""
    for same_losses, same_shards, same_gathers, same_reductions, gathers, buffers_kept in run_on_ranks(2, _custom_collectives_as_torchs):
        assert same_losses
        assert buffers_kept
        assert same_shards
        assert same_gathers
        assert same_reductions
        assert gathers == 10  # root and 2 blocks in forward, 2 blocks in backward, 2 steps


# ---------------------------------------------------------------------------------------------- torch.compile over the DTensors
def _compiled_sgd_steps(impl):
    """Two SGD steps whose update is compiled over each DTensor parameter and gradient, as a compiled
    optimizer step (torchao's low-bit optimizers) traces them."""

    # aot_eager: traced as inductor traces, but no compiled graph cached on disk, which the ranks of one
    # machine share although their uneven local shapes differ (a graph one rank wrote, another loads)
    @torch.compile(backend="aot_eager")
    def update(param, grad):
        param.add_(grad, alpha=-0.1)

    model = shard_gpt(make_gpt(), fully_shard_of(impl))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        lm_loss(model, *batch(step, rank, world_size)).backward()
        with torch.no_grad():
            for param in model.parameters():
                update(param, param.grad)
        model.zero_grad()
    return local_shards(model)


def _compiled_steps_as_torchs():
    torch._dynamo.reset()
    ours = _compiled_sgd_steps("fsdp1")
    return same_tensors(ours, _compiled_sgd_steps("torch"))


def test_a_compiled_update_over_the_dtensor_parameters_and_gradients_is_torchs():
    """Each DTensor is built on its own local tensor, as ``from_local`` builds: dynamo failed on ones
    built on a stand-in ("set the storage of a tensor on device cpu to a storage on ... meta")."""
    assert run_on_ranks(2, _compiled_steps_as_torchs) == [True, True]


def _blocks_compiled_before_sharding(impl):
    """torchtitan's order: each block compiled (``fullgraph``) in place, then sharded. Two SGD steps;
    the losses and the number of graphs dynamo compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_gpt()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    model = shard_gpt(model, fully_shard_of(impl))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(2):
        loss = lm_loss(model, *batch(step, rank, world_size))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, counters["stats"]["unique_graphs"]


def _compiled_blocks_as_torchs():
    return _blocks_compiled_before_sharding("fsdp1"), _blocks_compiled_before_sharding("torch")


def test_blocks_compiled_with_fullgraph_before_sharding_train_as_torchs_with_no_more_graphs():
    for (losses, graphs), (their_losses, their_graphs) in run_on_ranks(2, _compiled_blocks_as_torchs):
        assert losses == their_losses
        assert 0 < graphs <= their_graphs
