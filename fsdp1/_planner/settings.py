"""One way to shard a model (``Settings``), and the one place that turns it into calls: on the model
(``apply``) and as the code a user can paste (``code``), so what the planner measured, what it
applies and what it prints cannot drift apart.

The units are always the model's repeated blocks plus the root, the split every FSDP user starts
from: a coarser split gathers more at once, a finer one issues more, smaller collectives. What
varies is what trades memory for speed: how much stays gathered between forward and backward (the
FSDP1 sharding strategy, or ``reshard_after_forward`` per block), the first ``checkpointed`` blocks
recomputed in backward, the precision of gathers and compute, CPU offload, and FSDP1's backward
prefetch. Checkpointing is applied after sharding, by torch's ``apply_activation_checkpointing``
with a test of identity, so the blocks keep their names and the same call serves both APIs.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
from torch import nn

from .._fully_shard.fully_shard import fully_shard
from .._torch_internals import checkpoint_wrapper_api
from .._wrapper.fully_sharded_data_parallel import FullyShardedDataParallel
from ..api import (
    BackwardPrefetch,
    BlockQuantization,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from ..wrap import ModuleWrapPolicy

FSDP1, FULLY_SHARD = "FullyShardedDataParallel", "fully_shard"
APIS = (FSDP1, FULLY_SHARD)


@dataclass(frozen=True)
class Settings:
    """The choices of one candidate. ``strategy``: the FSDP1 sharding strategy (with ``fully_shard``,
    FULL_SHARD or SHARD_GRAD_OP, the ends of ``kept_gathered``); ``kept_gathered``: with
    ``fully_shard``, how many blocks, the last ones (their backward comes first), keep their
    parameters gathered from forward to backward (``reshard_after_forward=False``);
    ``checkpointed``: how many blocks, the first ones, recompute their activations in backward;
    ``use_orig_params``: FSDP1's, set when the model has frozen parameters (a unit may then mix
    frozen and trainable ones); ``quantized``: the gathers and reductions send int8
    (``comm_quantization=BlockQuantization()``), offered where communication dominates the step."""

    api: str
    strategy: ShardingStrategy
    checkpointed: int = 0
    kept_gathered: int = 0
    param_dtype: Optional[torch.dtype] = None
    offload: bool = False
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    use_orig_params: bool = False
    quantized: bool = False

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    def describe(self, blocks: int) -> str:
        """A short human description, as the plan's table prints it."""
        if self.api == FULLY_SHARD:
            sharding = ("reshard all" if self.kept_gathered == 0 else "keep all gathered" if self.kept_gathered == blocks
                        else f"keep last {self.kept_gathered} gathered")
        else:
            sharding = self.strategy.name
        parts = [sharding, f"AC {self.checkpointed}/{blocks}"]
        if self.param_dtype is not None:
            parts.append(dtype_name(self.param_dtype))
        if self.offload:
            parts.append("CPU offload")
        if self.quantized:
            parts.append("int8 comm")
        if self.api == FSDP1 and self.backward_prefetch is not BackwardPrefetch.BACKWARD_PRE:
            parts.append(f"backward_prefetch={_enum_code(self.backward_prefetch)}")
        return ", ".join(parts)


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """A compute dtype's name, the key of ``Calibration.matmul_flops`` (None: full precision, float32)."""
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


def find_blocks(model: nn.Module, block_classes: Union[None, Type[nn.Module], Sequence[Type[nn.Module]]]
                ) -> Tuple[Type[nn.Module], ...]:
    """The block classes: ``block_classes``, or the class of the children of the model's largest list
    of same-class modules (a transformer's layers), which may repeat elsewhere (T5's two stacks)."""
    if isinstance(block_classes, type):
        block_classes = [block_classes]
    if block_classes:
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in block_classes):
            raise ValueError(f"fsdp1.plan: blocks={block_classes!r}; pass the module classes to make units of, "
                             "e.g. blocks=[LlamaDecoderLayer].")
        return tuple(block_classes)
    best: Optional[Tuple[int, Type[nn.Module]]] = None
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            classes = {type(child) for child in module}
            size = sum(p.numel() for p in module.parameters())
            if len(classes) == 1 and size and (best is None or size > best[0]):
                best = (size, classes.pop())
    if best is None:
        raise ValueError("fsdp1.plan: found no list of repeated blocks (an nn.ModuleList or nn.Sequential of "
                         "one class) in the model to make units of. Pass blocks=[YourBlockClass].")
    return (best[1],)


def blocks_of(model: nn.Module, classes: Tuple[Type[nn.Module], ...]) -> List[nn.Module]:
    """The model's blocks in registration order (the order they run in, for the models planned)."""
    return [module for module in model.modules() if isinstance(module, classes)]


