"""``plan()``: the question "will it fit on N devices of M GiB, and with which settings?" answered
by dry runs (``dry_run``), a pruned search (``search``) and a calibrated cost model (``cost``), and
``Plan``, the answer: applicable to a real model, printable as code and as a table of what was
measured.

The budget a plan must fit is the device memory less ``headroom`` (10% by default): the peak counted
is tensor storage, and a real device also holds the allocator's cache and fragments, the CUDA
context and the collectives' buffers. When nothing fits, ``NoPlanFits`` names the smallest peak any
candidate reached, and dry runs of the same settings find how many ranks, or what batch, would fit.
"""

import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import nn

from .cost import Calibration, OptimizerKind, reference_seconds
from .dry_run import META, STEPS, DryRun, Footprint, Workload, first_dim
from .live_memory import LiveStorageTracker
from .profiles import ASSUMED, PROFILES, profile
from .search import Candidate, Search, Shape
from .settings import APIS, FSDP1, Settings, apply, blocks_of, code, dtype_name, find_blocks, settings_dict

GIB = 2**30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class NoPlanFits(ValueError):
    """No candidate fits the budget; ``smallest`` is the candidate with the lowest peak, ``ranks`` and
    ``batch`` what the dry runs of its settings found would fit (None where nothing tried did)."""

    def __init__(self, message: str, smallest: Candidate, ranks: Optional[int], batch: Optional[int]) -> None:
        super().__init__(message)
        self.smallest, self.ranks, self.batch = smallest, ranks, batch


