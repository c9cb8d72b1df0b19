"""Tests PEFT's LoRA adapters on fsdp1 units with use_orig_params=True, running PEFT's own
code: a tiny GPT-2 built from its config (nothing downloaded) gets a LoRA adapter from
``peft.get_peft_model`` (frozen base, trainable adapter) and is wrapped under
``fsdp1.use_as_torch_fsdp`` with PEFT's own ``fsdp_auto_wrap_policy`` (torch's lambda and transformer
policies: a unit per GPT-2 block and per LoRA matrix). AdamW over the adapter trains bit for bit as
on torch's FSDP1, within 1e-5 of DDP, and leaves the base untouched; ``get_peft_model_state_dict``
under a FULL state dict gives the adapter one process trains over the global batch; HF Accelerate's
``save_fsdp_model`` / ``load_fsdp_model`` and optimizer counterparts resume the training bit for bit.

What of PEFT does not work on FSDP1 units, torch's as well as fsdp1's, and why:
- ``get_peft_model_state_dict`` on a model with nested units returns an empty dict: PEFT finds the
  adapter's keys from module names, removing only a leading ``_fsdp_wrapped_module.``, and below a
  nested unit every name keeps an inner one. It is tested on a model wrapped as one unit.
- ``set_peft_model_state_dict`` on a unit (Accelerate's ``adapter_only=True``) loads nothing: PEFT
  judges from the unit's ``named_parameters()``, which start with ``_fsdp_wrapped_module.``, that
  the model's keys lack ``base_model.model.``, and strips it from the adapter's keys. Accelerate's
  functions are tested saving the whole model.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

import fsdp1

from _accelerate import accelerator_stand_in, load_with_accelerate, save_with_accelerate
from _harness import run_on_ranks
from _models import max_relative_error, relative_errors

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

VOCAB, STEPS = 61, 4
"""The widths below (27 wide, LoRA rank 3) give LoRA matrices of 81, 243 and 324 elements: most of
their units need padding on 2 ranks."""


def _lora_gpt2(lora_seed=1):
    """The same frozen GPT-2 for every seed; ``lora_seed`` draws the adapter's initial A matrices."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=27, n_head=3, vocab_size=VOCAB, n_positions=16,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    torch.manual_seed(lora_seed)
    return get_peft_model(base, LoraConfig(r=3, lora_alpha=6, target_modules=["c_attn", "c_fc"], lora_dropout=0.0,
                                           fan_in_fan_out=True))


def _wrap(model, one_unit=False):
    """PEFT's own policy, or one unit for the whole model; torch's FSDP1 needs the CPU device_id."""
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, auto_wrap_policy=None if one_unit else fsdp_auto_wrap_policy(model), use_orig_params=True,
                device_id=torch.device("cpu"))


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _tokens(step, rank, world):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + step * world + rank))


def _rank_tokens(step):
    return _tokens(step, dist.get_rank(), dist.get_world_size())


def _global_tokens(step):
    """Every rank's tokens of ``step``: one process's batch in place of all ranks' (HF's loss, a
    mean over equally many tokens per rank, then averages as the ranks' gradients do)."""
    return torch.cat([_tokens(step, rank, dist.get_world_size()) for rank in range(dist.get_world_size())])


def _train(model, optim, first, count, tokens_of):
    losses = []
    for step in range(first, first + count):
        tokens = tokens_of(step)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _lora_training(implementation):
    alias = fsdp1.use_as_torch_fsdp() if implementation == "fsdp1" else contextlib.nullcontext()
    with alias:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = _lora_gpt2()
        initial = {key: value.clone() for key, value in model.state_dict().items()}
        model = _wrap(model)
        losses = _train(model, _adamw(model), 0, STEPS, _rank_tokens)
        units = [type(module).__module__ for module in model.modules() if isinstance(module, FSDP)]
        return losses, model.state_dict(), units, initial


def _lora_training_ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_lora_gpt2())
    return _train(model, _adamw(model), 0, STEPS, _rank_tokens), model.module.state_dict()


