"""Tests ``fsdp1.use_as_torch_fsdp`` with HF Accelerate's FSDP2 mode: its own ``Accelerator._prepare_fsdp2``
(which calls ``fsdp2_prepare_model``, ``fsdp2_prepare_auto_wrap_policy``, ``fsdp2_load_full_state_dict`` and
``fsdp2_switch_optimizer_parameters``), its DTensor-aware gradient clipping and its FSDP2 checkpoint functions
(``save_fsdp_model`` / ``load_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` with
``fsdp_version=2``) build and train fsdp1's ``FSDPModule`` s, bitwise like the same code on torch's own
``fully_shard`` and within 1e-5 of DDP; checkpoints resume bit for bit, also across the two engines.

Accelerate only enters its FSDP mode on accelerators (``AcceleratorState`` leaves ``MULTI_CPU`` alone), so its
functions are called here with a stand-in for the ``Accelerator`` carrying the attributes they read, and
``Accelerator``'s own methods are called unbound on it. The Transformers ``Trainer`` (5.x selects FSDP2 by
``fsdp=True, fsdp_config={"version": 2}``) reaches FSDP through that same ``Accelerator``: on CPU it would drop
the plugin and train with DDP without a word, so its test switches the real ``Accelerator``'s state to FSDP right
after the Trainer built it, and runs the Trainer's own loop (``accelerator.prepare``, clipping, logging).
``cpu_ram_efficient_loading`` shards the model on the meta device and loads it with ``assign=True``."""

import contextlib
import os
import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _accelerate import accelerator_stand_in
from _harness import run_on_ranks
from _models import batch, lm_loss, make_gpt

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

VOCAB, LR, MAX_NORM = 61, 1e-2, 0.5


# ---------------------------------------------------------------------------------------------- helpers
def _model(name, seed=0):
    """A seeded model and the batches of its training: TinyGPT, or a Hugging Face model from a config."""
    torch.manual_seed(seed)
    t = transformers
    if name == "gpt":
        return make_gpt(seed)
    if name in ("llama", "llama_tied"):
        config = t.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=37, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                               tie_word_embeddings=name == "llama_tied", bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return t.LlamaForCausalLM(config)
    config = t.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return t.GPT2LMHeadModel(config)


def _loss(name, model, step):
    rank, world = dist.get_rank(), dist.get_world_size()
    if name == "gpt":
        return lm_loss(model, *batch(step, rank, world))
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(3, VOCAB, (2, 9), generator=gen)
    return model(input_ids=ids, labels=ids).loss


def _plugin(name, **kwargs):
    from accelerate.utils import FullyShardedDataParallelPlugin

    wrap = {"transformer_cls_names_to_wrap": ["Block"]} if name == "gpt" else {}  # HF models: their _no_split_modules
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **wrap, **kwargs)


def _fsdp2_accelerator(plugin):
    """What ``Accelerator._prepare_fsdp2``, ``fsdp2_prepare_model``, ``fsdp2_load_full_state_dict``, its
    clipping and its checkpoint functions read of an ``Accelerator`` in FSDP2 mode, on CPU."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, DynamoBackend

    accelerator = accelerator_stand_in()
    accelerator.is_fsdp2 = True
    accelerator.distributed_type = DistributedType.FSDP
    accelerator.state = types.SimpleNamespace(fsdp_plugin=plugin, dynamo_plugin=types.SimpleNamespace(backend=DynamoBackend.NO))
    accelerator.mixed_precision = "no"
    accelerator.device = torch.device("cpu")
    accelerator.fp8_backend = None
    accelerator._models = []
    accelerator._prepare_one = lambda obj, first_pass=False, device_placement=None: obj  # no AcceleratedOptimizer on CPU
    for method in ("_prepare_fsdp2", "_get_named_parameters", "_clip_grad_norm_dtensor_aware"):
        setattr(accelerator, method, types.MethodType(getattr(Accelerator, method), accelerator))
    return accelerator


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _prepared(name, plugin, seed=0):
    """The model and its AdamW, built on the plain model and prepared as ``Accelerator.prepare`` does in
    FSDP2 mode: sharded in place, the optimizer switched to the sharded parameters."""
    accelerator = _fsdp2_accelerator(plugin)
    model = _model(name, seed)
    model, optim = accelerator._prepare_fsdp2(model, _adamw(model.parameters()))
    return accelerator, model, optim


def _train(name, accelerator, model, optim, first, count):
    """Steps ``first`` .. ``first + count - 1`` of an Accelerate loop: backward, Accelerate's clipping, step."""
    losses, norms = [], []
    for step in range(first, first + count):
        loss = _loss(name, model, step)
        loss.backward()
        params = list(model.parameters())
        if accelerator is None:
            norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        else:
            norm = accelerator._clip_grad_norm_dtensor_aware(params, MAX_NORM)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _full(model):
    """Every parameter, unsharded, by name (collective for DTensors)."""
    module = model.module if isinstance(model, DDP) else model
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}


