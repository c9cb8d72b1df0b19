"""Public enums and configuration dataclasses, named and ordered as in ``torch.distributed.fsdp.api``.

Pure data: this module imports nothing of fsdp1, so every other module can use it. ``coerce_enum``
and ``coerce_config`` let a script pass torch's own enum members
(``torch.distributed.fsdp.ShardingStrategy.FULL_SHARD``) and config objects wherever fsdp1 expects its
own, which keeps scripts written for torch's FSDP1, and clients that build torch's objects (HF
Accelerate), running unchanged.
"""

import dataclasses
import operator
from dataclasses import dataclass
from enum import Enum, auto
from typing import Callable, Optional, Sequence, Tuple, Type, TypeVar, Union

import torch

from ._torch_internals import BatchNormBase

__all__ = [
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "StateDictSettings",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
]


class ShardingStrategy(Enum):
    """How parameters, gradients and optimizer state are split over the ranks of the FSDP group.

    FULL_SHARD shards all three and frees the unsharded parameters after each unit's forward;
    SHARD_GRAD_OP keeps them from forward until the end of backward; NO_SHARD replicates like DDP.
    The hybrid strategies shard within one group and replicate across another.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    """When the next unit's all-gather is issued in backward, relative to the current unit's gradient."""

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass
class MixedPrecision:
    """Dtypes used for the unsharded parameters, the gradient reduction and the buffers."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[Type[torch.nn.Module]] = (BatchNormBase,)


@dataclass
class CPUOffload:
    """Whether the sharded parameters (and so their gradients and the optimizer step) live on CPU."""

    offload_params: bool = False


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``fully_shard``'s mixed precision: ``param_dtype`` for the all-gather and the computation,
    ``reduce_dtype`` for the gradient reduction (None: the gradient's dtype), ``output_dtype`` for
    the module's floating-point outputs, and ``cast_forward_inputs`` to cast every fully_shard
    module's floating-point inputs to ``param_dtype``. The sharded parameters, their gradients and
    the buffers keep their own dtype."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Optional[Callable[[torch.nn.Parameter], Optional[torch.dtype]]] = dataclasses.field(
        default=None, kw_only=True)
    """Per parameter, at ``fully_shard``: None or ``param_dtype`` gathers it in ``param_dtype``, its own
    dtype keeps it in that (torch 2.15's field, offered on every release)."""