@dataclass
class Plan:
    """The settings chosen, what they are predicted to hold and cost, and every candidate measured.

    ``peak``: bytes of tensor storage per device at the step's busiest moment; ``host``: bytes per
    rank kept in host memory by CPU offload; ``step_ratio``: the predicted step time over the model's
    bare compute (forward and backward, no recomputation, full precision) on the probed machine."""

    settings: Settings
    peak: int
    host: int
    step_ratio: float
    device_memory: int
    usable: int
    world_size: int
    mesh_shape: Optional[Tuple[int, int]]
    device_type: str
    block_classes: Tuple[Type[nn.Module], ...]
    num_blocks: int
    num_params: int
    calibration: Calibration
    candidates: List[Candidate] = field(repr=False)
    reference: float = field(repr=False)
    notes: List[str] = field(default_factory=list)
    seconds: float = 0.0

    def apply(self, model: nn.Module, mesh: Optional[Any] = None, **fsdp_kwargs: Any) -> nn.Module:
        """Shard ``model`` (built as the planned one was, on any device) as planned and return it.
        ``mesh``: for a hybrid plan, the (replicas, shard) device mesh (made when not given);
        ``fsdp_kwargs`` (``device_id``, ``param_init_fn``, ``sync_module_states``...) go to the FSDP1
        constructor or to every ``fully_shard`` call."""
        found = len(blocks_of(model, self.block_classes))
        params = sum(p.numel() for p in model.parameters())
        if (found, params) != (self.num_blocks, self.num_params):
            names = ", ".join(c.__name__ for c in self.block_classes)
            raise ValueError(f"fsdp1: this plan is for a model of {self.num_blocks} blocks ({names}) and {self.num_params:,} "
                             f"parameters; the model given has {found} and {params:,}. Plan the model you apply it to.")
        if self.mesh_shape is not None and mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.device_type, self.mesh_shape)
        return apply(self.settings, model, self.block_classes, mesh, **fsdp_kwargs)

    def measure_peak(self, build: Callable[[], nn.Module], batch: Any, loss: Callable[[nn.Module, Any], torch.Tensor],
                     optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None, **fsdp_kwargs: Any) -> int:
        """The peak of two real training steps of ``build()`` sharded by this plan, counted on this
        rank as the dry run counts: the check of ``peak``, on the job's ranks after
        ``init_process_group`` (a gloo worker thread may keep a finished collective's tensors alive a
        moment longer, so a real group can count a few kilobytes more)."""
        with LiveStorageTracker() as tracker:
            model = self.apply(build(), **fsdp_kwargs)
            optim = (optimizer or torch.optim.AdamW)(model.parameters())
            tracker.reset_peak()
            for _ in range(STEPS):
                loss(model, batch).backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
        return tracker.peak

    def code(self) -> str:
        """The calls ``apply`` makes, as Python to paste after the model (and mesh) are built."""
        return code(self.settings, self.block_classes, self.num_blocks, self.mesh_shape is not None)

    def ratio(self, candidate: Candidate) -> Optional[float]:
        return None if candidate.cost is None else candidate.cost.total / self.reference

    def table(self) -> str:
        """Every candidate measured: peak, fit, predicted step ratio; the chosen one marked."""
        name, unit = self._unit()
        lines = [f"{'':2}{'candidate':58} {'peak ' + name:>9} {'host ' + name:>9} {'fits':>4} {'step ratio':>10}"]
        for candidate in sorted(self.candidates, key=lambda c: (not c.fits, self.ratio(c) or 0.0, c.footprint.peak)):
            ratio = self.ratio(candidate)
            mark = "* " if candidate.settings == self.settings else "  "
            lines.append(f"{mark}{candidate.settings.describe(self.num_blocks):58} {candidate.footprint.peak / unit:9.2f} "
                         f"{candidate.footprint.host / unit:9.2f} {'yes' if candidate.fits else 'no':>4} "
                         f"{'-' if ratio is None else f'{ratio:.2f}':>10}")
        return "\n".join(lines)

    def __str__(self) -> str:
        name, unit = self._unit()
        mesh = f" as {self.mesh_shape[0]} x {self.mesh_shape[1]} (replicas x shard)" if self.mesh_shape else ""
        host = f", {self.host / unit:.2f} {name} a rank in host memory" if self.host else ""
        return (f"Plan for {self.world_size} {self.device_type} devices{mesh} of {self.device_memory / unit:.1f} {name} "
                f"({self.usable / unit:.1f} {name} usable), {self.settings.api}:\n"
                f"  {self.settings.describe(self.num_blocks)}\n"
                f"  predicted peak {self.peak / unit:.2f} {name} a device{host}; step {self.step_ratio:.2f}x the model's "
                f"bare compute (costs measured on {self.calibration.measured_on})\n"
                f"  {len(self.candidates)} dry runs in {self.seconds:.1f} s\n"
                + "".join(f"  note: {note}\n" for note in self.notes) + f"\n{self.table()}\n\n{self.code()}")

    def _unit(self) -> Tuple[str, int]:
        return ("GiB", GIB) if self.device_memory >= GIB else ("MiB", 2**20)

    def as_dict(self) -> Dict[str, Any]:
        return {"settings": settings_dict(self.settings), "peak": self.peak, "host": self.host,
                "step_ratio": self.step_ratio, "device_memory": self.device_memory, "usable": self.usable,
                "world_size": self.world_size, "mesh_shape": self.mesh_shape, "device_type": self.device_type,
                "calibration": self.calibration.as_dict(), "code": self.code(),
                "candidates": [{"settings": settings_dict(c.settings), "peak": c.footprint.peak, "fits": c.fits,
                                "step_ratio": self.ratio(c)} for c in self.candidates]}


