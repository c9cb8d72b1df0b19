"""What a step of one candidate costs, by a model a user can check against a stopwatch.

A step is its compute (forward and backward FLOPs, recomputation included, at the matmul rate of the
compute dtype), the communication that compute does not hide (bytes sent at the collective rate,
less the share the machine overlaps with compute), the offload copies, and the optimizer step
(elements held, at the optimizer's measured rate on the device or, offloaded, on the host). Every rate
comes from a probe on the machine the planner runs on (``Calibration.measure``): two processes on the
device's own backend, as ranks of a job share the machine, time a matmul in each dtype, an
all-gather, the two at once (how much of the all-gather the matmul hides) and the user's optimizer.
A plan states its cost as a ratio to the model's bare compute (``reference``: forward and backward, no
recomputation, full precision) on that machine, never as seconds: the seconds hold for the probed
machine only, the ratios carry over wherever its rates keep their proportions.
"""

import inspect
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Type

import torch

from .dry_run import Footprint
from .settings import Settings

_PROBE_ELEMENTS = 1 << 20
_GATHER_BYTES = 16 << 20


@dataclass(frozen=True)
class OptimizerKind:
    """The user's optimizer as a child process can rebuild it: its class and its defaults."""

    kind: Type[torch.optim.Optimizer]
    defaults: Dict[str, Any]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> "OptimizerKind":
        accepted = inspect.signature(type(optimizer).__init__).parameters  # defaults may hold more than it takes
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and not isinstance(v, torch.Tensor)}
        return cls(type(optimizer), defaults)


@dataclass(frozen=True)
class Calibration:
    """Rates of one machine, in units per second (``optimizer_s_per_element``: seconds per element),
    and where they were measured."""

    matmul_flops: Dict[str, float]  # by dtype name: "float32", "bfloat16"
    collective_bytes: float  # bytes one rank sends per second in an all-gather
    overlap: float  # the share of an all-gather a concurrent matmul hides, 0 to 1
    optimizer_s_per_element: float
    host_optimizer_s_per_element: float
    host_copy_bytes: float  # host <-> device; infinite where the device is the host
    measured_on: str

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def measure(cls, device_type: str, optimizer: "OptimizerKind") -> "Calibration":
        """Probe this machine: two processes on ``device_type``'s backend (gloo on the CPU, and where
        fewer than two GPUs are visible), about ten seconds."""
        ctx = torch.multiprocessing.get_context("spawn")
        results = ctx.SimpleQueue()
        port = _free_port()
        processes = [ctx.Process(target=_probe_rank, args=(rank, port, device_type, optimizer, results)) for rank in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=300)
        found: List[Dict[str, Any]] = [results.get() for _ in processes if not results.empty()]
        if len(found) != 2 or any("error" in r for r in found):
            raise RuntimeError(f"fsdp1.plan: the machine probe failed: {found}. Pass calibration=... to plan without it.")
        rank0 = found[0]
        return cls(matmul_flops=rank0["matmul_flops"], collective_bytes=min(r["collective_bytes"] for r in found),
                   overlap=min(r["overlap"] for r in found), optimizer_s_per_element=rank0["optimizer"],
                   host_optimizer_s_per_element=rank0["host_optimizer"], host_copy_bytes=rank0["host_copy"],
                   measured_on=rank0["where"])


@dataclass(frozen=True)
class StepCost:
    """Seconds on the probed machine, by part."""

    compute: float
    exposed_comm: float
    offload: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.offload + self.optimizer