def _units(model):
    """(path, class name, class module) of each FSDPModule, and whether every parameter is a DTensor."""
    from torch.distributed.fsdp import FSDPModule  # fsdp1's or torch's, as the engine in effect

    units = [(path, type(m).__name__, type(m).__module__) for path, m in model.named_modules() if isinstance(m, FSDPModule)]
    return units, all(isinstance(p, DTensor) and isinstance(p, torch.nn.Parameter) for p in model.parameters())


# ---------------------------------------------------------------------------------------------- training
def _prepare_and_train(name, cpu_ram_efficient_loading):
    """Accelerate's FSDP2 preparation and 3 AdamW steps with its clipping: on fsdp1 (under the alias),
    on torch's fully_shard, and DDP on the plain model."""
    runs = {}
    for engine in ("fsdp1", "torch"):
        alias = fsdp1.use_as_torch_fsdp() if engine == "fsdp1" else None
        try:
            plugin = _plugin(name, cpu_ram_efficient_loading=cpu_ram_efficient_loading)
            accelerator, model, optim = _prepared(name, plugin)
            units, dtensors = _units(model)
            fsdp1_units = [isinstance(m, fsdp1.FSDPModule) for m in model.modules() if type(m).__name__.startswith("FSDP")]
            optim_is_model = [p for g in optim.param_groups for p in g["params"]] == list(model.parameters())
            tied = name == "gpt" or model.get_input_embeddings().weight is model.get_output_embeddings().weight
            losses, norms = _train(name, accelerator, model, optim, 0, 3)
            runs[engine] = (units, dtensors, fsdp1_units, optim_is_model, tied, losses, norms, _full(model))
        finally:
            if alias is not None:
                alias.undo()
    ddp = DDP(_model(name))
    losses, norms = _train(name, None, ddp, _adamw(ddp.parameters()), 0, 3)
    runs["ddp"] = (losses, norms, _full(ddp))
    return runs


def _relative(xs, ys):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(xs, ys))


@pytest.mark.parametrize("name,cpu_ram_efficient_loading",
                         [("gpt", False), ("llama_tied", False), ("llama_tied", True),
                          ("gpt2", False)])
def test_accelerate_fsdp2_prepares_fsdp1_modules_that_train_bitwise_like_torchs_and_like_ddp(name, cpu_ram_efficient_loading):
    for runs in run_on_ranks(2, _prepare_and_train, name, cpu_ram_efficient_loading):
        units, dtensors, fsdp1_units, optim_is_model, tied, losses, norms, params = runs["fsdp1"]
        their_units, their_dtensors, _, their_optim_is_model, their_tied, their_losses, their_norms, their_params = runs["torch"]
        ddp_losses, ddp_norms, ddp_params = runs["ddp"]
        # fsdp1's classes, in the units torch's get: blocks, the tail group, the root
        assert units
        assert all(module.startswith("fsdp1.") for _, _, module in units)
        assert all(fsdp1_units)
        assert [u[:2] for u in units] == [u[:2] for u in their_units]
        assert all(module.startswith("torch.") for _, _, module in their_units)
        assert units[0][0] == "", units
        assert len(units) >= 4, units  # the root, two blocks, the tail group
        assert dtensors
        assert their_dtensors
        assert optim_is_model
        assert their_optim_is_model
        assert tied
        assert their_tied
        # bitwise torch's fully_shard: losses, gradient norms, every parameter after 3 steps
        assert losses == their_losses
        assert norms == their_norms
        assert params.keys() == their_params.keys()
        assert all(torch.equal(params[k], their_params[k]) for k in params)
        # DDP within 1e-5, the clipping active
        assert norms[0] > MAX_NORM
        assert _relative(losses, ddp_losses) < 1e-5
        assert _relative(norms, ddp_norms) < 1e-5
        assert params.keys() == ddp_params.keys()
        # GPT-2's fused c_attn.bias holds the key bias, whose true gradient is zero: its rounding noise differs
        # with the reduction order (as torch's fully_shard's does, bitwise equal above) and AdamW scales it up
        compared = [k for k in params if not k.endswith("attn.c_attn.bias")]
        assert max((params[k] - ddp_params[k]).abs().max().item() / (ddp_params[k].abs().max().item() or 1.0)
                   for k in compared) < 1e-5


