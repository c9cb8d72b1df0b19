"""What a step of one candidate costs, by a model a user can check against a stopwatch.

A step is its compute (forward and backward FLOPs, recomputation included, at the matmul rate of the
compute dtype), the communication that compute does not hide (bytes sent at the collective rate,
less the share the machine overlaps with compute), the offload copies, the optimizer step
(elements held, at the optimizer's measured rate on the device or, offloaded, on the host) and,
with quantized communication, its codec (every value sent encoded once and decoded once, at the
codec's measured rate; the bytes are the dry run's, which ran the codec). Every rate
comes from a probe on the machine the planner runs on (``Calibration.measure``): two processes on the
device's own backend, as ranks of a job share the machine, time a matmul in each dtype, an
all-gather, the two at once (how much of the all-gather the matmul hides), the user's optimizer and
the int8 codec.
A plan states its cost as a ratio to the model's bare compute (``reference``: forward and backward, no
recomputation, full precision) on that machine, never as seconds: the seconds hold for the probed
machine only, the ratios carry over wherever its rates keep their proportions.
"""

import base64
import inspect
import json
import pickle
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Type

import torch

from .._engine.quantization import SCALE_DTYPE
from ..api import BlockQuantization
from .dry_run import Footprint
from .settings import Settings, dtype_name


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

    matmul_flops: Dict[str, float]  # by dtype name: "float32", "bfloat16", "float16"
    collective_bytes: float  # bytes one rank sends per second in an all-gather
    overlap: float  # the share of an all-gather a concurrent matmul hides, 0 to 1
    optimizer_s_per_element: float
    host_optimizer_s_per_element: float
    host_copy_bytes: Optional[float]  # host <-> device; None where the device is the host
    measured_on: str
    codec_s_per_value: Optional[float] = None  # int8 block quantization, encoding plus decoding; None: not measured
    inter_node_collective_bytes: Optional[float] = None  # the same across nodes; None: one node, or one rate
    gpus_per_node: Optional[int] = None  # ranks a node, where the rate across nodes is given

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def comm_seconds(self, comm: Dict[str, int], shard_size: int, world_size: int) -> Dict[str, float]:
        """The seconds of each kind of collective in ``comm`` (bytes a rank sends), at the rate across
        nodes where its group spans them: a shard group is ``shard_size`` consecutive ranks, and an
        all-reduce (over the replicas of hybrid sharding, or every rank) spans them once the job does."""
        def rate(group_span: int) -> float:
            if self.inter_node_collective_bytes is not None and self.gpus_per_node and group_span > self.gpus_per_node:
                return self.inter_node_collective_bytes
            return self.collective_bytes
        return {kind: nbytes / rate(world_size if kind == "all_reduce" else shard_size) for kind, nbytes in comm.items()}

    @classmethod
    def measure(cls, device_type: str, optimizer: "OptimizerKind") -> "Calibration":
        """Probe this machine: two fresh processes (``python -m fsdp1._planner.probe``, so that a
        script without a ``__main__`` guard is not run again) on ``device_type``'s backend (gloo on
        the CPU, and where fewer than two GPUs are visible), about ten seconds."""
        payload = base64.b64encode(pickle.dumps((_free_port(), device_type, optimizer))).decode()
        processes = [subprocess.Popen([sys.executable, "-m", "fsdp1._planner.probe", str(rank), payload],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
        found: List[Dict[str, Any]] = []
        for process in processes:
            try:
                out, err = process.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
            lines = out.strip().splitlines()
            found.append(json.loads(lines[-1]) if process.returncode == 0 and lines else {"error": err.strip()[-2000:]})
        errors = [r["error"] for r in found if "error" in r]
        if errors:
            raise RuntimeError(f"fsdp1.plan: the probe of this machine failed: {errors[0]}. Pass calibration=... "
                               "(rates measured before, or your own) to plan without it.")
        rank0 = found[0]
        return cls(matmul_flops=rank0["matmul_flops"], collective_bytes=min(r["collective_bytes"] for r in found),
                   overlap=min(r["overlap"] for r in found), optimizer_s_per_element=rank0["optimizer"],
                   host_optimizer_s_per_element=rank0["host_optimizer"], host_copy_bytes=rank0["host_copy"],
                   measured_on=rank0["where"], codec_s_per_value=rank0["codec"])


@dataclass(frozen=True)
class StepCost:
    """Seconds on the probed machine, by part."""

    compute: float
    exposed_comm: float
    offload: float
    optimizer: float
    codec: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.offload + self.optimizer + self.codec


def step_cost(settings: Settings, footprint: Footprint, calibration: Calibration, shard_size: int,
              world_size: int) -> StepCost:
    """The cost of one step of ``settings``, whose dry run gave ``footprint``; ``shard_size``: ranks
    that split each parameter, of ``world_size``."""
    compute = footprint.flops / calibration.matmul_flops[dtype_name(settings.param_dtype)]
    comm_bytes = sum(footprint.comm.values())
    seconds = calibration.comm_seconds(footprint.comm, shard_size, world_size)
    comm = sum(seconds.values())
    hideable = comm
    if settings.api == "FullyShardedDataParallel" and settings.backward_prefetch is None:
        hideable -= seconds.get("all_gather", 0.0) / 2  # backward's gathers wait for the gradient before them
    hidden = calibration.overlap * min(hideable, compute)
    offload = 0.0
    if settings.offload and calibration.host_copy_bytes is not None:  # each gather copies the shard to the device first, each gradient comes back
        shard_bytes = 4 * footprint.held
        gathers = footprint.comm.get("all_gather", 0) / (shard_size - 1) / shard_bytes if shard_size > 1 else 1.0
        offload = shard_bytes * (max(1.0, gathers) + 1) / calibration.host_copy_bytes
    rate = calibration.host_optimizer_s_per_element if settings.offload else calibration.optimizer_s_per_element
    codec = 0.0
    if settings.quantized:  # each value sent is encoded by its sender and decoded by its receiver, in the step's path
        codec = 2 * comm_bytes / INT8_BYTES_PER_VALUE * (calibration.codec_s_per_value or 0.0)
    return StepCost(compute=compute, exposed_comm=comm - hidden, offload=offload, optimizer=footprint.held * rate,
                    codec=codec)


INT8_BYTES_PER_VALUE = torch.int8.itemsize + SCALE_DTYPE.itemsize / BlockQuantization().block_size
"""Bytes a value travels as under ``BlockQuantization()``: its int8 code and its share of its block's
scale (a cut block's further scales are a few per parameter, too few to count)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reference_seconds(flops: int, calibration: Calibration) -> float:
    """The bare compute of ``flops`` at the full-precision matmul rate."""
    return flops / calibration.matmul_flops["float32"]
