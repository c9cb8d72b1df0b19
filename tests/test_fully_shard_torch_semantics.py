"""Tests the behaviours torch's own ``fully_shard`` tests and real FSDP2 code rely on, each run the
same way under torch's ``fully_shard`` and fsdp1's, asserting the same outcome (values bitwise,
exception type and key phrase): chunked losses through a group of modules, mixed precision inside a
group and under accumulation, parameters replaced after sharding on the meta device, late waits,
hooks on the sharded parameters, conversions, unused modules, tied weights across groups,
non-contiguous parameters, mesh checks, a single rank's collectives and torch's messages."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import fsdp1

from _harness import run_on_ranks
from _models import VOCAB, TinyGPT, batch


def _fully_shard(impl):
    if impl == "fsdp1":
        return fsdp1.fully_shard
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _full_grads(model):
    return [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]


def _same(xs, ys):
    return len(xs) == len(ys) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(xs, ys)
    )


class _Trunk(TinyGPT):
    """torchtitan's chunked loss: the model's forward stops before the head, which runs per chunk."""

    def forward(self, idx):
        return self.ln_f(self.blocks(self.tok(idx) + self.pos[: idx.shape[1]]))


def _trunk():
    torch.manual_seed(0)
    return _Trunk()


def _shard_gpt(shard, model, head_group=False, **kwargs):
    """Blocks first, then (``head_group``) the final norm and the head as one group, then the root."""
    for block in model.blocks:
        shard(block, **kwargs)
    if head_group:
        shard([model.ln_f, model.head], **kwargs)
    return shard(model, **kwargs)


def _run_both(body, *args, world_size=2):
    """Rank 0's result of ``body`` under fsdp1's ``fully_shard`` and under torch's."""
    return tuple(run_on_ranks(world_size, body, impl, *args)[0] for impl in ("fsdp1", "torch"))


