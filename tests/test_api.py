"""Tests the drop-in surface: fsdp1 offers torch's public FSDP names, FSDP1's constructor signature and
config fields, accepts torch's own enum members, and never imports torch.distributed.fsdp. For
``fully_shard`` (torch's FSDP2 API): the exported names, and the signatures of ``fully_shard``, the
policies and the 26 public methods of ``FSDPModule`` (torch 2.15's, on every release), as torch's."""

import dataclasses
import inspect
import subprocess
import sys
from enum import Enum

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.fsdp import wrap as torch_wrap

import fsdp1
from fsdp1._torch_version import release
from fsdp1.api import coerce_enum


def test_every_name_of_torch_is_exported():
    newer = [] if release(torch.__version__) >= (2, 15) else ["GradientReductionHandle"]  # torch 2.15's, on every release
    assert sorted(fsdp1.__all__) == sorted(torch_fsdp.__all__ + newer)  # FSDP1's and FSDP2's
    assert hasattr(fsdp1, "FlatParameter")
    assert hasattr(fsdp1, "use_as_torch_fsdp")


def test_the_modules_at_torchs_paths_offer_torchs_public_names():
    """An import from torch's module path ports by swapping the prefix: every public class of
    torch's ``fully_sharded_data_parallel`` module that fsdp1 offers at the top imports from fsdp1's
    module of that path too, and the comm hooks keep their names and their home there."""
    import torch.distributed.fsdp.fully_sharded_data_parallel as torch_module

    import fsdp1.comm_hooks
    import fsdp1.fully_sharded_data_parallel as our_module

    offered = {name for name, value in vars(torch_module).items()
               if inspect.isclass(value) and not name.startswith("_") and hasattr(fsdp1, name)}
    assert len(offered) >= 16
    assert sorted(name for name in offered if not hasattr(our_module, name)) == []
    assert fsdp1.comm_hooks.DefaultState.__module__ == "fsdp1.comm_hooks"
    assert callable(fsdp1.comm_hooks.is_low_precision_hook)


def test_the_classes_source_is_found_as_torchs_is():
    """IPython's ``??`` and Sphinx read a class's source through its ``__module__``."""
    for cls in (fsdp1.FullyShardedDataParallel, fsdp1.OptimStateKeyType, fsdp1.FSDPModule):
        assert f"class {cls.__name__}" in inspect.getsource(cls)


def _normalised_default(value):
    return value.name if isinstance(value, Enum) else value


def test_constructor_keeps_torch_names_order_and_defaults():
    """torch's parameters, in torch's order with torch's defaults; the extra ones keyword-only: fsdp1's
    own ``comm_quantization``, and a private one (the parameters auto-wrapping tells a nested unit to
    leave to an outer one)."""
    ours = inspect.signature(fsdp1.FullyShardedDataParallel.__init__).parameters
    theirs = inspect.signature(torch_fsdp.FullyShardedDataParallel.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    extra = [ours[name] for name in list(ours)[len(theirs):]]
    assert [(p.name, p.kind, p.default) for p in extra] == [("comm_quantization", inspect.Parameter.KEYWORD_ONLY, None),
                                                           ("_params_of_outer_units", inspect.Parameter.KEYWORD_ONLY, None)]
    for name in theirs:
        assert _normalised_default(ours[name].default) == _normalised_default(theirs[name].default), name


@pytest.mark.parametrize("name", ["ShardingStrategy", "BackwardPrefetch", "StateDictType", "OptimStateKeyType"])
def test_enums_have_torch_members_and_values(name):
    ours, theirs = getattr(fsdp1, name), getattr(torch_fsdp, name)
    assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]


@pytest.mark.parametrize(
    "name",
    [
        "MixedPrecision", "CPUOffload", "StateDictConfig", "FullStateDictConfig", "LocalStateDictConfig",
        "ShardedStateDictConfig", "OptimStateDictConfig", "FullOptimStateDictConfig",
        "LocalOptimStateDictConfig", "ShardedOptimStateDictConfig", "StateDictSettings",
    ],
)
def test_config_dataclasses_have_torch_fields_and_defaults(name):
    def fields(cls):
        return [(f.name, f.default) for f in dataclasses.fields(cls)]

    assert fields(getattr(fsdp1, name)) == fields(getattr(torch_fsdp, name))


