"""A training step that allocates nothing: the model built on the meta device and trained for two
steps as rank 0 of a fake process group, with every storage, collective and FLOP counted.

On the meta device every tensor has its real size and no data, and the fake group's collectives
complete at once and move nothing, so counting live storage (``LiveStorageTracker``) gives the peak
one rank of the real run reaches: parameters, gradients, optimizer state, activations, gathered
units and every temporary, each at the moment it exists. Two steps, because the optimizer creates its
state during the first. What a formula would miss is there because the code that runs is the real
code: the wrapper's buffers, a Transformers model's masks and caches, the recomputation of
checkpointed blocks.

Two things differ on the meta device and are put right here:

* ``scaled_dot_product_attention`` has no fused kernel on the meta device, so it would fall back to
  the math path that keeps the T x T attention matrix. ``FusedAttention`` calls the fused kernel a
  real device runs instead (CPU: its flash kernel; CUDA: memory-efficient attention), whose meta
  versions allocate what the real kernels do.
* CPU offload is a no-op on the meta device, so the run keeps shards, their gradients and the
  optimizer state on the "device" and the tracker leaves their storages out afterwards
  (``LiveStorageTracker.peak_without``): their bytes are host memory.
"""

import contextlib
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, Type

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from .._engine.groups import FakeGroupsStandFor
from .._torch_internals import (
    TorchDispatchMode,
    efficient_attention,
    fake_store,
    flash_attention_for_cpu,
    local_tensor,
    storage_key,
    tree_leaves,
    tree_map,
)
from .live_memory import LiveStorageTracker
from .meta_forward import MetaForward, OutputShapes
from .settings import Settings, apply

META = torch.device("meta")
STEPS = 2
JOB_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
"""The backend a job on each device type runs, whose collectives' paths the dry run takes."""


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0, job_backend: Optional[str] = None) -> Iterator[None]:
    """Make this process ``rank`` of ``world_size`` ranks whose collectives move nothing, and which
    take the paths of ``job_backend``'s groups (``FakeGroupsStandFor``) where it is given."""
    if dist.is_initialized():
        raise RuntimeError("fsdp1: a fake process group replaces none: this process already has a default one.")
    excepthook = sys.excepthook  # init_process_group wraps it to prefix the rank, once a group made
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        with FakeGroupsStandFor(job_backend):
            yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


class CommBytes(TorchDispatchMode):
    """Bytes this rank sends, per collective kind, counted over each collective's own group: (n - 1) / n
    of an all-gather's output or a reduce-scatter's input, twice that of an all-reduce's tensor (ring),
    and for all-to-all what goes to the other ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.payload: Dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            name = func.__name__
            if name.startswith(("_allgather_base_", "allgather_")):
                self.payload["all_gather"] += int(_sent_share(args[2]) * _nbytes(args[0]))
            elif name.startswith(("_reduce_scatter_base_", "reduce_scatter_")):
                self.payload["reduce_scatter"] += int(_sent_share(args[2]) * _nbytes(args[1]))
            elif name.startswith("allreduce"):
                self.payload["all_reduce"] += int(2 * _sent_share(args[1]) * _nbytes(args[0]))
            elif name.startswith("alltoall_base_"):
                _, inputs, group, _, input_splits = args[:5]  # the splits are by rank of the group
                group = dist.ProcessGroup.unbox(group)
                to_self = input_splits[group.rank()] * inputs.element_size() if input_splits else _nbytes(inputs) // group.size()
                self.payload["all_to_all_sent"] += _nbytes(inputs) - to_self
        return func(*args, **(kwargs or {}))


def _sent_share(group: Any) -> float:
    """The share of a collective's full buffer one rank of ``group`` sends: (n - 1) / n."""
    size = dist.ProcessGroup.unbox(group).size()
    return (size - 1) / size


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return sum(_nbytes(o) for o in obj) if isinstance(obj, (list, tuple)) else 0