def test_lora_trains_as_on_torch_fsdp1_and_ddp_and_leaves_the_base_frozen():
    pytest.importorskip("peft")
    ours = run_on_ranks(2, _lora_training, "fsdp1")
    theirs = run_on_ranks(2, _lora_training, "torch")
    ddp = run_on_ranks(2, _lora_training_ddp)
    for (losses, state, units, initial), (their_losses, their_state, their_units, _), (ddp_losses, ddp_state) in zip(
            ours, theirs, ddp):
        # A unit per GPT-2 block and per LoRA matrix (2 + 8), and the root.
        assert units == ["fsdp1._wrapper.fully_sharded_data_parallel"] * 11
        assert len(their_units) == 11
        assert losses == their_losses
        assert list(state) == list(their_state) == list(initial)
        assert all(torch.equal(state[key], their_state[key]) for key in state)
        adapter = {key: value for key, value in state.items() if ".lora_" in key}
        assert len(adapter) == 8
        assert all(not torch.equal(value, initial[key]) for key, value in adapter.items())
        assert all(torch.equal(value, initial[key]) for key, value in state.items() if key not in adapter)
        assert relative_errors(losses, ddp_losses) < 1e-5
        assert max_relative_error(adapter, {key: ddp_state[key] for key in adapter}) < 1e-5


def _adapter_state_dict_of_one_unit():
    from peft import get_peft_model_state_dict

    with fsdp1.use_as_torch_fsdp():
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        model = _wrap(_lora_gpt2(), one_unit=True)
        losses = _train(model, _adamw(model), 0, STEPS, _rank_tokens)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            adapter = get_peft_model_state_dict(model)
    single = _lora_gpt2()
    single_losses = _train(single, _adamw(single), 0, STEPS, _global_tokens)
    return losses, adapter, single_losses, get_peft_model_state_dict(single)


def test_peft_adapter_state_dict_under_full_state_dict_matches_one_process():
    pytest.importorskip("peft")
    results = run_on_ranks(2, _adapter_state_dict_of_one_unit)
    mean_losses = [sum(step_losses) / len(results) for step_losses in zip(*(losses for losses, _, _, _ in results))]
    for _, adapter, single_losses, single_adapter in results:
        assert relative_errors(mean_losses, single_losses) < 1e-6
        assert list(adapter) == list(single_adapter)
        assert len(adapter) == 8
        assert max_relative_error(adapter, single_adapter) < 1e-5


def _accelerate_save_and_resume(kind, one_unit, directory):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import StateDictType

    accelerator = accelerator_stand_in()
    with fsdp1.use_as_torch_fsdp():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type=StateDictType[kind], use_orig_params=True)
        model = _wrap(_lora_gpt2(), one_unit)
        optim = _adamw(model)
        _train(model, optim, 0, 2, _rank_tokens)
        save_with_accelerate(plugin, accelerator, model, optim, directory)
        uninterrupted = _train(model, optim, 2, 2, _rank_tokens), model.state_dict()
        resumed_model = _wrap(_lora_gpt2(lora_seed=7), one_unit)
        resumed_optim = _adamw(resumed_model)
        load_with_accelerate(plugin, accelerator, resumed_model, resumed_optim, directory)
        resumed = _train(resumed_model, resumed_optim, 2, 2, _rank_tokens), resumed_model.state_dict()
    return uninterrupted, resumed


@pytest.mark.parametrize("kind, one_unit", [
    ("FULL_STATE_DICT", False), ("SHARDED_STATE_DICT", False), ("FULL_STATE_DICT", True),
    ("SHARDED_STATE_DICT", True)])
def test_accelerate_resumes_lora_training_bitwise(kind, one_unit, tmp_path):
    """One unit puts the adapter, laid out before the frozen base, in rank 0's shard alone."""
    pytest.importorskip("peft")
    for (losses, state), (resumed_losses, resumed_state) in run_on_ranks(2, _accelerate_save_and_resume, kind,
                                                                         one_unit, str(tmp_path)):
        assert resumed_losses == losses
        assert all(torch.equal(resumed_state[key], value) for key, value in state.items())