def plan(
    build: Callable[[], nn.Module],
    batch: Any,
    loss: Callable[[nn.Module, Any], torch.Tensor],
    *,
    world_size: int,
    device_memory: Union[int, str],
    optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None,
    api: Union[str, Callable[..., Any]] = FSDP1,
    mesh_shape: Optional[Tuple[int, int]] = None,
    device_type: str = "cuda",
    blocks: Optional[Sequence[Type[nn.Module]]] = None,
    param_dtypes: Sequence[Optional[torch.dtype]] = (None,),
    allow_offload: bool = True,
    host_memory: Optional[Union[int, str]] = None,
    headroom: float = 0.1,
    calibration: Optional[Union[Calibration, str]] = None,
) -> Plan:
    """Find the settings that fit ``device_memory`` a device at the best speed.

    ``build()`` makes the model (it is called under the meta device: build it without ``device=``
    arguments); ``batch`` is one rank's example batch (any tensors: their shapes and dtypes set the
    peaks, and their values where the forward reads them, as in masks, packed sequences or the routing
    of experts) and ``loss(model, batch)`` the loss a step calls ``backward()`` on; ``optimizer(params)`` makes the
    optimizer (AdamW by default). ``api``: ``"FullyShardedDataParallel"`` or ``"fully_shard"`` (or
    fsdp1's class or function); ``mesh_shape``: (replicas, shard size) for hybrid sharding;
    ``device_type``: where the job will run ("cuda" or "cpu"); ``blocks``: the classes to make units
    of (found when not given); ``param_dtypes``: the precisions of gathers and compute the plan may
    choose (``None``: full precision; add ``torch.bfloat16`` to allow it); ``host_memory``: what
    CPU offload may keep in host memory a rank (unbounded when None); ``calibration``: rates
    measured before (``Calibration.measure``), or a GPU's by name (``"h100-sxm"``: one of
    ``fsdp1.plan.PROFILES``, eight a node; ``fsdp1.plan.profile`` for another node shape or network),
    else this machine is probed (and a CUDA job planned without CUDA assumes the H100 SXM profile).
    """
    if dist.is_initialized():
        raise RuntimeError("fsdp1.plan dry-runs the model as one rank of a fake process group of the planned "
                           "world size, so it runs before init_process_group (or from python -m fsdp1.plan); "
                           "this process already has a default process group.")
    budget = _bytes(device_memory, "device_memory")
    api_name = _api_name(api)
    _check(world_size, mesh_shape, headroom, device_type)
    dtypes = _dtypes(param_dtypes)
    workload = Workload(build, batch, loss, optimizer or (lambda params: torch.optim.AdamW(params)))
    model = _meta_model(build)
    classes = find_blocks(model, blocks)
    num_blocks = len(blocks_of(model, classes))
    notes: List[str] = []
    if isinstance(calibration, str):
        calibration = profile(calibration)
    elif calibration is None:
        calibration = _measure_calibration(device_type, workload, notes)
    _check_calibration(calibration, dtypes)
    usable = int(budget * (1 - headroom))
    dry_run = DryRun(workload, classes, device_type, mesh_shape)
    shape = Shape(world_size, mesh_shape, num_blocks)
    host = None if host_memory is None else _bytes(host_memory, "host_memory")
    search = Search(dry_run, shape, api_name, usable, host, calibration, dtypes, allow_offload)
    start = time.perf_counter()
    frozen = any(not p.requires_grad for p in model.parameters())  # FSDP1 units may then mix frozen and trainable
    candidates = search.run(use_orig_params=frozen and api_name == FSDP1)
    if search.checkpointing_error is not None:
        notes.append(f"activation checkpointing fails on this model ({search.checkpointing_error}), so no candidate "
                     "checkpoints; a Transformers model that caches keys and values needs use_cache=False in the "
                     "loss's call")
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise _no_fit(search, dry_run, shape, budget, usable, notes)
    plain = next(c for c in candidates if c.settings.checkpointed == 0)
    reference = reference_seconds(plain.footprint.flops, calibration)
    best = min(fitting, key=lambda c: c.cost.total if c.cost else float("inf"))
    assert best.cost is not None
    return Plan(settings=best.settings, peak=best.footprint.peak, host=best.footprint.host,
                step_ratio=best.cost.total / reference, device_memory=budget, usable=usable, world_size=world_size,
                mesh_shape=mesh_shape, device_type=device_type, block_classes=classes, num_blocks=num_blocks,
                num_params=sum(p.numel() for p in model.parameters()), calibration=calibration, candidates=candidates,
                reference=reference, notes=notes, seconds=time.perf_counter() - start)