def apply(settings: Settings, model: nn.Module, classes: Tuple[Type[nn.Module], ...], mesh: Optional[Any],
          **fsdp_kwargs: Any) -> nn.Module:
    """Shard ``model`` as ``settings`` say, then checkpoint its first blocks; returns the root.
    ``mesh``: the device mesh (FSDP1: HYBRID strategies only); ``fsdp_kwargs`` go to the FSDP1
    constructor or to every ``fully_shard`` call."""
    blocks = blocks_of(model, classes)
    checkpointed = set(blocks[: settings.checkpointed])
    if settings.quantized:
        fsdp_kwargs["comm_quantization"] = BlockQuantization()
    if settings.api == FSDP1:
        if mesh is not None:
            fsdp_kwargs["device_mesh"] = mesh
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy(set(classes)), sharding_strategy=settings.strategy,
            mixed_precision=_fsdp1_precision(settings), cpu_offload=CPUOffload(offload_params=settings.offload),
            backward_prefetch=settings.backward_prefetch, use_orig_params=settings.use_orig_params, **fsdp_kwargs)
    else:
        keep_from = len(blocks) - settings.kept_gathered
        precision = _fully_shard_precision(settings)
        offload = CPUOffloadPolicy() if settings.offload else OffloadPolicy()
        for index, block in enumerate(blocks):
            fully_shard(block, mesh=mesh, reshard_after_forward=index < keep_from, mp_policy=precision,
                        offload_policy=offload, **fsdp_kwargs)
        fully_shard(model, mesh=mesh, mp_policy=precision, offload_policy=offload, **fsdp_kwargs)
    if checkpointed:
        _checkpoint(model, checkpointed)
    return model


def _checkpoint(model: nn.Module, blocks: Set[nn.Module]) -> None:
    """Put each of ``blocks`` inside torch's ``checkpoint_wrapper`` where it stands, as torch's
    ``apply_activation_checkpointing`` would, without it: that one imports torch's FSDP1 to walk the
    model, which fsdp1 needs nothing of."""
    api = checkpoint_wrapper_api()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if child in blocks:
                setattr(parent, name, api.checkpoint_wrapper(child, checkpoint_impl=api.CheckpointImpl.NO_REENTRANT))


def code(settings: Settings, classes: Tuple[Type[nn.Module], ...], num_blocks: int, hybrid: bool) -> str:
    """``apply`` as Python a user can paste after building ``model`` (and ``mesh`` when ``hybrid``)."""
    names = ", ".join(c.__name__ for c in classes)
    lines = [f"from {classes[0].__module__} import {names}",
             "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing",
             "import torch", "import fsdp1", "",
             f"blocks = [m for m in model.modules() if isinstance(m, ({names},))]"]
    mesh = ", mesh=mesh" if hybrid else ""
    if settings.api == FSDP1:
        arguments = [f"auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({{{names}}})",
                     f"sharding_strategy=fsdp1.ShardingStrategy.{settings.strategy.name}"]
        if settings.param_dtype is not None:
            arguments.append(f"mixed_precision=fsdp1.MixedPrecision(param_dtype={settings.param_dtype}, "
                             "reduce_dtype=torch.float32)")
        if settings.offload:
            arguments.append("cpu_offload=fsdp1.CPUOffload(offload_params=True)")
        if settings.backward_prefetch is not BackwardPrefetch.BACKWARD_PRE:
            arguments.append(f"backward_prefetch={_enum_code(settings.backward_prefetch)}")
        if settings.use_orig_params:
            arguments.append("use_orig_params=True")
        if settings.quantized:
            arguments.append("comm_quantization=fsdp1.BlockQuantization()")
        if hybrid:
            arguments.append("device_mesh=mesh")
        lines.append("model = fsdp1.FullyShardedDataParallel(model, " + ", ".join(arguments) + ")")
    else:
        policies = ""
        if settings.param_dtype is not None:
            policies += f", mp_policy=fsdp1.MixedPrecisionPolicy(param_dtype={settings.param_dtype}, reduce_dtype=torch.float32)"
        if settings.offload:
            policies += ", offload_policy=fsdp1.CPUOffloadPolicy()"
        if settings.quantized:
            policies += ", comm_quantization=fsdp1.BlockQuantization()"
        keep = ("True" if settings.kept_gathered == 0 else "False" if settings.kept_gathered == num_blocks
                else f"i < len(blocks) - {settings.kept_gathered}")
        lines += ["for i, block in enumerate(blocks):",
                  f"    fsdp1.fully_shard(block{mesh}, reshard_after_forward={keep}{policies})",
                  f"fsdp1.fully_shard(model{mesh}{policies})"]
    if settings.checkpointed:
        lines += [f"checkpointed = set(blocks[:{settings.checkpointed}])",
                  "apply_activation_checkpointing(model, check_fn=lambda m: m in checkpointed)"]
    return "\n".join(lines) + "\n"


def _enum_code(value: Optional[BackwardPrefetch]) -> str:
    return "None" if value is None else f"fsdp1.BackwardPrefetch.{value.name}"


def _fsdp1_precision(settings: Settings) -> Optional[MixedPrecision]:
    if settings.param_dtype is None:
        return None
    return MixedPrecision(param_dtype=settings.param_dtype, reduce_dtype=torch.float32)


def _fully_shard_precision(settings: Settings) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=settings.param_dtype, reduce_dtype=torch.float32 if settings.param_dtype else None)


def settings_dict(settings: Settings) -> Dict[str, Any]:
    """The settings as plain data (for JSON output)."""
    return {"api": settings.api, "strategy": settings.strategy.name, "checkpointed": settings.checkpointed,
            "kept_gathered": settings.kept_gathered,
            "param_dtype": None if settings.param_dtype is None else dtype_name(settings.param_dtype),
            "offload": settings.offload,
            "backward_prefetch": None if settings.backward_prefetch is None else settings.backward_prefetch.name,
            "use_orig_params": settings.use_orig_params, "quantized": settings.quantized}
