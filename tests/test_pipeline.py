"""Tests ``fully_shard`` stages under torch's pipeline schedules (``torch.distributed.pipelining``) on
a (pp=2, dp=2) mesh, against torch's ``fully_shard`` doing the same: with ``use_as_torch_fsdp`` in
effect the schedules recognise fsdp1's modules, keep them gathered and their gradients unreduced
across the micro-batches and reduce once at the end of the step, so the losses, the parameters and
the bytes gathered and reduced per step are torch's, the schedules that split backward into an
input and a weight pass included; where such a split cannot reach the parameters (blocks resharded
after forward, which torch's trains silently wrong) the step is refused. Also bf16, a Hugging Face
GPT-2 cut into stages, tensor parallelism inside the stages on 8 ranks, and the warning for stages
that do not recognise fsdp1's modules."""

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

import fsdp1
from fsdp1._planner.dry_run import CommBytes

from _harness import RankFailure, run_on_ranks
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


def _recognised(impl):
    """fsdp1's modules recognised by torch's schedules: fsdp1's names in torch's place."""
    return fsdp1.use_as_torch_fsdp() if impl == "fsdp1" else contextlib.nullcontext()


def _mixed_precision(impl):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = fsdp1.MixedPrecisionPolicy if impl == "fsdp1" else MixedPrecisionPolicy
    return {"mp_policy": policy(param_dtype=torch.bfloat16)}


def _trained_pipeline(impl, schedule_name, variant="fp32"):
    """Three AdamW steps; per step the losses, then every parameter's full value and the bytes one
    rank sent in the second step's gathers and reductions. ``variant``: "bf16" (a bf16
    ``MixedPrecisionPolicy``), "resharded" (blocks resharded after forward), "checkpointed" (each
    block's body under activation checkpointing; the stages hold no parameters of their own)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    blocks = [Residual(checkpointed=variant == "checkpointed") for _ in range(8)]
    kwargs = _mixed_precision(impl) if variant == "bf16" else {}
    shard = _shard_blocks(impl, mesh["dp"], reshard_blocks=variant == "resharded", **kwargs)
    with _recognised(impl):
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
    """Every schedule, the split ones included: losses and parameters bitwise torch's on every rank,
    each stage gathered once and reduced once per step, so no more bytes than torch's (fsdp1 run as a
    plain module gathered and reduced once per micro-batch: 4.5 times torch's bytes here)."""
    _assert_trained_as_torchs(schedule_name, "fp32")


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


def _assert_trained_as_torchs(schedule_name, variant):
    ours = run_on_ranks(4, _trained_pipeline, "fsdp1", schedule_name, variant)
    torchs = run_on_ranks(4, _trained_pipeline, "torch", schedule_name, variant)
    for (losses, values, sent), (torch_losses, torch_values, torch_sent) in zip(ours, torchs):
        assert len(losses) == STEPS and all(len(step) in (0, MICROBATCHES) for step in losses)
        assert all(torch.equal(a, b) for step, torch_step in zip(losses, torch_losses) for a, b in zip(step, torch_step))
        assert all(torch.equal(a, b) for a, b in zip(values, torch_values))
        assert 0 < sent <= torch_sent


def _split_backward_step(schedule_name):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    blocks = [Residual() for _ in range(8)]
    with fsdp1.use_as_torch_fsdp():
        shard = _shard_blocks("fsdp1", mesh["dp"], reshard_blocks=True)
        schedule, _, is_first, is_last = _pipeline("fsdp1", schedule_name, blocks, shard, mesh["pp"].get_group(), _mse)
        inputs = targets = torch.randn(2 * MICROBATCHES, DIM)
        pipeline_step(schedule, is_first, is_last, inputs, targets)


@pytest.mark.parametrize("schedule_name", SPLIT_BACKWARD[:1])  # the others refuse alike (the stack fuzzer keeps clear of it)
def test_split_backward_over_resharded_blocks_is_refused(schedule_name):
    """Blocks resharded after forward hold no parameters a split backward's weight pass can reach
    (torch's ``fully_shard`` then trains 0.02 off its own 1F1B after one step, silently): the first
    step is refused before any gradient is reduced, naming the fix (the first rank to refuse ends the
    others' wait for its messages)."""
    with pytest.raises(RankFailure, match="splits backward into an input pass and a weight pass") as refused:
        run_on_ranks(4, _split_backward_step, schedule_name)
    assert "reshard_after_forward=False" in str(refused.value)


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
    with _recognised(impl):
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
    the head), each block sharded: three steps of a split-backward schedule bitwise torch's."""
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
    with _recognised(impl):
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


def _warnings_of_plain_stages():
    """The same 1F1B pipeline with fsdp1's modules, once unrecognised and once recognised: the
    warnings each first step raised."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    caught = []
    for recognised in (False, True):
        with fsdp1.use_as_torch_fsdp() if recognised else contextlib.nullcontext():
            torch.manual_seed(0)
            stage_module = fsdp1.fully_shard(nn.Sequential(Residual(), Residual()), mesh=mesh["dp"])
            pp_rank = mesh["pp"].get_local_rank()
            stage = PipelineStage(stage_module, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
            schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=_mse)
            with warnings.catch_warnings(record=True) as during_step:
                warnings.simplefilter("always")
                inputs = targets = torch.randn(2 * MICROBATCHES, DIM)
                pipeline_step(schedule, pp_rank == 0, pp_rank == 1, inputs, targets)
            caught.append([str(warning.message) for warning in during_step if "fsdp1" in str(warning.message)])
    return caught


def test_stages_that_do_not_recognise_fsdp1_say_so():
    """Without ``use_as_torch_fsdp`` torch's schedules run fsdp1's modules as plain modules (a split
    backward then computes no weight gradient): the first forward under such a stage warns, naming
    the fix, on every rank; recognised, nothing is said."""
    for unrecognised, recognised in run_on_ranks(4, _warnings_of_plain_stages):
        assert len(unrecognised) == 1 and "use_as_torch_fsdp()" in unrecognised[0]
        assert recognised == []
