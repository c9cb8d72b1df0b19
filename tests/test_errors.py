"""Tests the exact text users see for bad input (pinned with expecttest): each error names the clean
parameter or module path, never ``_fsdp_wrapped_module.``, and says how to fix it. A failed
constructor leaves the module exactly as it was. Also pins the printed structure of a wrapped model.
An exception in forward (through the root or a nested unit) or in backward leaves training as if it
never happened, against DDP. ``fully_shard`` refuses bad input naming the module or parameter and
the fix, and what torch's ``fully_shard`` refuses (a weight tied across sibling groups, a non-contiguous
parameter, a 2-D mesh without names, invalid or uneven ``Shard(d)``, a stream for the all-reduce hook under
HSDP, bad arguments, parameters of several dtypes in a group) with torch's exception type and phrase. Against torch's FSDP1 running the same code: misuse (``summon_full_params``, ``apply``,
``ignored_modules``, state-dict configs, ``clip_grad_norm_``, auto-wrapping) raises torch's exception
types, fsdp1's messages keep torch's phrases, and ``_assert_state`` takes torch's training states."""

import copy
import functools
import re

import expecttest
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import (
    IMPLEMENTATIONS,
    LinearNet,
    fsdp1_full_params,
    fsdp_api,
    fully_shard_of,
    make_mlp,
    max_relative_error,
    mlp_input,
    outcome_of,
    plain_params,
    relative_errors,
    run_both,
    wrap_fsdp1,
)

FSDP = fsdp1.FullyShardedDataParallel
LinearPolicy = fsdp1.wrap.ModuleWrapPolicy({nn.Linear})


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class OnRank:
    """A constructor argument made on each rank from the model (a mesh, the model's own submodules)."""

    def __init__(self, make):
        self.make = make


def _same(a, b):
    """Equal values, or for meta tensors (which have none) equal shape and dtype."""
    return (a.shape, a.dtype) == (b.shape, b.dtype) if a.is_meta else torch.equal(a, b)


def _construction_error(make_model, kwargs):
    """The message of the constructor's exception, and whether the module was left untouched."""
    torch.manual_seed(0)  # every rank builds the same model, as FSDP requires
    model = make_model()
    kwargs = {name: value.make(model) if isinstance(value, OnRank) else value for name, value in kwargs.items()}
    repr_before = repr(model)
    state_before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    try:
        FSDP(model, **kwargs)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
        state_after = model.state_dict()
        untouched = (
            repr(model) == repr_before
            and list(state_after) == list(state_before)
            and all(_same(state_after[name], state_before[name]) for name in state_before)
        )
        return type(error).__name__, str(error), untouched
    return None, "no error", True


def _mixed_dtypes():
    model = Blocks()
    model.blocks[1].bias.data = model.blocks[1].bias.data.half()
    return model


def _integer_param():
    model = Blocks()
    model.head.register_parameter("index", nn.Parameter(torch.arange(3), requires_grad=False))
    return model


def _scalar_param():
    model = Blocks()
    model.blocks[0].register_parameter("scale", nn.Parameter(torch.tensor(2.0)))
    return model


def _mixed_requires_grad():
    model = Blocks()
    model.head.weight.requires_grad_(False)
    return model


def _half_frozen_stack():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])
    for layer in model[:4]:
        layer.requires_grad_(False)
    return model


def _already_wrapped():
    model = Blocks()
    model.blocks[1] = FSDP(model.blocks[1])
    return model


def _tied_weight_split_by_hand():
    model = Blocks()
    model.head = nn.Linear(4, 4)
    model.head.weight = model.blocks[0].weight
    model.head = FSDP(model.head)
    return model


def _meta_blocks_tied_across_units():
    with torch.device("meta"):
        model = Blocks()
        model.head = nn.Linear(4, 4)
    model.head.weight = model.blocks[0].weight
    return model


def _head_tied_to_a_wrapped_block():
    """The head, to be wrapped on its own after the block it shares its weight with was."""
    model = Blocks()
    model.head = nn.Linear(4, 4)
    model.head.weight = model.blocks[0].weight
    model.blocks[0] = FSDP(model.blocks[0])
    return model.head