def step_cost(settings: Settings, footprint: Footprint, calibration: Calibration, shard_size: int) -> StepCost:
    """The cost of one step of ``settings``, whose dry run gave ``footprint``; ``shard_size``: ranks
    that split each parameter."""
    dtype = "float32" if settings.param_dtype is None else str(settings.param_dtype).removeprefix("torch.")
    compute = footprint.flops / calibration.matmul_flops[dtype]
    comm_bytes = sum(footprint.comm.values())
    comm = comm_bytes / calibration.collective_bytes
    hidden_bytes = float(comm_bytes)
    if settings.api == "FullyShardedDataParallel" and settings.backward_prefetch is None:
        hidden_bytes -= footprint.comm.get("all_gather", 0) / 2  # backward's gathers wait for the gradient before them
    hidden = calibration.overlap * min(hidden_bytes / calibration.collective_bytes, compute)
    offload = 0.0
    if settings.offload:  # each gather copies the shard to the device first, each gradient comes back
        shard_bytes = 4 * footprint.held
        gathers = footprint.comm.get("all_gather", 0) / (shard_size - 1) / shard_bytes if shard_size > 1 else 1.0
        offload = shard_bytes * (max(1.0, gathers) + 1) / calibration.host_copy_bytes
    rate = calibration.host_optimizer_s_per_element if settings.offload else calibration.optimizer_s_per_element
    return StepCost(compute=compute, exposed_comm=comm - hidden, offload=offload, optimizer=footprint.held * rate)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _probe_rank(rank: int, port: int, device_type: str, optimizer: "OptimizerKind", results: Any) -> None:
    import torch.distributed as dist

    try:
        gpus = torch.cuda.device_count() if device_type == "cuda" else 0
        device = torch.device("cuda", rank) if gpus >= 2 else torch.device("cuda") if gpus else torch.device("cpu")
        if device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        backend = "nccl" if gpus >= 2 else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        comm_device = device if backend == "nccl" else torch.device("cpu")
        try:
            found = _probe(device, comm_device, optimizer)
        finally:
            dist.destroy_process_group()
        found["where"] = (f"{torch.cuda.get_device_name(device)}, {backend}" if device.type == "cuda"
                          else f"CPU ({torch.get_num_threads()} threads a process, 2 processes), {backend}")
        results.put(found)
    except Exception as error:  # reported to the parent, which raises
        results.put({"error": f"rank {rank}: {type(error).__name__}: {error}"})


def _probe(device: torch.device, comm_device: torch.device, optimizer: "OptimizerKind") -> Dict[str, Any]:
    import torch.distributed as dist

    size = 2048 if device.type == "cuda" else 512
    flops: Dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size, device=device, dtype=dtype)
        seconds = _timed(device, lambda: a @ a, repeats=20 if device.type == "cuda" else 4)
        flops[str(dtype).removeprefix("torch.")] = 2 * size**3 / seconds
    shard = torch.empty(_GATHER_BYTES // 8, device=comm_device)
    full = torch.empty(2 * shard.numel(), device=comm_device)
    gather = _timed(comm_device, lambda: dist.all_gather_into_tensor(full, shard), repeats=4)
    a = torch.randn(size, size, device=device)
    matmuls = max(1, int(gather / _timed(device, lambda: a @ a, repeats=4)))
    alone = _timed(device, lambda: [a @ a for _ in range(matmuls)], repeats=2)

    def together() -> None:
        work = dist.all_gather_into_tensor(full, shard, async_op=True)
        for _ in range(matmuls):
            a @ a
        assert work is not None
        work.wait()

    both = _timed(device, together, repeats=2)
    overlap = max(0.0, min(1.0, (alone + gather - both) / min(alone, gather)))
    found = {"matmul_flops": flops, "collective_bytes": _GATHER_BYTES / 2 / gather, "overlap": overlap,
             "optimizer": _optimizer_rate(device, optimizer)}
    found["host_optimizer"] = found["optimizer"] if device.type == "cpu" else _optimizer_rate(torch.device("cpu"), optimizer)
    found["host_copy"] = float("inf") if device.type == "cpu" else _host_copy_rate(device)
    return found


def _optimizer_rate(device: torch.device, optimizer: "OptimizerKind") -> float:
    params = [torch.nn.Parameter(torch.zeros(_PROBE_ELEMENTS, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.zeros_like(p)
    optim = optimizer.kind(params, **optimizer.defaults)
    optim.step()  # creates the state
    return _timed(device, optim.step, repeats=3) / (4 * _PROBE_ELEMENTS)


def _host_copy_rate(device: torch.device) -> float:
    host = torch.empty(_GATHER_BYTES // 4, pin_memory=True)
    on_device = torch.empty_like(host, device=device)
    return 2 * _GATHER_BYTES / _timed(device, lambda: (on_device.copy_(host), host.copy_(on_device)), repeats=4)


def _timed(device: torch.device, work: Callable[[], Any], repeats: int) -> float:
    """The median seconds of ``work`` after one warm-up."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    work()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def reference_seconds(flops: int, calibration: Calibration) -> float:
    """The bare compute of ``flops`` at the full-precision matmul rate."""
    return flops / calibration.matmul_flops["float32"]