# ---------------------------------------------------------------------------------------------- chunked loss
def _chunked_loss(impl):
    shard = _fully_shard(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _trunk()
    _shard_gpt(shard, model, head_group=True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(2):
        inputs, targets = batch(step, rank, world_size, batch_size=4)
        hidden = model(inputs)
        detached = hidden.detach().requires_grad_(True)
        for chunk, chunk_targets in zip(detached.chunk(2), targets.chunk(2)):
            loss = F.cross_entropy(model.head(chunk).reshape(-1, VOCAB), chunk_targets.reshape(-1))
            loss.backward()
            losses.append(loss.item())
        hidden.backward(detached.grad)
        grads.append(_full_grads(model))
        optim.step()
        optim.zero_grad()
    return losses, grads


def test_a_chunked_loss_through_a_group_that_the_forward_skipped_trains_as_torchs():
    ours, theirs = _run_both(_chunked_loss)
    assert ours[0] == theirs[0]
    assert all(_same(a, b) for a, b in zip(ours[1], theirs[1]))


# ---------------------------------------------------------------------------------------------- mixed precision
class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(6, 5)

    def forward(self, x):
        return self.a(x).float() + self.b(x).float()  # both modules see the fp32 input


def _cast_in_a_group(impl):
    shard = _fully_shard(impl)
    policy_class = fsdp1.MixedPrecisionPolicy if impl == "fsdp1" else torch.distributed.fsdp.MixedPrecisionPolicy
    torch.manual_seed(0)
    model = _TwoHeads()
    shard([model.a, model.b], mp_policy=policy_class(param_dtype=torch.bfloat16, cast_forward_inputs=True))
    shard(model)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = model(x)
    out.sum().backward()
    return out.detach(), _full_grads(model)


def test_cast_forward_inputs_casts_the_input_of_every_module_of_a_group_as_torchs():
    ours, theirs = _run_both(_cast_in_a_group)
    assert torch.equal(ours[0], theirs[0])
    assert _same(ours[1], theirs[1])


# ---------------------------------------------------------------------------------------------- gathering
def _late_wait(impl):
    shard = _fully_shard(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    _shard_gpt(shard, model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = model.blocks[0].unshard(async_op=True)
    F.cross_entropy(model(batch(0, rank, world_size)[0]).reshape(-1, VOCAB), batch(0, rank, world_size)[1].reshape(-1)).backward()
    optim.step()
    handle.wait()  # its gather was used by the forward and freed since
    loss = F.cross_entropy(model(batch(1, rank, world_size)[0]).reshape(-1, VOCAB), batch(1, rank, world_size)[1].reshape(-1))
    return loss.item(), [type(p).__name__ for p in model.blocks[0].parameters()]


def test_a_wait_on_an_unshard_handle_whose_gather_was_used_since_does_nothing_as_torchs():
    ours, theirs = _run_both(_late_wait)
    assert ours == theirs


# ---------------------------------------------------------------------------------------------- gradients
def _optimizer_in_backward(impl):
    """torchtune's optimizer-in-backward: an optimizer per parameter, stepped by the parameter's
    post-accumulate-grad hook, which then drops the gradient."""
    shard = _fully_shard(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    _shard_gpt(shard, model)
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
    return losses, len(calls), sorted(calls), [p.detach().full_tensor() for p in model.parameters()], _full_grads(model)


def test_post_accumulate_grad_hooks_on_the_sharded_parameters_run_once_a_backward_as_torchs():
    ours, theirs = _run_both(_optimizer_in_backward)
    assert ours[1] == theirs[1] == 3 * 28  # every parameter's hook once a backward
    assert ours[0] == theirs[0]
    assert ours[2] == theirs[2]
    assert _same(ours[3], theirs[3])
    assert _same(ours[4], theirs[4])  # all None: the hooks dropped them


def _unused_module_of_a_group(impl):
    shard = _fully_shard(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _trunk()
    _shard_gpt(shard, model, head_group=True)
    for step_index in range(2):  # the head never runs
        model(batch(step_index, rank, world_size)[0]).sum().backward()
    return _full_grads(model)


def test_a_module_of_a_group_that_never_ran_has_no_gradient_as_torchs():
    ours, theirs = _run_both(_unused_module_of_a_group)
    assert ours[-2:] == [None, None]  # the head's
    assert _same(ours, theirs)


def _accumulate_in_reduce_dtype(impl):
    shard = _fully_shard(impl)
    policy_class = fsdp1.MixedPrecisionPolicy if impl == "fsdp1" else torch.distributed.fsdp.MixedPrecisionPolicy
    policy = policy_class(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        shard(block, mp_policy=policy)
    shard(model, mp_policy=policy)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(2):
        for micro in range(4):
            model.set_requires_gradient_sync(micro == 3)
            inputs, targets = batch(4 * step + micro, rank, world_size)
            F.cross_entropy(model(inputs).float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
        grads.append(_full_grads(model))
        optim.step()
        optim.zero_grad()
    return grads


def test_bf16_compute_with_fp32_reduction_accumulates_unreduced_gradients_in_fp32_as_torchs():
    ours, theirs = _run_both(_accumulate_in_reduce_dtype)
    assert all(g.dtype == torch.float32 for g in ours[0])
    assert _same(ours[0], theirs[0])
    assert _same(ours[1], theirs[1])


def _converted_with_swapped_params(impl):
    shard = _fully_shard(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    _shard_gpt(shard, model)
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    inputs, targets = batch(0, rank, world_size)
    loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    return loss.item(), [p.dtype for p in model.parameters()], _full_grads(model)


def test_a_conversion_with_swapped_module_parameters_keeps_gradients_as_torchs():
    ours, theirs = _run_both(_converted_with_swapped_params)
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1] == [torch.float64] * 28
    assert _same(ours[2], theirs[2])


# ---------------------------------------------------------------------------------------------- checks
def _refusal(impl, build):
    """The exception a build and its first training step raise, as (type name, message)."""
    try:
        model = build(_fully_shard(impl))
        model(torch.randn(3, 4)).sum().backward()
    except Exception as error:  # noqa: BLE001 - compared with torch's
        return type(error).__name__, str(error)
    return "no error", ""


class _TiedEnds(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _tied_across_sibling_groups(impl, order):
    def build(shard):
        model = _TiedEnds()
        for name in order:
            shard(getattr(model, name))
        return shard(model)

    return _refusal(impl, build)


@pytest.mark.parametrize("order", [("first", "second"), ("second", "first")])
def test_a_weight_tied_across_two_sibling_groups_is_refused_as_torchs(order):
    ours, theirs = _run_both(_tied_across_sibling_groups, order)
    assert ours[0] == theirs[0] == "ValueError"
    phrase = "is shared with a parameter already managed by another FSDP group"
    assert phrase in ours[1]
    assert phrase in theirs[1]


def _refused_at_construction(impl, case):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    def build(shard):
        torch.manual_seed(0)
        if case == "channels_last":
            conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
            return shard(conv)
        if case == "unnamed_2d_mesh":
            return shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, dist.get_world_size())))
        if case == "uneven_dim_1":
            return shard(nn.Linear(3, 4), shard_placement_fn=lambda p: Shard(1))
        assert case == "dim_1_of_1d"
        return shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(p.dim() - 1) if p.dim() == 2 else Shard(1))

    try:
        build(_fully_shard(impl))
    except Exception as error:  # noqa: BLE001 - compared with torch's
        return type(error).__name__, str(error)
    return "no error", ""


@pytest.mark.parametrize("case, phrase", [
    ("channels_last", "FSDP does not support non-contiguous parameters"),
    ("unnamed_2d_mesh", "Please init the 2D mesh for HSDP with mesh_dim_names specified"),
    ("uneven_dim_1", "FSDP does not support uneven sharding on dim 1"),
    ("dim_1_of_1d", "Shard dim 1 is invalid for 1D tensor"),
])
def test_what_torch_refuses_at_construction_is_refused_with_its_type_and_phrase(case, phrase):
    ours, theirs = _run_both(_refused_at_construction, case)
    assert ours[0] == theirs[0]
    assert phrase in ours[1]
    assert phrase in theirs[1]


def _hook_stream_on_hsdp(impl):
    from torch.distributed.device_mesh import init_device_mesh

    model = _fully_shard(impl)(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    try:
        model.set_all_reduce_hook(lambda reduced: None, stream=object())
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_stream_for_the_all_reduce_hook_is_refused_on_hsdp_as_torchs():
    ours, theirs = _run_both(_hook_stream_on_hsdp)
    assert ours == theirs == "stream cannot be set when using native HSDP"


# ---------------------------------------------------------------------------------------------- meta device
def _replaced_after_sharding_on_meta(impl, how):
    """Transformers' FSDP2 loading: shard the model on the meta device, then register real
    parameters in place of the sharded ones (this rank's rows as DTensors, or plain full tensors)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    shard = _fully_shard(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TinyGPT()
    with torch.device("meta"):
        model = TinyGPT()
    _shard_gpt(shard, model)
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
    ours, theirs = _run_both(_replaced_after_sharding_on_meta, "dtensor")
    assert ours[0] == theirs[0]
    assert _same(ours[1], theirs[1])
    plain = run_on_ranks(2, _replaced_after_sharding_on_meta, "fsdp1", "plain")[0]  # torch's needs DTensors
    assert plain[0] == ours[0]
    assert _same(plain[1], ours[1])


def test_a_forward_with_parameters_still_on_meta_names_them_as_torchs():
    ours, theirs = _run_both(_replaced_after_sharding_on_meta, "some_left_on_meta")
    assert ours[0] == theirs[0] == "RuntimeError"
    assert ours[1] == theirs[1]
    assert "still on meta device: ['head.bias']" in ours[1]  # the root's group is checked first


# ---------------------------------------------------------------------------------------------- communication
def _collectives_of_a_step(impl):
    from torch.distributed.tensor.debug import CommDebugMode

    shard = _fully_shard(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    _shard_gpt(shard, model)
    inputs, targets = batch(0, rank, world_size)
    model(inputs).sum().backward()  # the first iteration (fsdp1 compares the ranks' unit orders once)
    with CommDebugMode() as mode:
        F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1)).backward()
    return {str(op).split(".")[-1]: count for op, count in mode.get_comm_counts().items()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_step_issues_torchs_collectives_and_none_on_one_rank(world_size):
    ours, theirs = _run_both(_collectives_of_a_step, world_size=world_size)
    if world_size == 2:  # two gloo ranks exchange each all-gather's and reduce-scatter's chunk in one all-to-all
        assert ours == {"alltoall_base_": sum(theirs.values())}
        assert theirs == {"_allgather_base_": 5, "_reduce_scatter_base_": 3}
    else:
        assert ours == theirs == ({} if world_size == 1 else {"_allgather_base_": 5, "_reduce_scatter_base_": 3})


def _divide_factor_of_the_root(impl):
    shard = _fully_shard(impl)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    shard(model[1])
    shard(model)
    model.set_gradient_divide_factor(4.0)
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):  # gloo has no PREMUL_SUM: torch's then sums
            module.set_force_sum_reduction_for_comms(True)
    model(torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
    return _full_grads(model)


def test_set_gradient_divide_factor_acts_on_the_modules_own_group_only_as_torchs():
    ours, theirs = _run_both(_divide_factor_of_the_root)
    assert _same(ours, theirs)


def _kept_gathered_registration(impl):
    shard = _fully_shard(impl)
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
    return kinds, [p.requires_grad for p in model.parameters()], _full_grads(model)


def test_a_module_kept_gathered_after_forward_holds_leaf_parameters_as_torchs():
    ours, theirs = _run_both(_kept_gathered_registration)
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1]
    frozen_in_between = range(13, 24)  # blocks.1: torch's (and a plain model's) backward drops their gradients,
    # fsdp1's computes them: its forward read them through the flat parameter (a documented difference)
    assert all(ours[2][i] is not None for i in frozen_in_between)
    assert all(theirs[2][i] is None for i in frozen_in_between)
    assert _same([g for i, g in enumerate(ours[2]) if i not in frozen_in_between],
                 [g for i, g in enumerate(theirs[2]) if i not in frozen_in_between])


def _argument_checks(impl):
    from torch.distributed.tensor import Replicate

    shard = _fully_shard(impl)
    model = shard(nn.Linear(4, 4))
    twice = nn.Linear(4, 4)
    outcomes = {}
    calls = {
        "buffers_float": lambda: model.set_reduce_scatter_max_input_buffers(2.5),
        "buffers_bool": lambda: model.set_reduce_scatter_max_input_buffers(True),
        "buffers_zero": lambda: model.set_reduce_scatter_max_input_buffers(0),
        "prefetch_plain": lambda: model.set_modules_to_forward_prefetch([nn.Linear(2, 2)]),
        "twice": lambda: shard(model),
        "int_not_a_factor": lambda: shard(nn.Linear(4, 4), reshard_after_forward=3),
        "float": lambda: shard(nn.Linear(4, 4), reshard_after_forward=2.0),
        "listed_twice": lambda: shard([twice, twice]),
        "replicate_placement": lambda: shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate()),
    }
    for name, call in calls.items():
        try:
            call()
            outcomes[name] = ("no error", "")
        except Exception as error:  # noqa: BLE001 - compared with torch's
            outcomes[name] = (type(error).__name__, str(error))
    outcomes["listed_twice_class"] = (type(twice).__name__, "")  # a refused call changes nothing
    return outcomes


def test_bad_arguments_raise_torchs_exception_types_and_phrases():
    ours, theirs = _run_both(_argument_checks)
    for name, (kind, message) in theirs.items():
        assert ours[name][0] == kind, name
        phrase = message.split(": Linear")[0].split(" (")[0][:60]
        assert phrase in ours[name][1], name


def _loaded_piece_by_piece_while_iterating(impl):
    from torch.distributed.tensor import distribute_tensor

    shard = _fully_shard(impl)
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
    return out.detach(), _full_grads(model)


def test_parameters_loaded_one_by_one_with_assign_while_iterating_them_as_torchs():
    ours, theirs = _run_both(_loaded_piece_by_piece_while_iterating)
    assert torch.equal(ours[0], theirs[0])
    assert _same(ours[1], theirs[1])


def _mixed_dtypes(impl, frozen):
    shard = _fully_shard(impl)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    model[1].requires_grad_(not frozen)
    try:
        shard(model)
        model(torch.randn(2, 4)).float().sum().backward()  # bf16 input of the second: the first's output is fp32
    except Exception as error:  # noqa: BLE001 - compared with torch's
        return type(error).__name__, str(error)
    return "no error", [p.dtype for p in model.parameters()]


def test_parameters_of_several_dtypes_in_one_group_are_refused_not_cast():
    ours, theirs = _run_both(_mixed_dtypes, False)
    assert ours[0] == theirs[0] == "AssertionError"
    assert "FSDP expects uniform original parameter dtype" in ours[1]
    assert "FSDP expects uniform original parameter dtype" in theirs[1]
    frozen = run_on_ranks(2, _mixed_dtypes, "fsdp1", True)[0]  # torch's keeps them apart: a documented difference
    assert frozen[0] == "NotImplementedError"
    assert "'1.weight' torch.bfloat16" in frozen[1]


# ---------------------------------------------------------------------------------------------- storage
def _local_shards_saved_with_safetensors(impl, directory):
    import os

    from safetensors.torch import load_file, save_file

    shard = _fully_shard(impl)
    torch.manual_seed(0)
    model = TinyGPT()
    _shard_gpt(shard, model)
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


# ---------------------------------------------------------------------------------------------- composition
class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.out_proj(self.in_proj(x).relu())


def _with_replicate(impl, where):
    from torch.distributed._composable import replicate

    shard = _fully_shard(impl)
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
    ours, theirs = _run_both(_with_replicate, where)
    assert ours[0] == theirs[0]
    assert _same(ours[1], theirs[1])


def _group_member_left_on_meta(impl):
    from torch.distributed.tensor import Shard, distribute_tensor

    shard = _fully_shard(impl)
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
    ours, theirs = _run_both(_group_member_left_on_meta)
    assert ours == theirs
    assert ours.endswith("still on meta device: ['ln_f.bias']")


class _OptionalSecond(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.use_b = True

    def forward(self, x):
        h = self.a(x)
        return h + self.b(h) if self.use_b else h


def _module_unused_after_a_step(impl):
    shard = _fully_shard(impl)
    torch.manual_seed(0)
    model = _OptionalSecond()
    shard([model.a, model.b])
    shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for step in range(3):
        model.use_b = step == 0  # b runs in the first step only: AdamW must then skip it
        model(torch.randn(2, 4, generator=torch.Generator().manual_seed(step * 2 + dist.get_rank()))).sum().backward()
        grads.append(_full_grads(model))
        optim.step()
        optim.zero_grad(set_to_none=True)
    return grads, [p.detach().full_tensor() for p in model.parameters()]


def test_a_module_unused_after_a_step_has_no_gradient_and_adamw_skips_it_as_torchs():
    ours, theirs = _run_both(_module_unused_after_a_step)
    assert ours[0][1][2] is None  # b.weight in the second step
    assert all(_same(a, b) for a, b in zip(ours[0], theirs[0]))
    assert _same(ours[1], theirs[1])


def _replaced_on_meta_in_another_dtype(impl):
    from torch.distributed.tensor import Shard, distribute_tensor

    shard = _fully_shard(impl)
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
    return out.detach(), [p.dtype for p in model.parameters()], _full_grads(model)


def test_parameters_registered_on_meta_in_another_dtype_are_taken_in_theirs_as_torchs():
    ours, theirs = _run_both(_replaced_on_meta_in_another_dtype)
    assert ours[1] == theirs[1] == [torch.bfloat16] * 4
    assert torch.equal(ours[0], theirs[0])
    assert _same(ours[2], theirs[2])