def _measure_calibration(device_type: str, workload: Workload, notes: List[str]) -> Calibration:
    """This machine's probe; for a CUDA job planned without CUDA, the assumed GPU profile instead
    (this CPU's proportions would make offload look free), said in a warning and in ``notes``."""
    optimizer = workload.optimizer([nn.Parameter(torch.zeros(1))])
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"fsdp1.plan: optimizer(params) returned {type(optimizer).__name__}; pass a function that "
                         "makes a torch.optim.Optimizer of the parameters it is given.")
    if device_type == "cuda" and not torch.cuda.is_available():
        assumed = (f"planned without CUDA, so the step costs are the {ASSUMED} profile's (8 GPUs a node); pass "
                   f"calibration= the GPU's profile name ({', '.join(sorted(PROFILES))}) or a Calibration measured "
                   "where the job runs")
        warnings.warn(f"fsdp1.plan: {assumed}.", stacklevel=3)
        notes.append(assumed)
        return profile(ASSUMED)
    return Calibration.measure(device_type, OptimizerKind.of(optimizer))


def _check_calibration(calibration: Calibration, dtypes: Sequence[Optional[torch.dtype]]) -> None:
    if not isinstance(calibration, Calibration):
        raise ValueError(f"fsdp1.plan: calibration={calibration!r}; pass a fsdp1.plan.Calibration, a profile's "
                         "name, or None to probe this machine.")
    missing = [name for name in (dtype_name(d) for d in dtypes) if name not in calibration.matmul_flops]
    if missing:
        raise ValueError(f"fsdp1.plan: the calibration has no matmul rate for {missing[0]}; measure one that has "
                         "(Calibration.measure probes float32, bfloat16 and float16), or leave it out of param_dtypes.")


def _dtypes(param_dtypes: Sequence[Optional[torch.dtype]]) -> List[Optional[torch.dtype]]:
    """The precisions allowed, full precision (torch.float32) as None."""
    if isinstance(param_dtypes, torch.dtype) or not isinstance(param_dtypes, (list, tuple)) or not param_dtypes or not all(
            d is None or d in (torch.float32, torch.bfloat16, torch.float16) for d in param_dtypes):
        raise ValueError(f"fsdp1.plan: param_dtypes={param_dtypes!r}; pass a non-empty tuple of None (full precision), "
                         "torch.bfloat16 or torch.float16, e.g. (None, torch.bfloat16).")
    return list(dict.fromkeys(None if d == torch.float32 else d for d in param_dtypes))


def _bytes(memory: Union[int, str], name: str) -> int:
    if isinstance(memory, int) and not isinstance(memory, bool) and memory > 0:
        return memory
    if not isinstance(memory, str):
        match = None
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", memory)
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"fsdp1.plan: {name}={memory!r} is not a size; pass bytes (an int) or a string such as "
                         "'24GiB' or '80GB'.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _api_name(api: Union[str, Callable[..., Any]]) -> str:
    name = api if isinstance(api, str) else getattr(api, "__name__", repr(api))
    if name not in APIS:
        raise ValueError(f"fsdp1.plan: api={api!r}; pass 'FullyShardedDataParallel' or 'fully_shard' (or fsdp1's class "
                         "or function).")
    return name


def _check(world_size: int, mesh_shape: Optional[Tuple[int, int]], headroom: float, device_type: str) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"fsdp1.plan: world_size={world_size!r}; pass the number of ranks, 1 or more.")
    if mesh_shape is not None and (not isinstance(mesh_shape, (tuple, list)) or len(mesh_shape) != 2
                                   or not all(isinstance(n, int) and n > 0 for n in mesh_shape)
                                   or mesh_shape[0] * mesh_shape[1] != world_size):
        raise ValueError(f"fsdp1.plan: mesh_shape={mesh_shape!r} does not split world_size={world_size}; pass "
                         "(replicas, shard size) whose product is the world size.")
    if not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(f"fsdp1.plan: headroom={headroom!r}; pass the share of device memory to leave free, in [0, 1).")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"fsdp1.plan: device_type={device_type!r}; pass 'cuda' or 'cpu'.")


