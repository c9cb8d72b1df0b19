"""What the benchmark and the memory estimator run: the example's GPT at a chosen size, its batch and
loss, and every wrapper variant, each wrapped with one unit per block plus the root."""

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, ContextManager, Dict, Optional

import torch
from torch import nn
from torch.nn import functional as F

import fsdp1

from examples.train_gpt import GPT, Block, state_bytes  # noqa: F401 - the example's model and its memory count, so every tool measures the same code


@dataclass(frozen=True)
class GPTSize:
    """The benchmark's CPU configuration by default (5.29 M parameters)."""

    vocab: int = 4096
    seq: int = 128
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    batch: int = 2  # sequences per rank and step

    def make_model(self) -> nn.Module:
        return GPT(self.vocab, self.seq, self.d_model, self.layers, self.heads)

    def make_batch(self, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=generator)
        return tokens.to(device)

    def loss(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    if isinstance(model, _Clipped):
        return _ClippingAdamW(model.parameters(), model.clip, lr=1e-3, foreach=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


class _Clipped(nn.Module):
    """A wrapped model whose optimizer clips the gradient norm to 1.0 before each step, with the
    wrapper's own ``clip_grad_norm_`` (the step the ``*_clip`` variants measure)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def clip(self) -> None:
        self.model.clip_grad_norm_(1.0)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class _ClippingAdamW(torch.optim.AdamW):
    def __init__(self, params, clip: Callable[[], None], **kwargs) -> None:
        super().__init__(params, **kwargs)
        self._clip = clip

    def step(self, closure=None):
        self._clip()
        return super().step(closure)


BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
"""The mixed precision of the ``*_bf16`` variants: bf16 gathers and compute, fp32 reduction
(the GPU configuration)."""

INT8 = fsdp1.BlockQuantization(weights=torch.int8, gradients=torch.int8)
"""fsdp1's block-quantized communication of the ``*_q8`` variants: int8 weight gathers and gradient
reductions, one float32 scale per 256 values."""


def _fsdp1(strategy: str, use_orig_params: bool, model: nn.Module, device: torch.device, **options) -> nn.Module:
    """fsdp1 with one unit per block; ``options``: mixed_precision / cpu_offload as keyword dicts,
    ``comm_hook`` to register fsdp1's default reduce-scatter hook."""
    hook = options.pop("comm_hook", False)
    wrapped = fsdp1.FullyShardedDataParallel(
        model, sharding_strategy=fsdp1.ShardingStrategy[strategy], auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params, device_id=device,
        mixed_precision=fsdp1.MixedPrecision(**options["mixed_precision"]) if "mixed_precision" in options else None,
        cpu_offload=fsdp1.CPUOffload(**options["cpu_offload"]) if "cpu_offload" in options else None,
        comm_quantization=options.get("comm_quantization"))
    if hook:
        wrapped.register_comm_hook(fsdp1.comm_hooks.DefaultState(torch.distributed.group.WORLD),
                                   fsdp1.comm_hooks.reduce_scatter_hook)
    return wrapped


def _torch_fsdp1(strategy: str, use_orig_params: bool, model: nn.Module, device: torch.device, **options) -> nn.Module:
    """torch's FSDP1 wrapped as ``_fsdp1`` wraps, with the same options (torch's hook for ``comm_hook``)."""
    from torch.distributed.algorithms._comm_hooks import default_hooks
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    hook = options.pop("comm_hook", False)
    wrapped = FullyShardedDataParallel(
        model, sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params, device_id=device,
        mixed_precision=MixedPrecision(**options["mixed_precision"]) if "mixed_precision" in options else None,
        cpu_offload=CPUOffload(**options["cpu_offload"]) if "cpu_offload" in options else None)
    if hook:
        wrapped.register_comm_hook(default_hooks.DefaultState(torch.distributed.group.WORLD), default_hooks.reduce_scatter_hook)
    return wrapped


def _hybrid_mesh(device: torch.device):
    """Replicas × shard groups of two ranks (one replica on two ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = torch.distributed.get_world_size()
    shape = (world_size // 2, 2) if world_size % 2 == 0 else (1, world_size)
    return init_device_mesh(device.type, shape)


def _fsdp1_hybrid(model: nn.Module, device: torch.device, comm_quantization: Optional[fsdp1.BlockQuantization] = None) -> nn.Module:
    return fsdp1.FullyShardedDataParallel(
        model, sharding_strategy=fsdp1.ShardingStrategy.HYBRID_SHARD, device_mesh=_hybrid_mesh(device),
        auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}), device_id=device, comm_quantization=comm_quantization)


def _torch_fsdp1_hybrid(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=_hybrid_mesh(device),
        auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device)


def _frozen_attention(wrapper: "Wrapper", model: nn.Module, device: torch.device) -> nn.Module:
    """Attention frozen in every block (fine-tuning the MLPs): units mix frozen and trainable."""
    for block in model.blocks:
        block.qkv.requires_grad_(False)
        block.proj.requires_grad_(False)
    return wrapper(model, device)


def _torch_fsdp2(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model.to(device)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _fsdp1_fully_shard(model: nn.Module, device: torch.device, **options) -> nn.Module:
    model.to(device)
    for block in model.blocks:
        fsdp1.fully_shard(block, **options)
    return fsdp1.fully_shard(model, **options)


def _tensor_parallel(shard: Callable[..., nn.Module], model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP + TP on a (world / 2, 2) mesh: each block's MLP column- then row-parallel over ``tp``,
    then every block and the root sharded over ``dp`` by ``shard`` (fsdp1's or torch's fully_shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh_device = "cpu" if device.type == "meta" else device.type  # the memory estimator's dry run: DTensor needs a real device type
    mesh = init_device_mesh(mesh_device, (torch.distributed.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    model.to(device)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
        shard(block, mesh=mesh["dp"])
    return shard(model, mesh=mesh["dp"])


def _float8(shard: Callable[[nn.Module, torch.device], nn.Module], model: nn.Module, device: torch.device) -> nn.Module:
    """torchao's float8 training with float8 all-gathers: every Linear computes in float8 and its
    weight casts itself to float8 before the gather (emulated where the device has no float8 matmul),
    then the blocks and the root are sharded by ``shard``."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    emulate = device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate))
    return shard(model, device)


class Pipelined(nn.Module):
    """The GPT cut into two pipeline stages over the ``pp`` dim of a (2, world / 2) mesh (embeddings and
    the first half of the blocks; the rest, the final norm and the head), each block (kept gathered
    across the micro-batches) and the stage sharded over ``dp`` by ``shard``, driven by torch's
    ``Schedule1F1B`` with ``MICROBATCHES`` micro-batches. ``recognised`` is in effect while it is built
    and while it steps: fsdp1's ``use_as_torch_fsdp``, so that the schedule recognises fsdp1's
    modules, and for torch's nothing. A step is the schedule's (``forward_backward``); each rank
    repeats its batch to one sequence per micro-batch and feeds it to its stage (the first takes the
    inputs, the last the targets)."""

    MICROBATCHES = 8

    def __init__(self, model: nn.Module, device: torch.device, shard: Callable[..., nn.Module],
                 recognised: Callable[[], ContextManager[object]]) -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self._recognised = recognised
        mesh = init_device_mesh(device.type, (2, torch.distributed.get_world_size() // 2), mesh_dim_names=("pp", "dp"))
        self.is_first = mesh["pp"].get_local_rank() == 0
        half = len(model.blocks) // 2
        with recognised():
            self.stage = _GPTStage(model, self.is_first, half).to(device)
            for block in self.stage.blocks:
                shard(block, mesh=mesh["dp"], reshard_after_forward=False)
            shard(self.stage, mesh=mesh["dp"])
            stage = PipelineStage(self.stage, mesh["pp"].get_local_rank(), 2, device, group=mesh["pp"].get_group())
            self._schedule = Schedule1F1B(stage, n_microbatches=self.MICROBATCHES, loss_fn=self._loss)

    @staticmethod
    def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        """One schedule step; the mean of the micro-batches' losses on the last stage, zero on the first."""
        tokens = tokens.repeat(-(-self.MICROBATCHES // tokens.shape[0]), 1)
        losses: list = []
        with self._recognised():
            if self.is_first:
                self._schedule.step(tokens[:, :-1])
                return torch.zeros(())
            self._schedule.step(target=tokens[:, 1:], losses=losses)
        return torch.stack(losses).mean().detach()


class _GPTStage(nn.Module):
    """Half of the GPT: the embeddings and the first ``half`` blocks, or the other blocks, the final
    norm and the head."""

    def __init__(self, model: nn.Module, first: bool, half: int) -> None:
        super().__init__()
        self.first = first
        self.embeddings = nn.ModuleList([model.tok, model.pos] if first else [])
        self.blocks = nn.Sequential(*(list(model.blocks)[:half] if first else list(model.blocks)[half:]))
        self.end = nn.ModuleList([] if first else [model.ln_f, model.head])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            tok, pos = self.embeddings
            x = tok(x) + pos(torch.arange(x.shape[1], device=x.device))
        x = self.blocks(x)
        if not self.first:
            ln_f, head = self.end
            x = head(ln_f(x))
        return x


def forward_backward(size: GPTSize, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """One step's forward and backward, as the variant runs it; its loss."""
    if isinstance(model, Pipelined):
        return model.forward_backward(tokens)
    loss = size.loss(model, tokens)
    loss.backward()
    return loss


def _torch_fully_shard(*args, **kwargs) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(*args, **kwargs)


def _ddp(model: nn.Module, device: torch.device) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model.to(device))


def _local(model: nn.Module, device: torch.device) -> nn.Module:
    return model.to(device)


Wrapper = Callable[[nn.Module, torch.device], nn.Module]

VARIANTS: Dict[str, Wrapper] = {
    "local": _local,
    "local_aa": _local,
    "ddp": _ddp,
    "torch_fsdp1_full": partial(_torch_fsdp1, "FULL_SHARD", False),
    "fsdp1_full": partial(_fsdp1, "FULL_SHARD", False),
    "torch_fsdp1_full_orig": partial(_torch_fsdp1, "FULL_SHARD", True),
    "fsdp1_full_orig": partial(_fsdp1, "FULL_SHARD", True),
    "torch_fsdp1_grad_op": partial(_torch_fsdp1, "SHARD_GRAD_OP", False),
    "fsdp1_grad_op": partial(_fsdp1, "SHARD_GRAD_OP", False),
    "torch_fsdp1_no_shard": partial(_torch_fsdp1, "NO_SHARD", False),
    "fsdp1_no_shard": partial(_fsdp1, "NO_SHARD", False),
    "torch_fsdp1_hybrid": _torch_fsdp1_hybrid,
    "fsdp1_hybrid": _fsdp1_hybrid,
    "torch_fsdp1_frozen_orig": partial(_frozen_attention, partial(_torch_fsdp1, "FULL_SHARD", True)),
    "fsdp1_frozen_orig": partial(_frozen_attention, partial(_fsdp1, "FULL_SHARD", True)),
    "torch_fsdp1_full_clip": lambda model, device: _Clipped(_torch_fsdp1("FULL_SHARD", False, model, device)),
    "fsdp1_full_clip": lambda model, device: _Clipped(_fsdp1("FULL_SHARD", False, model, device)),
    "torch_fsdp1_full_bf16": partial(_torch_fsdp1, "FULL_SHARD", False, mixed_precision=BF16),
    "fsdp1_full_bf16": partial(_fsdp1, "FULL_SHARD", False, mixed_precision=BF16),
    "torch_fsdp1_full_offload": partial(_torch_fsdp1, "FULL_SHARD", False, cpu_offload=dict(offload_params=True)),
    "fsdp1_full_offload": partial(_fsdp1, "FULL_SHARD", False, cpu_offload=dict(offload_params=True)),
    "torch_fsdp1_full_hook": partial(_torch_fsdp1, "FULL_SHARD", False, comm_hook=True),
    "fsdp1_full_hook": partial(_fsdp1, "FULL_SHARD", False, comm_hook=True),
    "fsdp1_full_q8": partial(_fsdp1, "FULL_SHARD", False, comm_quantization=INT8),
    "fsdp1_full_bf16_q8": partial(_fsdp1, "FULL_SHARD", False, mixed_precision=BF16, comm_quantization=INT8),
    "fsdp1_hybrid_q8": partial(_fsdp1_hybrid, comm_quantization=INT8),
    "torch_fsdp2": _torch_fsdp2,
    "fsdp1_fsdp2": _fsdp1_fully_shard,
    "fsdp1_fsdp2_q8": partial(_fsdp1_fully_shard, comm_quantization=INT8),
    "torch_fsdp2_tp": partial(_tensor_parallel, _torch_fully_shard),
    "fsdp1_fsdp2_tp": partial(_tensor_parallel, fsdp1.fully_shard),
    "torch_fsdp2_float8": partial(_float8, _torch_fsdp2),
    "fsdp1_fsdp2_float8": partial(_float8, _fsdp1_fully_shard),
    "torch_fsdp2_pp": lambda model, device: Pipelined(model, device, _torch_fully_shard, contextlib.nullcontext),
    "fsdp1_fsdp2_pp": lambda model, device: Pipelined(model, device, fsdp1.fully_shard, fsdp1.use_as_torch_fsdp),
}
"""Every variant the benchmark measures; ``local`` is the model alone (the compute floor) and
``local_aa`` the same again, as the A/A noise control."""

ANCHOR = {"fsdp1_full": "torch_fsdp1_full", "fsdp1_full_orig": "torch_fsdp1_full_orig",
          "fsdp1_grad_op": "torch_fsdp1_grad_op", "fsdp1_no_shard": "torch_fsdp1_no_shard",
          "fsdp1_hybrid": "torch_fsdp1_hybrid", "fsdp1_frozen_orig": "torch_fsdp1_frozen_orig",
          "fsdp1_full_clip": "torch_fsdp1_full_clip", "fsdp1_full_bf16": "torch_fsdp1_full_bf16",
          "fsdp1_full_offload": "torch_fsdp1_full_offload", "fsdp1_full_hook": "torch_fsdp1_full_hook",
          "fsdp1_full_q8": "torch_fsdp1_full", "fsdp1_full_bf16_q8": "torch_fsdp1_full_bf16",
          "fsdp1_hybrid_q8": "torch_fsdp1_hybrid", "fsdp1_fsdp2_q8": "torch_fsdp2",
          "fsdp1_fsdp2": "torch_fsdp2", "fsdp1_fsdp2_tp": "torch_fsdp2_tp", "fsdp1_fsdp2_pp": "torch_fsdp2_pp",
          "fsdp1_fsdp2_float8": "torch_fsdp2_float8",
          "local_aa": "local"}
"""The variant each one is compared with, round by round."""

CUDA_ONLY = {"torch_fsdp1_full_offload"}
"""Variants that cannot run on a CPU-only machine: torch's CPUOffload pins memory, which needs an
accelerator."""

CPU_ANCHOR = {"fsdp1_full_offload": "torch_fsdp1_full"}
"""The anchor on CPU where the usual one is CUDA-only: there the parameters already live on the CPU,
so offloading does the work of the plain variant."""