def _wrapped_twice(use_orig_params):
    torch.manual_seed(0)  # every rank builds the same model, as FSDP requires
    module = Blocks()
    FSDP(module, use_orig_params=use_orig_params)
    try:
        FSDP(module, use_orig_params=use_orig_params)
    except ValueError as error:
        return str(error)
    return "no error"


def _make_mesh(shape, model):
    return init_device_mesh("cpu", shape)


def _mesh(*shape):
    return OnRank(functools.partial(_make_mesh, shape))


def _world_group(model):
    return dist.group.WORLD


def _world_pair(model):
    return (dist.group.WORLD, dist.group.WORLD)


def _head(model):
    return [model.head]


def _head_and_a_weight(model):
    return [model.head, model.blocks[0].weight]


def _the_unit(model):
    return [model.blocks[1]]


def _yes_for_linear(module):
    return "yes" if isinstance(module, nn.Linear) else False


def _no_sync_on_inner_unit(after_a_step=True):
    torch.manual_seed(0)  # every rank builds the same model, as FSDP requires
    model = FSDP(Blocks(), auto_wrap_policy=LinearPolicy)
    if after_a_step:
        model(torch.ones(1, 4)).sum().backward()
    try:
        with model.blocks[1].no_sync():
            pass
    except RuntimeError as error:
        return str(error)
    return "no error"


def _root_only_apis_on_an_inner_unit_before_any_forward():
    """Before the first forward no unit is a root yet; an inner unit must still not become one."""
    torch.manual_seed(0)  # every rank builds the same model, as FSDP requires
    model = FSDP(Blocks(), auto_wrap_policy=LinearPolicy)
    inner = model.blocks[1]
    messages = []
    for call, expected in [(lambda: inner.register_comm_hook(None, lambda state, grad, output: None), AssertionError),
                           (lambda: inner.clip_grad_norm_(1.0), RuntimeError)]:
        try:
            call()
            messages.append("no error")
        except expected as error:
            messages.append(str(error))
    loss = model(torch.ones(1, 4)).sum()  # the real root still trains, with its own reduction
    loss.backward()
    grads_reduced = all(p.grad is not None for p in model.parameters())
    return messages, grads_reduced


def _double_backward():
    torch.manual_seed(0)  # every rank builds the same model, as FSDP requires
    model = FSDP(Blocks(), auto_wrap_policy=LinearPolicy)
    loss = model(torch.ones(1, 4)).pow(2).sum()
    try:
        loss.backward(create_graph=True)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _wrapped_repr():
    torch.manual_seed(0)  # every rank builds the same model, as FSDP requires
    return repr(FSDP(Blocks(), auto_wrap_policy=LinearPolicy))