@dataclass
class OffloadPolicy:
    """``fully_shard``'s default: nothing is offloaded."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """The sharded parameters and their gradients live on the CPU, where the optimizer steps them;
    each all-gather copies the shard to the compute device first. ``pin_memory`` pins the CPU copies
    where a GPU exists (on a CPU-only host there is nothing to move, and it is accepted)."""

    pin_memory: bool = True


@dataclass
class DataParallelMeshDims:
    """Names the data-parallel dimensions of a whole SPMD mesh whose parameters are DTensors on it
    already (``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)``): at least one is required; several
    names of one kind are flattened into one dimension."""

    shard: Optional[Union[str, Tuple[str, ...]]] = None
    replicate: Optional[Union[str, Tuple[str, ...]]] = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")  # torch's

    @property
    def shard_names(self) -> Tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> Tuple[str, ...]:
        return _names(self.replicate)


QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
"""The dtypes ``BlockQuantization`` sends values as: symmetric int8, and float8 e4m3."""

MAX_BLOCK_SIZE = 1 << 16


@dataclass(frozen=True)
class BlockQuantization:
    """fsdp1's own, not torch's: the ``comm_quantization`` argument of ``FullyShardedDataParallel``
    and ``fully_shard``, which makes a unit's collectives send fewer bytes.

    ``weights``: the all-gathers forward and backward compute on send each rank's shard as codes of
    this dtype with one float32 scale per ``block_size`` values (the block's largest magnitude over
    the dtype's), dequantized into the compute dtype on arrival. ``gradients``: the reduction sends
    each rank's unreduced pieces of the other ranks' shards so, through an all-to-all, and every rank
    sums what it receives in float32 with its own piece, unquantized. ``None`` leaves that direction
    as it is. What a unit keeps never changes: its shard (the master weights), the optimizer's
    arithmetic on the reduced gradient, ``summon_full_params`` and every state dict hold the
    full-precision values.
    """

    weights: Optional[torch.dtype] = torch.int8
    gradients: Optional[torch.dtype] = torch.int8
    block_size: int = 256

    def __post_init__(self) -> None:
        for name, dtype in (("weights", self.weights), ("gradients", self.gradients)):
            if dtype is not None and dtype not in QUANTIZED_DTYPES:
                raise ValueError(f"BlockQuantization({name}={dtype!r}): expected one of {list(QUANTIZED_DTYPES)}, or None "
                                 "to send that direction unquantized")
        try:  # numpy's integers too (a size read from a config), kept as a plain int
            block_size = operator.index(self.block_size)
        except TypeError:
            block_size = None
        if isinstance(self.block_size, bool) or block_size is None or not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"BlockQuantization(block_size={self.block_size!r}): expected an int from 1 to {MAX_BLOCK_SIZE:,}, "
                             "the values that share one scale (256 by default; a larger block saves no bytes, as a "
                             "scale is 4 bytes, and pads each shard's last block)")
        object.__setattr__(self, "block_size", block_size)


def check_comm_quantization(value: object, where: str) -> None:
    """``comm_quantization`` is a ``BlockQuantization`` or None."""
    if value is not None and not isinstance(value, BlockQuantization):
        raise TypeError(f"fsdp1: {where}(comm_quantization=...) expects fsdp1.BlockQuantization(weights=..., "
                        f"gradients=..., block_size=...) or None, got {type(value).__name__}")


def _names(dims: Optional[Union[str, Tuple[str, ...]]]) -> Tuple[str, ...]:
    if dims is None:
        return ()
    return (dims,) if isinstance(dims, str) else tuple(dims)


class StateDictType(Enum):
    """Which form ``state_dict()`` returns and ``load_state_dict()`` expects."""

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Base of the model state-dict configurations."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """FULL_STATE_DICT options: with ``rank0_only`` the other ranks return an empty dict."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """LOCAL_STATE_DICT options."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """SHARDED_STATE_DICT options."""

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configurations (note: offloads by default, unlike the model's)."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Full optimizer state-dict options."""

    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Local optimizer state-dict options."""

    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Sharded optimizer state-dict options."""

    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    """What ``set_state_dict_type`` / ``get_state_dict_type`` hand back."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


EnumT = TypeVar("EnumT", bound=Enum)


def coerce_enum(value: Enum, enum_cls: Type[EnumT], argument: str) -> EnumT:
    """Return ``enum_cls``'s member of the same name as ``value`` (torch's enums and ours share names)."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, Enum) and value.name in enum_cls.__members__:
        return enum_cls[value.name]
    names = ", ".join(f"{enum_cls.__name__}.{n}" for n in enum_cls.__members__)
    raise ValueError(f"fsdp1: {argument}={value!r} is not one of {names}.")


ConfigT = TypeVar("ConfigT")

STATE_DICT_CONFIG_TYPES = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}
"""The model and optimizer config classes each state-dict type takes."""


def coerce_config(config: object, config_cls: Type[ConfigT], argument: str, purpose: str = "") -> ConfigT:
    """``config`` as an instance of ``config_cls``: ours as it is, torch's class of the same name
    (a dataclass with the same fields) converted field by field. Any other class is an error that
    names what the argument needs (and ``purpose``, what it is needed for)."""
    if type(config) is config_cls:
        return config
    if dataclasses.is_dataclass(config) and type(config).__name__ == config_cls.__name__:
        names = [field.name for field in dataclasses.fields(config_cls)]  # type: ignore[arg-type]  # ConfigT: dataclasses
        return config_cls(**{name: getattr(config, name) for name in names if hasattr(config, name)})
    raise RuntimeError(
        f"fsdp1: Expected {argument} of type {config_cls.__name__}{purpose}, but got "  # torch's phrase
        f"{type(config).__name__}; pass {config_cls.__name__}(...) (fsdp1's or torch's)."
    )
