"""Tests the exact text users see for bad input (pinned with expecttest): each error names the clean
parameter or module path, never ``_fsdp_wrapped_module.``, and says how to fix it. A failed
constructor leaves the module exactly as it was. Also pins the printed structure of a wrapped model."""

import expecttest
import torch
from torch import nn

import fsdp1
from _harness import run_on_ranks

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


def _construction_error(make_model, kwargs):
    """The message of the constructor's exception, and whether the module was left untouched."""
    model = make_model()
    repr_before = repr(model)
    state_before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    try:
        FSDP(model, **kwargs)
    except (ValueError, RuntimeError, NotImplementedError) as error:
        state_after = model.state_dict()
        untouched = (
            repr(model) == repr_before
            and list(state_after) == list(state_before)
            and all(torch.equal(state_after[name], state_before[name]) for name in state_before)
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


def _shared_across_units():
    model = Blocks()
    model.head = nn.Linear(4, 4)
    model.head.weight = model.blocks[0].weight
    return model


def _wrapped_twice(use_orig_params):
    module = Blocks()
    FSDP(module, use_orig_params=use_orig_params)
    try:
        FSDP(module, use_orig_params=use_orig_params)
    except ValueError as error:
        return str(error)
    return "no error"


def _yes_for_linear(module):
    return "yes" if isinstance(module, nn.Linear) else False


def _no_sync_on_inner_unit():
    model = FSDP(Blocks(), auto_wrap_policy=LinearPolicy)
    model(torch.ones(1, 4)).sum().backward()
    try:
        with model.blocks[1].no_sync():
            pass
    except RuntimeError as error:
        return str(error)
    return "no error"


def _double_backward():
    model = FSDP(Blocks(), auto_wrap_policy=LinearPolicy)
    loss = model(torch.ones(1, 4)).pow(2).sum()
    try:
        loss.backward(create_graph=True)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _wrapped_repr():
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
        self.assertExpectedInline(self.construction_error(_already_wrapped, auto_wrap_policy=LinearPolicy), """ValueError: fsdp1: auto_wrap_policy needs a module without FSDP units inside, but 'blocks.1' is already a FullyShardedDataParallel unit. Pass the unwrapped module with auto_wrap_policy, or wrap every unit by hand without it.""")

    def test_parameter_shared_across_units(self):
        self.assertExpectedInline(self.construction_error(_shared_across_units, auto_wrap_policy=LinearPolicy), """ValueError: fsdp1: parameter 'head.weight' is shared between unit 'head' and unit 'blocks.0'; a parameter can belong to one unit only. Wrap the modules that share it in one unit (e.g. leave the tied embedding and output layer to their common parent).""")

    def test_policy_that_is_neither_callable_nor_a_policy(self):
        self.assertExpectedInline(self.construction_error(Blocks, auto_wrap_policy={nn.Linear}), """ValueError: fsdp1: auto_wrap_policy must be a policy object (ModuleWrapPolicy, CustomPolicy) or a callable (module, recurse, nonwrapped_numel) -> bool such as functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}), got set.""")

    def test_custom_policy_returning_neither_bool_nor_dict(self):
        policy = fsdp1.wrap.CustomPolicy(_yes_for_linear)
        self.assertExpectedInline(self.construction_error(Blocks, auto_wrap_policy=policy), """ValueError: fsdp1: CustomPolicy's lambda_fn returned 'yes' for module 'blocks.0'; it must return True, False or a dict of FullyShardedDataParallel keyword arguments for that unit.""")

    def test_wrapping_the_same_module_twice(self):
        for use_orig_params in (False, True):
            message = run_on_ranks(2, _wrapped_twice, use_orig_params)[0]
            self.assertEqual(message.split("(its")[0], "fsdp1: the module is already wrapped by another FullyShardedDataParallel instance ")
        self.assertExpectedInline(message, """fsdp1: the module is already wrapped by another FullyShardedDataParallel instance (its parameter 'blocks.0.weight' was flattened by it). Wrap each module object once; to nest units, wrap the existing FullyShardedDataParallel instance instead of its module.""")

    def test_no_sync_on_inner_unit(self):
        messages = run_on_ranks(2, _no_sync_on_inner_unit)
        self.assertExpectedInline(messages[0], """fsdp1: no_sync() was called on the inner FSDP unit 'blocks.1'; it is only supported on the root unit. Call it on the model you run forward on: `with model.no_sync(): ...`.""")

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