# ---------------------------------------------------------------------------------------------- checkpoints
def _engine(engine):
    return fsdp1.use_as_torch_fsdp() if engine == "fsdp1" else contextlib.nullcontext()


def _checkpoints(name, kind, directory):
    """Each engine trains 2 steps, saves through Accelerate's FSDP2 checkpoint functions and trains 2 more;
    then each resumes a fresh model (another seed) from its own checkpoint and from the other's."""
    from _accelerate import load_with_accelerate, save_with_accelerate

    uninterrupted, resumed = {}, {}
    for engine in ("torch", "fsdp1"):
        with _engine(engine):
            plugin = _plugin(name, state_dict_type=kind)
            accelerator, model, optim = _prepared(name, plugin)
            _train(name, accelerator, model, optim, 0, 2)
            save_with_accelerate(plugin, accelerator, model, optim, f"{directory}/{engine}")
            uninterrupted[engine] = (_train(name, accelerator, model, optim, 2, 2), _full(model))
    for engine in ("torch", "fsdp1"):
        for source in ("torch", "fsdp1"):
            with _engine(engine):
                plugin = _plugin(name, state_dict_type=kind)
                accelerator, model, optim = _prepared(name, plugin, seed=7)
                load_with_accelerate(plugin, accelerator, model, optim, f"{directory}/{source}")
                resumed[engine, source] = (_train(name, accelerator, model, optim, 2, 2), _full(model))
    saved_alike = None
    if kind == "FULL_STATE_DICT" and dist.get_rank() == 0:  # rank 0 wrote both files: the same tensors by name
        files = [torch.load(f"{directory}/{engine}/pytorch_model_fsdp.bin", weights_only=True) for engine in ("torch", "fsdp1")]
        saved_alike = files[0].keys() == files[1].keys() and all(torch.equal(v, files[1][k]) for k, v in files[0].items())
    return uninterrupted, resumed, saved_alike


def _same_run(a, b):
    (losses, norms), params = a
    (their_losses, their_norms), their_params = b
    return (losses == their_losses and norms == their_norms and params.keys() == their_params.keys()
            and all(torch.equal(v, their_params[k]) for k, v in params.items()))


@pytest.mark.parametrize("name,kind", [("gpt", "SHARDED_STATE_DICT"), ("gpt", "FULL_STATE_DICT"),
                                       ("llama_tied", "SHARDED_STATE_DICT")])
def test_accelerate_fsdp2_checkpoints_resume_bitwise_also_across_torchs_engine_and_fsdp1s(name, kind, tmp_path):
    results = run_on_ranks(2, _checkpoints, name, kind, str(tmp_path))
    for uninterrupted, resumed, _ in results:
        assert _same_run(uninterrupted["fsdp1"], uninterrupted["torch"])
        for (engine, source), run in resumed.items():
            assert _same_run(run, uninterrupted[engine]), (engine, source)
    if kind == "FULL_STATE_DICT":
        assert results[0][2] is True


# ---------------------------------------------------------------------------------------------- Trainer
def _trainer_run(engine, directory):
    """The Transformers Trainer's own loop for 3 steps of the tied Llama: with FSDP2 (``fsdp_config={"version":
    2}``) on fsdp1 under the alias or on torch's fully_shard, or with DDP (no fsdp arguments)."""
    import transformers as t
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class FSDPOnCPUTrainer(t.Trainer):
        """Accelerate leaves a CPU run in MULTI_CPU and drops the FSDP plugin (the Trainer would then train
        with DDP, silently); its state is switched to FSDP here, as on an accelerator, before anything
        reads it. The rest is the Trainer's own code."""

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if self.args.fsdp_plugin_args is not None:
                self.accelerator.state.distributed_type = DistributedType.FSDP
                self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                self.is_fsdp_enabled = True

    rank, world = dist.get_rank(), dist.get_world_size()
    saved_env = dict(os.environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(reset_partial_state=True)  # MULTI_CPU, over the pool's group
    try:
        with _engine(engine):
            model = _model("llama_tied")
            fsdp = {"fsdp": True, "fsdp_config": {"version": 2}} if engine != "ddp" else {}
            args = t.TrainingArguments(output_dir=directory, use_cpu=True, max_steps=3, per_device_train_batch_size=2,
                                       learning_rate=LR, max_grad_norm=MAX_NORM, report_to=[], save_strategy="no",
                                       logging_steps=1, disable_tqdm=True, **fsdp)
            gen = torch.Generator().manual_seed(0)
            data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, VOCAB, (12, 9), generator=gen)]
            trainer = FSDPOnCPUTrainer(model=model, args=args, train_dataset=data)
            trainer.train()
            from torch.distributed.fsdp import FSDPModule

            units = [type(m).__module__ for m in trainer.model.modules() if isinstance(m, FSDPModule)]
            logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
            return trainer.is_fsdp_enabled, units, logs, _full(trainer.model)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(saved_env)


