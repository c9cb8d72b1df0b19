"""Tests ``fsdp1.use_as_torch_fsdp`` with the clients that reach for torch's class by name, running
their own code (issue 13, first part): HF Accelerate's ``save_fsdp_model`` / ``load_fsdp_model`` /
``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` resume training bit for bit (FULL and SHARDED, both
use_orig_params) and ``extract_model_from_parallel`` unwraps fsdp1's units. Accelerate only enters
its FSDP mode on accelerators, so its functions are called directly here, with its plugin and a
stand-in for the ``Accelerator`` (the attributes they read)."""

import types

import pytest
import torch
import torch.distributed as dist

import fsdp1
from _harness import run_on_ranks
from _models import Block, adam, make_gpt, train_steps, wrap_fsdp1

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


def _accelerate_save_and_resume(kind, use_orig_params, directory):
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, extract_model_from_parallel
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import StateDictType

    rank, world = dist.get_rank(), dist.get_world_size()
    PartialState(cpu=True)  # Accelerate's logging needs its state
    accelerator = types.SimpleNamespace(process_index=rank, num_processes=world, is_fsdp2=False,
                                        is_main_process=rank == 0, wait_for_everyone=dist.barrier)
    with fsdp1.use_as_torch_fsdp():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type=StateDictType[kind],
                                                use_orig_params=use_orig_params)
        model = wrap_fsdp1(make_gpt(), use_orig_params=use_orig_params)
        optim = adam(model.parameters())
        train_steps(model, optim, 0, 3)
        save_fsdp_model(plugin, accelerator, model, directory)
        save_fsdp_optimizer(plugin, accelerator, optim, model, directory)
        uninterrupted = train_steps(model, optim, 3, 3)
        resumed_model = wrap_fsdp1(make_gpt(seed=7), use_orig_params=use_orig_params)
        resumed_optim = adam(resumed_model.parameters())
        load_fsdp_model(plugin, accelerator, resumed_model, directory)
        load_fsdp_optimizer(plugin, accelerator, resumed_optim, resumed_model, directory)
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
        assert losses == their_losses and dtypes == their_dtypes == {torch.float32}
        assert state.keys() == their_state.keys()
        assert all(dtype == their_state[k][0] == torch.float32 and torch.equal(v, their_state[k][1])
                   for k, (dtype, v) in state.items())
