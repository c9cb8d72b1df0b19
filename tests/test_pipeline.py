"""Tests ``fully_shard`` stages under torch's pipeline schedules (``torch.distributed.pipelining``) on
a (pp=2, dp=2) mesh, against torch's ``fully_shard`` doing the same, in both import forms (``import
fsdp1`` alone, and under ``use_as_torch_fsdp``): the schedules recognise fsdp1's modules, keep them
gathered and their gradients unreduced across the micro-batches and reduce once at the end of the
step, so the losses, the parameters and the bytes gathered and reduced per step are torch's, the
schedules that split backward into an input and a weight pass included; where such a split cannot
reach the parameters (blocks resharded after forward, which torch's trains silently wrong) the
schedule is refused before its first action, on every rank at once, however often it is tried.
Also bf16, a Hugging Face GPT-2 cut into stages, tensor parallelism inside the stages on 8 ranks."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

import fsdp1
from fsdp1._planner.dry_run import CommBytes

from _harness import run_on_ranks
from _models import fully_shard_of, pipeline_step, stage_indices

DIM, MICROBATCHES, STEPS = 7, 4, 3
WHOLE_BACKWARD = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS"]
SPLIT_BACKWARD = ["ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
"""Every schedule torch 2.13 ships: these split backward into an input pass and a weight pass."""


class Residual(nn.Module):
    """One block: an MLP (of odd width by default) around a residual connection."""

    def __init__(self, hidden: int = 2 * DIM + 1, checkpointed: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)
        self.checkpointed = checkpointed  # the body under non-reentrant activation checkpointing

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)

    def _body(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _pipeline(impl, schedule_name, blocks, shard, pp_group, loss_fn):
    """``blocks`` cut into the stages this rank holds, each block and each stage sharded by ``shard``,
    driven by ``schedule_name``."""
    from torch.distributed.pipelining import PipelineStage, schedules

    pp_rank, pp_size = pp_group.rank(), pp_group.size()
    indices = stage_indices(schedule_name, pp_rank, pp_size)
    stage_count = len(indices) * pp_size
    per_stage = len(blocks) // stage_count
    stages = []
    for index in indices:
        module = nn.Sequential(*copy.deepcopy(blocks[index * per_stage:(index + 1) * per_stage]))
        stages.append(PipelineStage(shard(module), index, stage_count, torch.device("cpu"), group=pp_group))
    schedule_class = getattr(schedules, schedule_name)
    single = issubclass(schedule_class, schedules.PipelineScheduleSingle)
    schedule = schedule_class(stages[0] if single else stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    return schedule, [stage.submod for stage in stages], 0 in indices, stage_count - 1 in indices


def _mse(output, target):
    return F.mse_loss(output, target)


def _shard_blocks(impl, mesh, reshard_blocks=False, **kwargs):
    """Each block sharded (kept gathered after forward, as torchtitan does under pipelining, unless
    ``reshard_blocks``), then the stage."""
    fully_shard = fully_shard_of(impl)

    def shard(stage):
        for block in stage:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_blocks, **kwargs)
        return fully_shard(stage, mesh=mesh, **kwargs)

    return shard


FORMS = ["plain", "alias"]
"""How a script reaches fsdp1: ``import fsdp1`` alone, or with ``use_as_torch_fsdp()`` in effect."""


def _in_form(form):
    return fsdp1.use_as_torch_fsdp() if form == "alias" else contextlib.nullcontext()


def _mixed_precision(impl):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = fsdp1.MixedPrecisionPolicy if impl == "fsdp1" else MixedPrecisionPolicy
    return {"mp_policy": policy(param_dtype=torch.bfloat16)}


def _trained_pipeline(impl, schedule_name, variant="fp32", form="plain"):
    """Three AdamW steps; per step the losses, then every parameter's full value and the bytes one
    rank sent in the second step's gathers and reductions. ``variant``: "bf16" (a bf16
    ``MixedPrecisionPolicy``), "resharded" (blocks resharded after forward), "checkpointed" (each
    block's body under activation checkpointing; the stages hold no parameters of their own)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    blocks = [Residual(checkpointed=variant == "checkpointed") for _ in range(8)]
    kwargs = _mixed_precision(impl) if variant == "bf16" else {}
    shard = _shard_blocks(impl, mesh["dp"], reshard_blocks=variant == "resharded", **kwargs)
    with _in_form(form):
        schedule, modules, is_first, is_last = _pipeline(impl, schedule_name, blocks, shard, mesh["pp"].get_group(), _mse)
        optims = [torch.optim.AdamW(module.parameters(), lr=1e-2) for module in modules]
        dp_rank = mesh["dp"].get_local_rank()
        losses, sent = [], {}
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(100 * step + dp_rank)
            inputs, targets = torch.randn(2 * MICROBATCHES, DIM, generator=generator), torch.randn(2 * MICROBATCHES, DIM, generator=generator)
            counter = CommBytes() if step == 1 else contextlib.nullcontext()
            with counter:
                losses.append(pipeline_step(schedule, is_first, is_last, inputs, targets))
            if step == 1:
                sent = dict(counter.payload)
            for optim in optims:
                optim.step()
                optim.zero_grad()
        values = [param.full_tensor().detach() for module in modules for param in module.parameters()]
    return losses, values, sum(sent.values())


@pytest.mark.parametrize("schedule_name", WHOLE_BACKWARD + SPLIT_BACKWARD)
def test_schedules_train_as_torchs(schedule_name):
    """Every schedule, the split ones included, in both import forms: losses and parameters bitwise
    torch's on every rank, each stage gathered once and reduced once per step, so no more bytes than
    torch's (fsdp1 run as a plain module gathered and reduced once per micro-batch: 4.5 times torch's
    bytes here, and a split backward computed no weight gradient)."""
    _assert_trained_as_torchs(schedule_name, "fp32", forms=FORMS)


@pytest.mark.parametrize("schedule_name, variant", [("Schedule1F1B", "bf16"), ("ScheduleInterleavedZeroBubble", "bf16"),
                                                   ("Schedule1F1B", "resharded"), ("ScheduleInterleaved1F1B", "resharded"),
                                                   ("ScheduleInterleavedZeroBubble", "checkpointed"),
                                                   ("ScheduleDualPipeV", "checkpointed")])
def test_schedule_variants_train_as_torchs(schedule_name, variant):
    """A bf16 ``MixedPrecisionPolicy``; blocks resharded after forward (gathered again in backward)
    under schedules of whole backwards, also one that gathers each stage before its first forward
    (that first forward computed on the resting Parameters, the next ones on views of the flat
    parameter, and their mixed backwards were refused as a split backward); activation checkpointing
    inside the blocks under split backwards (the weight pass recomputes a block outside the block's
    own backward: that forward never ended, and the next step was refused on some ranks while the
    others waited)."""
    _assert_trained_as_torchs(schedule_name, variant)


def _assert_trained_as_torchs(schedule_name, variant, forms=("plain",)):
    torchs = run_on_ranks(4, _trained_pipeline, "torch", schedule_name, variant)
    for form in forms:
        ours = run_on_ranks(4, _trained_pipeline, "fsdp1", schedule_name, variant, form)
        for (losses, values, sent), (torch_losses, torch_values, torch_sent) in zip(ours, torchs):
            assert len(losses) == STEPS and all(len(step) in (0, MICROBATCHES) for step in losses)
            assert all(torch.equal(a, b) for step, torch_step in zip(losses, torch_losses) for a, b in zip(step, torch_step))
            assert all(torch.equal(a, b) for a, b in zip(values, torch_values))
            assert 0 < sent <= torch_sent, form


REFUSALS = 8


def _refused_again_and_again(schedule_name, form, only_last_stage):
    """The same pipeline built anew and stepped ``REFUSALS`` times, the blocks of every stage (or,
    with ``only_last_stage``, of the last one) resharded after forward: each step's refusal, and
    whether every parameter and gradient was as before it."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    blocks = [Residual() for _ in range(8)]
    indices = stage_indices(schedule_name, mesh["pp"].get_local_rank(), 2)
    last_stage = 2 * len(indices) - 1
    refusals, unchanged = [], True
    with _in_form(form):
        for _ in range(REFUSALS):
            order = iter(indices)  # _pipeline shards this rank's stages in this order

            def shard(stage):
                reshard = not only_last_stage or next(order) == last_stage
                return _shard_blocks("fsdp1", mesh["dp"], reshard_blocks=reshard)(stage)

            schedule, modules, is_first, is_last = _pipeline("fsdp1", schedule_name, blocks, shard, mesh["pp"].get_group(), _mse)
            before = [param.detach().clone() for module in modules for param in module.parameters()]
            inputs = targets = torch.randn(2 * MICROBATCHES, DIM)
            with pytest.raises(NotImplementedError) as refused:
                pipeline_step(schedule, is_first, is_last, inputs, targets)
            refusals.append(str(refused.value))
            after = [param for module in modules for param in module.parameters()]
            unchanged &= all(param.grad is None and torch.equal(param.detach(), old) for param, old in zip(after, before))
    return refusals, unchanged


@pytest.mark.parametrize("schedule_name", SPLIT_BACKWARD)
def test_split_backward_over_resharded_blocks_is_refused_on_every_rank(schedule_name):
    """Blocks resharded after forward hold no parameters a split backward's weight pass can reach
    (torch's ``fully_shard`` then trains 0.02 off its own 1F1B after one step, silently): the
    schedule is refused before its first action on every rank, naming the fix, with nothing changed;
    8 times in a row with no hang (refused at the end of a step instead, DualPipeV's ranks stopped
    at different actions and some waited for the others' messages), in both import forms, and where
    only the last stage's blocks reshard (the ranks agree before any message)."""
    for form, only_last_stage in [("plain", False), ("alias", False), ("plain", True)]:
        for refusals, unchanged in run_on_ranks(4, _refused_again_and_again, schedule_name, form, only_last_stage):
            assert len(refusals) == REFUSALS and unchanged
            assert all("splits backward into an input pass and a weight pass" in refusal
                       and "reshard_after_forward=False" in refusal and "before its first action" in refusal
                       for refusal in refusals)


def _unsharded_stage_and_eval(schedule_name):
    """Blocks sharded but not the stage module: a split backward's step refused, naming the fix. Then
    blocks resharded after forward under a sharded stage: ``eval()`` (no backward, so no weight pass)
    runs, and the following ``step()`` is refused."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    blocks = [Residual() for _ in range(8)]
    inputs = targets = torch.randn(2 * MICROBATCHES, DIM)

    def blocks_only(stage):
        for block in stage:
            fsdp1.fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        return stage

    schedule, _, is_first, is_last = _pipeline("fsdp1", schedule_name, blocks, blocks_only, mesh["pp"].get_group(), _mse)
    with pytest.raises(NotImplementedError) as unsharded:
        pipeline_step(schedule, is_first, is_last, inputs, targets)
    shard = _shard_blocks("fsdp1", mesh["dp"], reshard_blocks=True)
    schedule, _, is_first, is_last = _pipeline("fsdp1", schedule_name, blocks, shard, mesh["pp"].get_group(), _mse)
    with torch.no_grad():
        schedule.eval(inputs) if is_first else schedule.eval(target=targets) if is_last else schedule.eval()
    with pytest.raises(NotImplementedError) as resharded:
        pipeline_step(schedule, is_first, is_last, inputs, targets)
    return str(unsharded.value), str(resharded.value)


def test_split_backward_over_a_stage_module_that_is_not_sharded_is_refused_and_eval_is_not():
    """A stage module holding ``fully_shard`` blocks without being one runs as a plain module, whose
    weight pass finds no parameter (torch's ``fully_shard`` trains such stages silently wrong or
    fails with a ``KeyError``): refused on every rank, naming the fix. ``eval()`` over blocks
    resharded after forward has no weight pass and runs."""
    for unsharded, resharded in run_on_ranks(4, _unsharded_stage_and_eval, "ScheduleInterleavedZeroBubble"):
        assert "are not fully_shard modules themselves" in unsharded and "Call fully_shard on each stage module" in unsharded
        assert "reshard_after_forward=False" in resharded and "stage " in resharded


class _GPT2Stage(nn.Module):
    """A cut of a Hugging Face GPT-2: the embeddings on the first stage, the final norm and the head on
    the last, transformer blocks on every one."""

    def __init__(self, model, blocks, first: bool, last: bool) -> None:
        super().__init__()
        self.wte, self.wpe = (model.transformer.wte, model.transformer.wpe) if first else (None, None)
        self.blocks = nn.ModuleList(blocks)
        self.ln_f, self.head = (model.transformer.ln_f, model.lm_head) if last else (None, None)

    def forward(self, x):
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
            x = x[0] if isinstance(x, tuple) else x
        return x if self.head is None else self.head(self.ln_f(x))


def _trained_gpt2(impl, schedule_name):
    from torch.distributed.pipelining import PipelineStage, schedules
    from transformers import GPT2Config, GPT2LMHeadModel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    config = GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=4, n_head=2, tie_word_embeddings=False,
                        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    pp_rank = mesh["pp"].get_local_rank()
    indices = stage_indices(schedule_name, pp_rank, 2)
    stage_count = 2 * len(indices)
    per_stage = config.n_layer // stage_count
    fully_shard = fully_shard_of(impl)
    stages, modules = [], []
    for index in indices:
        module = _GPT2Stage(model, model.transformer.h[index * per_stage:(index + 1) * per_stage], index == 0,
                            index == stage_count - 1)
        for block in module.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        modules.append(fully_shard(module, mesh=mesh["dp"]))
        stages.append(PipelineStage(module, index, stage_count, torch.device("cpu"), group=mesh["pp"].get_group()))
    schedule_class = getattr(schedules, schedule_name)
    single = issubclass(schedule_class, schedules.PipelineScheduleSingle)
    schedule = schedule_class(stages[0] if single else stages, n_microbatches=MICROBATCHES,
                              loss_fn=lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    optims = [torch.optim.AdamW(module.parameters(), lr=1e-2) for module in modules]
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(0, 61, (2 * MICROBATCHES, 6), generator=torch.Generator().manual_seed(step + 10 * mesh["dp"].get_local_rank()))
        losses.append(pipeline_step(schedule, 0 in indices, stage_count - 1 in indices, tokens, tokens))
        for optim in optims:
            optim.step()
            optim.zero_grad()
    values = [param.full_tensor().detach() for module in modules for param in module.parameters()]
    return losses, values


@pytest.mark.parametrize("schedule_name", ["ScheduleInterleavedZeroBubble"])
def test_hugging_face_gpt2_stages_train_as_torchs(schedule_name):
    """A GPT-2 cut into four stages (embeddings and a block; a block; a block; a block, the norm and
    the head), each block sharded, with ``import fsdp1`` alone: three steps of a split-backward
    schedule bitwise torch's."""
    ours = run_on_ranks(4, _trained_gpt2, "fsdp1", schedule_name)
    torchs = run_on_ranks(4, _trained_gpt2, "torch", schedule_name)
    for (losses, values), (torch_losses, torch_values) in zip(ours, torchs):
        assert all(torch.equal(a, b) for step, torch_step in zip(losses, torch_losses) for a, b in zip(step, torch_step))
        assert all(torch.equal(a, b) for a, b in zip(values, torch_values))


def _trained_tensor_parallel_pipeline(impl):
    """(pp=2, dp=2, tp=2): each block's MLP column- then row-parallel over tp, each block and stage
    sharded over dp, Schedule1F1B."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(0)
    blocks = [Residual(hidden=16) for _ in range(4)]  # split evenly over tp: the stage's shape inference needs it
    for block in blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    schedule, modules, is_first, is_last = _pipeline(impl, "Schedule1F1B", blocks, _shard_blocks(impl, mesh["dp"]),
                                                      mesh["pp"].get_group(), _mse)
    optim = torch.optim.AdamW(modules[0].parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        generator = torch.Generator().manual_seed(100 * step + mesh["dp"].get_local_rank())
        inputs, targets = torch.randn(2 * MICROBATCHES, DIM, generator=generator), torch.randn(2 * MICROBATCHES, DIM, generator=generator)
        losses.append(pipeline_step(schedule, is_first, is_last, inputs, targets))
        optim.step()
        optim.zero_grad()
    values = [param.full_tensor().detach() for param in modules[0].parameters()]
    return losses, values


def test_tensor_parallel_stages_train_as_torchs():
    """Tensor parallelism inside the stages, on 8 ranks: bitwise torch's."""
    ours = run_on_ranks(8, _trained_tensor_parallel_pipeline, "fsdp1")
    torchs = run_on_ranks(8, _trained_tensor_parallel_pipeline, "torch")
    for (losses, values), (torch_losses, torch_values) in zip(ours, torchs):
        assert all(torch.equal(a, b) for step, torch_step in zip(losses, torch_losses) for a, b in zip(step, torch_step))
        assert all(torch.equal(a, b) for a, b in zip(values, torch_values))