class TestErrors(expecttest.TestCase):
    def construction_error(self, make_model, **kwargs):
        results = run_on_ranks(2, _construction_error, make_model, kwargs)
        assert results[0] == results[1], "ranks disagree on the error"
        kind, message, untouched = results[0]
        assert untouched, "the failed constructor changed the module"
        assert "_fsdp_wrapped_module" not in message
        return f"{kind}: {message}"

    def test_mixed_dtypes_in_one_unit(self):
        self.assertExpectedInline(self.construction_error(_mixed_dtypes, auto_wrap_policy=LinearPolicy), """ValueError: fsdp1: unit 'blocks.1' must flatten parameters of one dtype, but 'blocks.1.weight' is torch.float32 and 'blocks.1.bias' is torch.float16. Cast the module to one dtype before wrapping (e.g. module.float()), or wrap the submodule of the other dtype as its own unit.""")

    def test_integer_parameter(self):
        self.assertExpectedInline(self.construction_error(_integer_param, auto_wrap_policy=LinearPolicy), """ValueError: fsdp1: parameter 'head.index' has dtype torch.int64; FSDP can only shard floating-point parameters, since integer tensors have no gradient. Register it as a buffer (module.register_buffer) instead.""")

    def test_scalar_parameter(self):
        self.assertExpectedInline(self.construction_error(_scalar_param), """ValueError: fsdp1: parameter 'blocks.0.scale' is a 0-dim (scalar) tensor, which FSDP cannot flatten. Make it a 1-D tensor, e.g. nn.Parameter(value.reshape(1)).""")

    def test_mixed_requires_grad_without_use_orig_params(self):
        self.assertExpectedInline(self.construction_error(_mixed_requires_grad, auto_wrap_policy=LinearPolicy), """ValueError: fsdp1: unit 'head' mixes trainable parameters ('head.bias') and frozen ones ('head.weight'), but with use_orig_params=False a unit's one FlatParameter has one requires_grad. Pass use_orig_params=True, or wrap the frozen submodules as units of their own.""")

    def test_mixed_requires_grad_lists_both_groups(self):
        self.assertExpectedInline(self.construction_error(_half_frozen_stack), """ValueError: fsdp1: the root unit mixes trainable parameters ('4.weight', '4.bias', '5.weight', '5.bias', '6.weight', '6.bias' and 2 more) and frozen ones ('0.weight', '0.bias', '1.weight', '1.bias', '2.weight', '2.bias' and 2 more), but with use_orig_params=False a unit's one FlatParameter has one requires_grad. Pass use_orig_params=True, or wrap the frozen submodules as units of their own.""")

    def test_auto_wrap_of_a_module_that_holds_a_unit(self):
        self.assertExpectedInline(self.construction_error(_already_wrapped, auto_wrap_policy=LinearPolicy), """ValueError: fsdp1: FSDP auto wrapping requires modules to not already have FSDP applied but found blocks.1 in Blocks: 'blocks.1' is already a FullyShardedDataParallel unit. Pass the unwrapped module with auto_wrap_policy, or wrap every unit by hand without it.""")

    def test_tied_weight_split_across_units_by_hand(self):
        """Auto-wrapping gives a tied weight to the units' common parent; wrapping by hand cannot."""
        self.assertExpectedInline(self.construction_error(_tied_weight_split_by_hand), """ValueError: fsdp1: parameter 'blocks.0.weight' is the same tensor as 'head.weight', which the unit 'head' already flattened; a parameter can belong to one unit only. Wrap the modules that share it in one unit, or pass auto_wrap_policy, which gives a tied parameter to the closest unit that holds all the modules using it.""")

    def test_policy_that_is_neither_callable_nor_a_policy(self):
        self.assertExpectedInline(self.construction_error(Blocks, auto_wrap_policy={nn.Linear}), """ValueError: fsdp1: auto_wrap_policy must be a policy object (ModuleWrapPolicy, CustomPolicy) or a callable (module, recurse, nonwrapped_numel) -> bool such as functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}), got set.""")

    def test_custom_policy_returning_neither_bool_nor_dict(self):
        policy = fsdp1.wrap.CustomPolicy(_yes_for_linear)
        self.assertExpectedInline(self.construction_error(Blocks, auto_wrap_policy=policy), """ValueError: fsdp1: CustomPolicy's lambda_fn returned 'yes' for module 'blocks.0'; it must return True, False or a dict of FullyShardedDataParallel keyword arguments for that unit.""")

    def test_process_group_together_with_device_mesh(self):
        self.assertExpectedInline(self.construction_error(Blocks, process_group=OnRank(_world_group), device_mesh=_mesh(2)), """ValueError: fsdp1: pass process_group or device_mesh, not both: each says which ranks this unit shards over. Keep device_mesh (it also names the replicate dimension for HYBRID_SHARD).""")

    def test_ignored_modules_together_with_ignored_states(self):
        self.assertExpectedInline(self.construction_error(Blocks, ignored_modules=OnRank(_head), ignored_states=OnRank(_head)), """ValueError: fsdp1: Cannot pass both ignored_modules and ignored_states at the same time; pass ignored_states, which takes modules and parameters alike (torch deprecates ignored_modules in its favour).""")

    def test_ignored_states_mixing_modules_and_parameters(self):
        self.assertExpectedInline(self.construction_error(Blocks, ignored_states=OnRank(_head_and_a_weight)), """ValueError: fsdp1: ignored_states expects all nn.Parameter or all nn.Module list elements but got types [<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.parameter.Parameter'>]: it holds both. Ignore the modules' parameters instead (ignored_states=[*m.parameters(), p]).""")

    def test_ignoring_an_fsdp_unit(self):
        self.assertExpectedInline(self.construction_error(_already_wrapped, ignored_modules=OnRank(_the_unit)), """ValueError: fsdp1: ignored_modules holds the FullyShardedDataParallel unit 'blocks.1'; a unit cannot be ignored. Pass the module it wraps before wrapping it, or leave it out.""")

    def test_hybrid_strategy_with_one_process_group(self):
        self.assertExpectedInline(self.construction_error(Blocks, sharding_strategy=fsdp1.ShardingStrategy.HYBRID_SHARD, process_group=OnRank(_world_group)), """ValueError: fsdp1: sharding_strategy=ShardingStrategy.HYBRID_SHARD shards inside one group of ranks and replicates across another, and needs both: pass device_mesh=init_device_mesh(device_type, (replicas, shard_size)) or process_group=(shard_group, replicate_group), or neither (one node of LOCAL_WORLD_SIZE ranks shards, nodes replicate).""")

    def test_hybrid_strategy_with_a_one_dimensional_mesh(self):
        self.assertExpectedInline(self.construction_error(Blocks, sharding_strategy=fsdp1.ShardingStrategy.HYBRID_SHARD, device_mesh=_mesh(2)), """ValueError: fsdp1: sharding_strategy=ShardingStrategy.HYBRID_SHARD needs a 2-D mesh (replicate, shard), but device_mesh is 1-D (shape (2,)). Build it with init_device_mesh(device_type, (replicas, shard_size)).""")

    def test_full_shard_with_a_two_dimensional_mesh(self):
        self.assertExpectedInline(self.construction_error(Blocks, device_mesh=_mesh(1, 2)), """ValueError: fsdp1: sharding_strategy=ShardingStrategy.FULL_SHARD needs a 1-D mesh, but device_mesh is 2-D (shape (1, 2)). Build it with init_device_mesh(device_type, (world_size,)).""")

    def test_group_pair_without_a_hybrid_strategy(self):
        self.assertExpectedInline(self.construction_error(Blocks, process_group=OnRank(_world_pair)), """ValueError: fsdp1: a tuple process_group means (shard_group, replicate_group) and is only for HYBRID_SHARD and _HYBRID_SHARD_ZERO2; got a tuple of 2 with sharding_strategy=ShardingStrategy.FULL_SHARD. Pass one ProcessGroup, or set the hybrid strategy.""")

    def test_wrapping_the_same_module_twice(self):
        self.assertExpectedInline(run_on_ranks(2, _wrapped_twice, False)[0], """fsdp1: the module is already wrapped by a FullyShardedDataParallel unit (it holds that unit's flat parameter '_flat_param'). Wrap each module object once; to nest units, wrap the existing FullyShardedDataParallel instance instead of its module.""")
        self.assertExpectedInline(run_on_ranks(2, _wrapped_twice, True)[0], """fsdp1: the module holds parameter 'blocks.0.weight', which another FullyShardedDataParallel unit already flattened: either this module is already wrapped (wrap each module object once; to nest units, wrap the existing FullyShardedDataParallel instance instead), or it shares the parameter with a module wrapped before (a tied weight: wrap the modules that share it in one unit, or wrap their parent with auto_wrap_policy, which gives the weight to it).""")

    def test_meta_weight_tied_across_units_that_no_reset_would_initialise(self):
        self.assertExpectedInline(self.construction_error(_meta_blocks_tied_across_units, auto_wrap_policy=LinearPolicy), """ValueError: fsdp1: parameter 'blocks.0.weight' is tied across units and on the meta device, and the root unit, which holds it, has no module of its own that uses it, so reset_parameters() would never initialise it. Pass param_init_fn=..., or build the model with real weights (on rank 0, with sync_module_states=True).""")

    def test_tied_modules_wrapped_one_after_the_other(self):
        self.assertExpectedInline(self.construction_error(_head_tied_to_a_wrapped_block), """ValueError: fsdp1: the module holds parameter 'weight', which another FullyShardedDataParallel unit already flattened: either this module is already wrapped (wrap each module object once; to nest units, wrap the existing FullyShardedDataParallel instance instead), or it shares the parameter with a module wrapped before (a tied weight: wrap the modules that share it in one unit, or wrap their parent with auto_wrap_policy, which gives the weight to it).""")

    def test_no_sync_on_inner_unit(self):
        messages = run_on_ranks(2, _no_sync_on_inner_unit)
        self.assertExpectedInline(messages[0], """fsdp1: no_sync() was called on the inner FSDP unit 'blocks.1'; it is only supported on the root unit. Call it on the model you run forward on: `with model.no_sync(): ...`.""")
        self.assertEqual(run_on_ranks(2, _no_sync_on_inner_unit, False), messages)  # also before any forward

    def test_root_only_apis_on_an_inner_unit_before_any_forward(self):
        for messages, grads_reduced in run_on_ranks(2, _root_only_apis_on_an_inner_unit_before_any_forward):
            self.assertExpectedInline(messages[0], """register_comm_hook can only be called on a root instance; 'blocks.1' is an inner unit. Call it on the model you run forward on.""")
            self.assertExpectedInline(messages[1], """fsdp1: clip_grad_norm_() should only be called on the root FSDP instance, but was called on the inner FSDP unit 'blocks.1'; call it on the model you run forward on, which sees every unit's gradients.""")
            self.assertTrue(grads_reduced)

    def test_gradients_of_gradients(self):
        messages = run_on_ranks(2, _double_backward)
        self.assertExpectedInline(messages[0], """fsdp1: unit 'head' received a gradient that itself requires grad (backward with create_graph=True); FSDP does not support gradients of gradients. Call backward() without create_graph.""")

    def test_printed_structure_of_a_wrapped_model(self):
        self.assertExpectedInline(run_on_ranks(2, _wrapped_repr)[0], """\
FullyShardedDataParallel(
  (_fsdp_wrapped_module): Blocks(
    (blocks): ModuleList(
      (0-1): 2 x FullyShardedDataParallel(
        (_fsdp_wrapped_module): Linear(in_features=4, out_features=4, bias=True)
      )
    )
    (head): FullyShardedDataParallel(
      (_fsdp_wrapped_module): Linear(in_features=4, out_features=2, bias=True)
    )
  )
)""")


