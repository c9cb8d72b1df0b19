"""The probe of ``Calibration.measure``, run in two fresh processes: what a matmul in each dtype, an
all-gather, the two at once, the user's optimizer and the int8 codec cost on this machine. Each process prints its
measurements as one line of JSON."""

import base64
import json
import os
import pickle
import sys
import time
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

from .._engine.quantization import BlockCodec
from ..api import BlockQuantization
from .cost import OptimizerKind
from .settings import dtype_name

_PROBE_ELEMENTS = 1 << 20
_GATHER_BYTES = 16 << 20


def probe_rank(rank: int, port: int, device_type: str, optimizer: OptimizerKind) -> Dict[str, Any]:
    """One of the two processes: its measurements, or the error it met."""
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
        return found
    except Exception as error:  # reported to the parent, which raises
        return {"error": f"rank {rank}: {type(error).__name__}: {error}"}


def _probe(device: torch.device, comm_device: torch.device, optimizer: OptimizerKind) -> Dict[str, Any]:
    size = 2048 if device.type == "cuda" else 512
    flops: Dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.randn(size, size, device=device, dtype=dtype)
        seconds = _timed(device, lambda: a @ a, repeats=20 if device.type == "cuda" else 4)
        flops[dtype_name(dtype)] = 2 * size**3 / seconds
    shard = torch.empty(_GATHER_BYTES // 8, device=comm_device)
    full = torch.empty(2 * shard.numel(), device=comm_device)
    gather = _timed(comm_device, lambda: dist.all_gather_into_tensor(full, shard), repeats=4)
    a = torch.randn(size, size, device=device)
    matmuls = max(1, int(gather * flops["float32"] / (2 * size**3)))  # about as long as the all-gather
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
    found["host_copy"] = None if device.type == "cpu" else _host_copy_rate(device)
    found["codec"] = _codec_rate(device)
    return found


def _codec_rate(device: torch.device) -> float:
    """Seconds a value costs to encode and decode with ``BlockQuantization()``'s codec."""
    codec = BlockCodec(torch.int8, BlockQuantization().block_size)
    values = torch.randn(_PROBE_ELEMENTS, device=device)
    encoded = torch.empty(codec.encoded_nbytes(values.numel()), dtype=torch.uint8, device=device)

    def round_trip() -> None:
        codec.encode_into(values, encoded)
        codec.decode_into(encoded, values)

    return _timed(device, round_trip, repeats=4) / values.numel()


def _optimizer_rate(device: torch.device, optimizer: OptimizerKind) -> float:
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


if __name__ == "__main__":
    port, device_type, optimizer = pickle.loads(base64.b64decode(sys.argv[2]))
    print(json.dumps(probe_rank(int(sys.argv[1]), port, device_type, optimizer)))