def test_transformers_trainer_fsdp2_trains_on_fsdp1_bitwise_like_torchs_fully_shard_and_like_ddp(tmp_path):
    runs = {engine: run_on_ranks(2, _trainer_run, engine, str(tmp_path)) for engine in ("fsdp1", "torch", "ddp")}
    for rank in range(2):
        enabled, units, logs, params = runs["fsdp1"][rank]
        their_enabled, their_units, their_logs, their_params = runs["torch"][rank]
        ddp_enabled, ddp_units, ddp_logs, ddp_params = runs["ddp"][rank]
        assert enabled
        assert their_enabled
        assert not ddp_enabled
        assert not ddp_units
        assert len(units) == len(their_units) >= 4
        assert all(m.startswith("fsdp1.") for m in units)
        assert all(m.startswith("torch.") for m in their_units)
        assert len(logs) == 3
        assert logs == their_logs
        assert logs[0][1] > MAX_NORM  # loss and grad norm, bitwise
        assert params.keys() == their_params.keys()
        assert all(torch.equal(v, their_params[k]) for k, v in params.items())
        assert _relative([x for log in logs for x in log], [x for log in ddp_logs for x in log]) < 1e-5
        assert max((params[k] - ddp_params[k]).abs().max().item() / (ddp_params[k].abs().max().item() or 1.0)
                   for k in params) < 1e-5


def _from_pretrained_sharded(engine, directory, name):
    """Transformers' own FSDP2 loading: ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``
    shards the model on the meta device with its ``_fsdp_plan`` (the embedding, the blocks, the norm, then the
    root) and registers each loaded weight as this rank's rows in place of the sharded one; a tied model then
    ties the head (in the root's group) to the embedding's (another group's) parameter."""
    import importlib
    import sys

    from transformers.distributed import DistributedConfig

    directory = os.path.join(directory, name)
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(directory, "config.json")):
        _model(name).save_pretrained(directory)
    dist.barrier()
    with _engine(engine):
        if "transformers.distributed.fsdp" in sys.modules:  # it binds fully_shard when imported: see the alias's docstring
            importlib.reload(sys.modules["transformers.distributed.fsdp"])
        model = transformers.LlamaForCausalLM.from_pretrained(directory, distributed_config=DistributedConfig(fsdp_size=2))
        engines = {type(m).__module__.split(".")[0] for m in model.modules() if type(m).__name__.startswith("FSDP")}
        optim = _adamw(model.parameters())
        gen = torch.Generator().manual_seed(dist.get_rank())
        losses = []
        try:
            for _ in range(3):
                ids = torch.randint(3, VOCAB, (2, 9), generator=gen)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.item())
        except ValueError as error:
            return engines, str(error), None
        return engines, losses, _full(model)


def test_transformers_from_pretrained_with_fsdp_size_loads_into_fsdp1_and_trains_bitwise_like_torchs(tmp_path):
    ours, theirs = (run_on_ranks(2, _from_pretrained_sharded, engine, str(tmp_path), "llama")[0] for engine in ("fsdp1", "torch"))
    assert ours[0] == {"fsdp1"}
    assert theirs[0] == {"torch"}
    assert ours[1] == theirs[1]
    assert ours[2].keys() == theirs[2].keys()
    assert all(torch.equal(ours[2][k], theirs[2][k]) for k in ours[2])


def test_a_tied_model_loaded_with_fsdp_size_is_refused_at_the_first_forward_naming_the_tie(tmp_path):
    """A documented difference: the head is tied, after sharding, to a parameter of the embedding's group; torch's
    trains it through the two groups sharing the parameter's storage, which fsdp1's flat shards cannot share."""
    ours, theirs = (run_on_ranks(2, _from_pretrained_sharded, engine, str(tmp_path), "llama_tied")[0] for engine in ("fsdp1", "torch"))
    assert isinstance(theirs[1], list)
    assert "Parameter 'model.embed_tokens.weight' is shared with a parameter already managed by another FSDP group" in ours[1]