def _meta_model(build: Callable[[], nn.Module]) -> nn.Module:
    if isinstance(build, nn.Module) or not callable(build):
        raise ValueError(f"fsdp1.plan: build={type(build).__name__}; pass a function that makes the model (the "
                         "planner builds it on the meta device, e.g. lambda: MyModel(config)), not a model.")
    with META:
        model = build()
    if not isinstance(model, nn.Module):
        raise ValueError(f"fsdp1.plan: build() returned {type(model).__name__}; return the nn.Module to shard.")
    elsewhere = next(((name, p.device) for name, p in model.named_parameters() if p.device != META), None)
    if elsewhere is not None:
        raise ValueError(f"fsdp1.plan: build() put parameter {elsewhere[0]!r} on {elsewhere[1]}; the planner calls it "
                         "under the meta device, so build the model without device= arguments.")
    return model


def _no_fit(search: Search, dry_run: DryRun, shape: Shape, budget: int, usable: int, notes: List[str]) -> NoPlanFits:
    """The error for a budget nothing fits: the smallest candidate, and the ranks or batch that would fit it."""
    smallest = search.smallest()
    ranks = _ranks_that_fit(dry_run, smallest, shape, search.fits)
    batch = _batch_that_fits(dry_run, smallest, shape, search.fits)
    ways = []
    if ranks:
        ways.append(f"{ranks} ranks" + (" in shard groups" if shape.mesh_shape else ""))
    if batch:
        ways.append(f"a batch of {batch} a rank")
    savers = "allow bfloat16, or use larger devices" if dry_run.device_type == "cpu" else \
        "allow bfloat16 or CPU offload (and host memory), or use larger devices"
    what = ("It fits with " + " or with ".join(ways) + " (dry runs of those settings)." if ways else
            f"Neither more ranks (up to 8 times as many) nor batch 1 make it fit: {savers}.")
    what += "".join(f" Note: {note}." for note in notes)
    reached = (f"The smallest peak any candidate reaches is {_size(smallest.footprint.peak)} "
               f"({smallest.settings.describe(shape.num_blocks)})")
    if smallest.footprint.peak <= usable:  # it fits the device: host memory is what it lacks
        reached += (f", which fits, but keeps {_size(smallest.footprint.host)} a rank in host memory, over the "
                    f"{_size(search.host_memory or 0)} of host_memory")
    return NoPlanFits(f"fsdp1.plan: nothing fits {_size(budget)} a device ({_size(usable)} after headroom) on "
                      f"{shape.world_size} ranks. {reached}. {what}", smallest, ranks, batch)


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


def _ranks_that_fit(dry_run: DryRun, smallest: Candidate, shape: Shape, fits: Callable[[Footprint], bool]) -> Optional[int]:
    """The fewest ranks (a multiple of the world size, up to 8 times it) on which the smallest candidate fits."""
    for factor in (2, 4, 8):
        replicas = shape.mesh_shape[0] if shape.mesh_shape else 1
        world = shape.world_size * factor
        mesh = (replicas, world // replicas) if shape.mesh_shape else None
        bigger = DryRun(dry_run.workload, dry_run.classes, dry_run.device_type, mesh)
        with bigger.process_group(world):
            if fits(bigger.measure(smallest.settings)):
                return world
    return None


def _batch_that_fits(dry_run: DryRun, smallest: Candidate, shape: Shape, fits: Callable[[Footprint], bool]) -> Optional[int]:
    """The largest batch a rank (halving the example's first dimension) on which the smallest candidate fits."""
    full = first_dim(dry_run.workload.batch)
    fraction = 0.5
    with dry_run.process_group(shape.world_size):
        while full and int(full * fraction) >= 1:
            if fits(dry_run.measure(smallest.settings, dry_run.workload.scaled_batch(fraction))):
                return int(full * fraction)
            fraction /= 2
    return None