# ---------------------------------------------------------------------------------------------- exception mid-step
class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("deliberate failure in backward")


class _MaybeFails(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = make_mlp()
        self.fail_in_backward = False

    def forward(self, x):
        x = self.net[0](x)
        if self.fail_in_backward:
            x = _FailInBackward.apply(x)
        return self.net[2](self.net[1](x))


def _exception_mid_step(strategy, use_orig_params, where):
    base = _MaybeFails()
    ours = wrap_fsdp1(copy.deepcopy(base), strategy, use_orig_params, wrap_classes=[nn.Linear])
    ddp = DDP(copy.deepcopy(base))
    losses, errors = [], []
    for model in (ours, ddp):
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses.append([])
        for step in range(4):
            if step == 1 and where == "backward" and model is ours:  # DDP cannot go on after this one
                model.module.fail_in_backward = True
                try:
                    model(mlp_input(9)).sum().backward()
                except ValueError as error:
                    errors.append(type(error).__name__)
                model.module.fail_in_backward = False
            loss = model(mlp_input(step)).square().mean()
            loss.backward()
            if step == 1 and where in ("forward", "nested unit"):
                # A float64 input fails inside the first unit, reached through the root or directly.
                called = model if where == "forward" else model.module.net[0]
                try:
                    called(mlp_input(9, dtype=torch.float64))
                except RuntimeError as error:
                    errors.append(type(error).__name__)
            optim.step()
            optim.zero_grad()
            losses[-1].append(loss.item())
    return errors, losses, max_relative_error(fsdp1_full_params(ours), plain_params(ddp))


@pytest.mark.parametrize("where", ["forward", "nested unit", "backward"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_training_goes_on_after_an_exception_as_if_it_never_happened(strategy, use_orig_params, where):
    for errors, (ours, ddp), error in run_on_ranks(2, _exception_mid_step, strategy, use_orig_params, where):
        assert errors == (["ValueError"] if where == "backward" else ["RuntimeError", "RuntimeError"])
        assert relative_errors(ours, ddp) <= 1e-5
        assert error <= 1e-5


def _backward_prefetch_set_to_a_string():
    model = fsdp1.FullyShardedDataParallel(nn.Linear(2, 2), backward_prefetch=fsdp1.BackwardPrefetch.BACKWARD_POST)
    try:
        model.backward_prefetch = "BACKWARD_PRE"
        message = "no error"
    except ValueError as error:
        message = str(error)
    return message, model.backward_prefetch


def test_backward_prefetch_set_to_something_else_than_its_enum_is_refused_and_kept():
    for message, kept in run_on_ranks(2, _backward_prefetch_set_to_a_string):
        assert "backward_prefetch='BACKWARD_PRE' is not one of BackwardPrefetch.BACKWARD_PRE" in message
        assert kept is fsdp1.BackwardPrefetch.BACKWARD_POST  # unchanged: the schedule still prefetches after


# ------------------------------------------------------------------- fully_shard: bad input
def _fully_shard_errors():
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
    refused("mesh_not_a_mesh", lambda: fsdp1.fully_shard(nn.Linear(2, 2), mesh="cpu"))
    twice = fsdp1.fully_shard(nn.Linear(2, 2))
    refused("twice", lambda: fsdp1.fully_shard(twice), AssertionError)
    refused("fsdp1_inside", lambda: fsdp1.fully_shard(nn.Sequential(fsdp1.FullyShardedDataParallel(nn.Linear(2, 2)))))
    refused("fully_shard_inside", lambda: fsdp1.FullyShardedDataParallel(nn.Sequential(fsdp1.fully_shard(nn.Linear(2, 2)))))
    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    fsdp1.fully_shard(tied[0])
    refused("tied_across_groups", lambda: fsdp1.fully_shard(tied))
    return messages


def test_bad_input_is_refused_naming_the_module_or_parameter_and_the_fix():
    messages = run_on_ranks(2, _fully_shard_errors)[0]
    assert messages["module_list"].startswith("fully_shard does not support containers that do not implement forward")
    assert "Change scale to a 1D tensor" in messages["scalar"]
    assert "reshard_after_forward=3 must be a positive divisor of the shard world size 2" in messages["int_not_dividing"]
    assert "fully_shard(mesh=...) takes a DeviceMesh, got str" in messages["mesh_not_a_mesh"]
    assert "fully_shard was already applied to it" in messages["twice"]
    assert "contains the FullyShardedDataParallel unit '0'" in messages["fsdp1_inside"]
    assert "contains the fully_shard module '0'" in messages["fully_shard_inside"]
    assert "Parameter '1.weight' is shared with a parameter already managed by another FSDP group ('0.weight')" in messages["tied_across_groups"]


# ------------------------------------------------------------------- fully_shard: what torch's refuses, with its types and phrases
def _refusal(impl, build):
    """The exception a build and its first training step raise, as (type name, message)."""
    try:
        model = build(fully_shard_of(impl))
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
    ours, theirs = run_both(_tied_across_sibling_groups, order)
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
        build(fully_shard_of(impl))
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
    ours, theirs = run_both(_refused_at_construction, case)
    assert ours[0] == theirs[0]
    assert phrase in ours[1]
    assert phrase in theirs[1]


def _hook_stream_on_hsdp(impl):
    from torch.distributed.device_mesh import init_device_mesh

    model = fully_shard_of(impl)(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    try:
        model.set_all_reduce_hook(lambda reduced: None, stream=object())
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_stream_for_the_all_reduce_hook_is_refused_on_hsdp_as_torchs():
    ours, theirs = run_both(_hook_stream_on_hsdp)
    assert ours == theirs == "stream cannot be set when using native HSDP"


def _argument_checks(impl):
    from torch.distributed.tensor import Replicate

    shard = fully_shard_of(impl)
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
    ours, theirs = run_both(_argument_checks)
    for name, (kind, message) in theirs.items():
        assert ours[name][0] == kind, name
        phrase = message.split(": Linear")[0].split(" (")[0][:60]
        assert phrase in ours[name][1], name


def _mixed_dtypes_of_a_group(impl, frozen):
    shard = fully_shard_of(impl)
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
    ours, theirs = run_both(_mixed_dtypes_of_a_group, False)
    assert ours[0] == theirs[0] == "AssertionError"
    assert "FSDP expects uniform original parameter dtype" in ours[1]
    assert "FSDP expects uniform original parameter dtype" in theirs[1]
    frozen = run_on_ranks(2, _mixed_dtypes_of_a_group, "fsdp1", True)[0]  # torch's keeps them apart: a documented difference
    assert frozen[0] == "NotImplementedError"
    assert "'1.weight' torch.bfloat16" in frozen[1]



# ------------------------------------------------------------------- exception types of misuse, as torch's FSDP1's
class SummonsInside(nn.Module):
    """Calls ``summon_full_params`` on its own root from its forward, or from a gradient hook in
    backward (on an intermediate tensor, so that the root's backward has begun)."""

    def __init__(self, where):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.where = where
        self.root = []

    def summon(self, grad=None):
        with type(self.root[0]).summon_full_params(self.root[0]):
            return grad

    def forward(self, x):
        if self.where == "forward":
            self.summon()
        hidden = self.l1(x)
        if self.where == "backward":
            hidden.register_hook(self.summon)
        return self.l2(hidden)


def _with_units_inside(wrap):
    """A root whose inner unit has run one step (so it is no root), and a plain model holding a unit."""
    with_inner = LinearNet()
    with_inner.a = wrap(with_inner.a)
    nested = wrap(with_inner)
    nested(torch.ones(2, 4)).sum().backward()
    already_wrapped = LinearNet()
    already_wrapped.a = wrap(already_wrapped.a)
    return nested, already_wrapped


def _misuse_outcomes():
    outcomes = {}
    for name in IMPLEMENTATIONS:
        api, kwargs = fsdp_api(name)
        fsdp = api.FullyShardedDataParallel

        def build(module=None, **extra):
            torch.manual_seed(0)
            return fsdp(LinearNet() if module is None else module, **kwargs, **extra)

        def inside_summon(model, body, **summon_kwargs):
            with fsdp.summon_full_params(model, **summon_kwargs):
                body()

        model = build()
        no_shard = build(sharding_strategy=api.ShardingStrategy.NO_SHARD)
        nested, already_wrapped = _with_units_inside(build)
        cases = {
            "apply inside summon_full_params": lambda: inside_summon(model, lambda: model.apply(lambda m: None)),
            "ignored_modules holding an int": lambda: build(ignored_modules=[3]),
            "ignored_modules holding a parameter": lambda: build(ignored_modules=[nn.Parameter(torch.ones(2))]),
            "ignored_states holding a string": lambda: build(ignored_states=["a"]),
            "ignored_modules not iterable": lambda: build(ignored_modules=5),
            "rank0_only with writeback": lambda: inside_summon(model, lambda: None, rank0_only=True, writeback=True),
            "rank0_only with writeback, NO_SHARD": lambda: inside_summon(no_shard, lambda: None, rank0_only=True, writeback=True),
            "summon inside summon": lambda: inside_summon(model, lambda: inside_summon(model, lambda: None)),
            "forward inside summon": lambda: inside_summon(model, lambda: model(torch.ones(2, 4))),
            "state_dict_type with another config": lambda: fsdp.set_state_dict_type(
                model, api.StateDictType.SHARDED_STATE_DICT, api.FullStateDictConfig()),
            "param_init_fn not callable on meta": lambda: build(_meta_net(), param_init_fn=3),
            "clip_grad_norm_ on an inner unit": lambda: nested.module.a.clip_grad_norm_(1.0),
            "auto-wrapping a module holding a unit": lambda: build(
                already_wrapped, auto_wrap_policy=api.wrap.ModuleWrapPolicy({nn.Linear})),
        }
        for where in ("forward", "backward"):
            module = SummonsInside(where)
            root = build(module)
            module.root.append(root)
            cases[f"summon_full_params in {where}"] = functools.partial(lambda r: r(torch.ones(2, 4)).sum().backward(), root)
        outcomes[name] = {case: outcome_of(call) for case, call in cases.items()}
    return outcomes


def _meta_net():
    with torch.device("meta"):
        return LinearNet()


def test_misuse_raises_torchs_exception_types():
    for outcomes in run_on_ranks(2, _misuse_outcomes):
        for case, theirs in outcomes["torch"].items():
            assert outcomes["fsdp1"][case][0] == theirs[0], case
            assert theirs[0] is not None, case


def _messages_keep_torchs_phrases():
    """fsdp1's own messages, which name the unit and the fix, also carry the phrase torch's carry."""
    torch.manual_seed(0)
    fsdp = fsdp1.FullyShardedDataParallel
    model, already_wrapped = _with_units_inside(fsdp)
    plain = LinearNet()
    calls = [
        lambda: fsdp.set_state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT, fsdp1.FullStateDictConfig()),
        lambda: model.module.a.clip_grad_norm_(1.0),
        lambda: fsdp(already_wrapped, auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({nn.Linear})),
        lambda: fsdp(LinearNet(), ignored_modules=list(LinearNet().a.parameters())),
        lambda: fsdp(LinearNet(), ignored_states=[plain.b, plain.b.weight]),
        lambda: fsdp(LinearNet(), ignored_modules=[plain.b], ignored_states=[plain.b]),
    ]
    messages = []
    for call in calls:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - the message is the result
            messages.append(str(error))
    return messages


def test_messages_keep_torchs_phrases():
    """The phrases, as the regular expressions torch's own tests match them with."""
    patterns = [
        "Expected state_dict_config of type", "should only be called on the root FSDP instance",
        "FSDP auto wrapping requires modules to not already have FSDP applied but found .* in",
        r"ignored_modules expects nn.Module list elements but got types \[<class 'torch.nn.parameter.Parameter'>\]",
        r"ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
        r"\[<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.parameter.Parameter'>\]",
        "Cannot pass both ignored_modules and ignored_states at the same time",
    ]
    for messages in run_on_ranks(2, _messages_keep_torchs_phrases):
        assert len(messages) == len(patterns)
        for message, pattern in zip(messages, patterns):
            assert message.startswith("fsdp1: ")
            assert re.search(pattern, message)
            assert "_fsdp_wrapped_module" not in message


# ------------------------------------------------------------------- _assert_state
def _assert_state_outcomes():
    from torch.distributed.fsdp._common_utils import TrainingState as TorchState

    from fsdp1._engine.common import TrainingState as OurState

    results = {}
    for name in IMPLEMENTATIONS:
        api, kwargs = fsdp_api(name)
        torch.manual_seed(0)
        model = api.FullyShardedDataParallel(LinearNet(), **kwargs)
        model(torch.ones(2, 4)).sum().backward()
        outcomes = [outcome_of(lambda: model._assert_state(TorchState.IDLE)),
                    outcome_of(lambda: model._assert_state([TorchState.FORWARD_BACKWARD, TorchState.SUMMON_FULL_PARAMS])),
                    outcome_of(lambda: model._assert_state(TorchState.FORWARD_BACKWARD))]
        if name == "fsdp1":
            outcomes.append(outcome_of(lambda: model._assert_state(OurState.IDLE)))
        with api.FullyShardedDataParallel.summon_full_params(model):
            outcomes += [outcome_of(lambda: model._assert_state(TorchState.SUMMON_FULL_PARAMS)),
                         outcome_of(lambda: model._assert_state(TorchState.IDLE))]
        results[name] = outcomes
    return results


def test_assert_state_takes_torchs_training_states_and_raises_its_type():
    for results in run_on_ranks(2, _assert_state_outcomes):
        ok, failed = (None, []), ("ValueError", [])
        assert results["torch"] == [ok, failed, failed, ok, failed]
        assert results["fsdp1"] == [ok, failed, failed, ok, ok, failed]