class FusedAttention:
    """While entered, ``torch.nn.functional.scaled_dot_product_attention`` runs the fused kernel that
    ``device_type`` runs (a context manager that swaps the function: a torch-function mode would be
    off during backward, where checkpointed blocks recompute)."""

    def __init__(self, device_type: str) -> None:
        self._device_type = device_type
        self._original: Optional[Callable[..., torch.Tensor]] = None

    def __enter__(self) -> "FusedAttention":
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._attend
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._original is not None
        F.scaled_dot_product_attention = self._original

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # made a float mask first, as sdpa does
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(~attn_mask, float("-inf"))
        if self._device_type == "cpu" and dropout_p > 0:  # no fused kernel on a CPU: the math path, as there
            assert self._original is not None
            return self._original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if self._device_type == "cpu":  # its flash kernel takes fewer key and value heads as they are
            return flash_attention_for_cpu(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if enable_gqa and key.shape[-3] != query.shape[-3]:  # memory-efficient attention wants every head
            repeats = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
        return efficient_attention(query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


@dataclass(frozen=True)
class Footprint:
    """What one rank holds and does in a training step of one candidate.

    ``peak``: bytes of tensor storage on the device at the step's busiest moment (host storages left
    out when offloaded); ``total``: the same with host storages counted (what a CPU, where offload
    moves nothing, holds); ``host``: bytes kept in host memory by offload; ``state``: parameters,
    gradients and optimizer state right after the optimizer step, wherever they live; ``comm``: bytes
    sent per kind of collective; ``flops``: forward and backward FLOPs, recomputation included;
    ``held``: elements of the parameters this rank's optimizer steps."""

    peak: int
    total: int
    host: int
    state: int
    comm: Dict[str, int] = field(default_factory=dict)
    flops: int = 0
    held: int = 0


@dataclass(frozen=True)
class Workload:
    """What the user trains: a model factory (called under the meta device), an example batch for one
    rank, the loss of the model on a batch, and the optimizer for the model's parameters."""

    build: Callable[[], nn.Module]
    batch: Any
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer]

    def scaled_batch(self, fraction: float) -> Any:
        """The example batch cut to ``fraction`` of its first dimension (at least one sample)."""
        def cut(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                return leaf[: max(1, int(leaf.shape[0] * fraction))]
            return leaf
        return tree_map(cut, self.batch)


class DryRun:
    """Runs candidates of one workload as rank 0 of a fake group of ``world_size`` ranks (entered by
    the caller: ``process_group``); ``mesh_shape``: (replicas, shard size) for hybrid sharding, else
    None."""

    def __init__(self, workload: Workload, classes: Tuple[Type[nn.Module], ...], device_type: str,
                 mesh_shape: Optional[Tuple[int, int]]) -> None:
        self.workload, self.classes, self.device_type, self.mesh_shape = workload, classes, device_type, mesh_shape
        # Bytes sent do not depend on checkpointing (a recomputed block is not gathered again), nor FLOPs
        # on sharding: each is counted once, by the first run that needs it.
        self._comm: Dict[Settings, Dict[str, int]] = {}
        self._flops: Dict[Tuple[int, int], int] = {}
        self._shapes: OutputShapes = {}

    def process_group(self, world_size: int) -> "contextlib.AbstractContextManager[None]":
        """The fake group to measure in, standing for the job's: gloo on the CPU, NCCL on CUDA."""
        return fake_process_group(world_size, job_backend=JOB_BACKENDS.get(self.device_type))

    def measure(self, settings: Settings, batch: Any = None) -> Footprint:
        """One candidate's footprint, on the example batch or on ``batch``."""
        forward, tracker, comm, flops = MetaForward(self._shapes), LiveStorageTracker(record=True), CommBytes(), _flop_counter()
        batch = forward.to_meta(self.workload.batch if batch is None else batch)
        host: Set[int] = set()
        with forward, tracker, FusedAttention(self.device_type), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The `NO_SHARD` sharding strategy is deprecated", FutureWarning)
            with META:
                model = self.workload.build()
            model = apply(settings, model, self.classes, self._mesh(), **self._meta_options(settings))
            forward.naming(model)
            optimizer = self.workload.optimizer(model.parameters())
            params = [p for group in optimizer.param_groups for p in group["params"]]
            host |= tracker.serials_of(params)
            tracker.reset_peak()
            for step in range(STEPS):
                self._backward(model, batch)
                host |= tracker.serials_of([p.grad for p in params])
                optimizer.step()
                host |= tracker.serials_of(list(optimizer.state.values()))
                if step == STEPS - 1:
                    state = _bytes([params, [p.grad for p in params], list(optimizer.state.values())])
                optimizer.zero_grad(set_to_none=True)
            total = tracker.peak
            peak = tracker.peak_without(host) if settings.offload else total
            comm_key, rows = settings.replace(checkpointed=0), first_dim(batch)
            if comm_key not in self._comm or self._known_flops(settings.checkpointed, rows) is None:
                with comm, flops:  # a step of its own: the FLOP counter keeps what checkpointing frees
                    self._backward(model, batch)
                self._comm[comm_key], self._flops[(settings.checkpointed, rows)] = dict(comm.payload), flops.get_total_flops()
        return Footprint(peak=peak, total=total, host=state if settings.offload else 0, state=state,
                         comm=self._comm[comm_key], flops=self._known_flops(settings.checkpointed, rows) or 0,
                         held=sum(_local_numel(p) for p in params))

    def _known_flops(self, checkpointed: int, rows: int) -> Optional[int]:
        """The FLOPs of a step checkpointing ``checkpointed`` blocks: counted, or on the line through two
        counts of the same batch (each block checkpointed recomputes one block's forward)."""
        if (checkpointed, rows) in self._flops:
            return self._flops[(checkpointed, rows)]
        counted = sorted(k for k, r in self._flops if r == rows)
        below, above = [k for k in counted if k < checkpointed], [k for k in counted if k > checkpointed]
        if not below or not above:
            return None
        low, high = below[-1], above[0]
        f_low, f_high = self._flops[(low, rows)], self._flops[(high, rows)]
        return f_low + (f_high - f_low) * (checkpointed - low) // (high - low)

    def _backward(self, model: nn.Module, batch: Any) -> None:
        loss = self.workload.loss(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            hint = " (a Transformers model's output: return its .loss)" if hasattr(loss, "logits") else ""
            raise ValueError(f"fsdp1.plan: loss(model, batch) returned {type(loss).__name__}"
                             f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}; "
                             f"return the scalar tensor a step calls backward() on{hint}.")
        loss.backward()

    def _mesh(self) -> Optional[Any]:
        if self.mesh_shape is None:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", self.mesh_shape)  # DTensor needs a real device type; nothing is allocated

    @staticmethod
    def _meta_options(settings: Settings) -> Dict[str, Any]:
        """FSDP1 keeps a meta-device model where it is when told the device is meta and handed an
        initialisation that does nothing."""
        if settings.api == "fully_shard":
            return {}
        return {"device_id": META, "param_init_fn": lambda module: None}


def first_dim(batch: Any) -> int:
    """The batch size: the first dimension of the batch's first tensor (0 when it has none)."""
    sizes = [leaf.shape[0] for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    return sizes[0] if sizes else 0


def _flop_counter() -> Any:
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


def _local_numel(param: torch.Tensor) -> int:
    local = local_tensor(param) if isinstance(param, DTensor) else param  # a DTensor counts what this rank holds
    return local.numel()


def _bytes(tree: List[Any]) -> int:
    """Bytes of the distinct storages in ``tree``."""
    from .live_memory import storages

    seen: Dict[int, int] = {}
    for storage in storages(tree):
        seen[storage_key(storage)] = storage.nbytes()
    return sum(seen.values())