def test_torch_enum_members_are_accepted_wherever_ours_are():
    assert coerce_enum(torch_fsdp.ShardingStrategy.SHARD_GRAD_OP, fsdp1.ShardingStrategy, "s") is fsdp1.ShardingStrategy.SHARD_GRAD_OP
    assert coerce_enum(fsdp1.BackwardPrefetch.BACKWARD_POST, fsdp1.BackwardPrefetch, "b") is fsdp1.BackwardPrefetch.BACKWARD_POST
    with pytest.raises(ValueError, match="sharding_strategy=.*is not one of ShardingStrategy.FULL_SHARD"):
        coerce_enum(torch_fsdp.BackwardPrefetch.BACKWARD_PRE, fsdp1.ShardingStrategy, "sharding_strategy")


def test_module_wrap_policy_matches_torch_in_both_call_forms():
    from torch import nn

    ours, theirs = fsdp1.wrap.ModuleWrapPolicy({nn.Linear}), torch_wrap.ModuleWrapPolicy({nn.Linear})
    for module in (nn.Linear(2, 2), nn.ReLU()):
        for recurse in (True, False):
            assert ours(module, recurse, 0) == theirs(module, recurse, 0)
    assert repr(ours).endswith("({<class 'torch.nn.modules.linear.Linear'>})")


def test_library_never_imports_torch_fsdp():
    code = "import sys, fsdp1; print(sorted(m for m in sys.modules if m.startswith('torch.distributed.fsdp')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


# ------------------------------------------------------------------- fully_shard (torch's FSDP2 API)
def test_the_names_signatures_and_methods_are_torchs():
    from torch.distributed import fsdp as torch_fsdp

    for name in ["fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy",
                 "CPUOffloadPolicy", "register_fsdp_forward_method"]:
        assert name in fsdp1.__all__
        assert hasattr(fsdp1, name)

    def parameters(fn):
        return [(p.name, p.kind, repr(p.default)) for p in inspect.signature(fn).parameters.values()]

    def methods(cls):
        return {n for n in dir(cls) if not n.startswith("_") and n not in dir(nn.Module)}

    # torch 2.15's additions, which fsdp1 offers on every release
    newer_fields = [("param_dtype_override_fn", inspect.Parameter.KEYWORD_ONLY, "None")]
    newer_methods = {"set_manual_backward_finalization", "finalize_backward", "set_keep_unsharded_storage"}
    has_newer = release(torch.__version__) >= (2, 15)
    ours = parameters(fsdp1.fully_shard)
    assert ours[-1] == ("comm_quantization", inspect.Parameter.KEYWORD_ONLY, "None")  # fsdp1's own, last
    ours = ours[:-1]
    if not has_newer:  # the default policy's repr shows the newer field
        ours = [(name, kind, default.replace(", param_dtype_override_fn=None", "")) for name, kind, default in ours]
    assert ours == parameters(torch_fsdp.fully_shard)
    assert parameters(fsdp1.MixedPrecisionPolicy) == parameters(torch_fsdp.MixedPrecisionPolicy) + ([] if has_newer else newer_fields)
    assert parameters(fsdp1.CPUOffloadPolicy) == parameters(torch_fsdp.CPUOffloadPolicy)
    assert issubclass(fsdp1.CPUOffloadPolicy, fsdp1.OffloadPolicy)
    torch_methods = methods(torch_fsdp.FSDPModule)
    assert len(torch_methods) == (26 if has_newer else 23)
    assert methods(fsdp1.FSDPModule) == torch_methods | newer_methods | {"summon_full_params", "no_sync"}  # and fsdp1's two
    for name in torch_methods:
        assert parameters(getattr(fsdp1.FSDPModule, name)) == parameters(getattr(torch_fsdp.FSDPModule, name)), name


def test_an_untested_torch_release_is_named_once_at_import():
    """fsdp1 warns on a torch release outside the tested range, naming both, and is silent on the
    tested one (this suite's: importing fsdp1 with warnings as errors succeeds)."""
    import subprocess
    import sys

    from fsdp1._torch_version import TESTED_TORCH, warn_if_untested

    assert release("2.13.0+cpu") == (2, 13) and release("2.14.0a0+git1234") == (2, 14)
    for version in ("2.12.1", "2.16.0", "3.0.0"):
        with pytest.warns(UserWarning, match=f"tested on torch 2.13 to 2.15; this is torch {version}"):
            warn_if_untested(version)
    assert TESTED_TORCH[0] <= release(torch.__version__) <= TESTED_TORCH[1]
    subprocess.run([sys.executable, "-W", "error", "-c", "import fsdp1"], check=True)
