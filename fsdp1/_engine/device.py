"""Which device a unit computes on, and moving inputs there.

fsdp1 owns no CUDA streams: collectives are asynchronous on the process group's own stream and a
``Work.wait()`` orders the compute stream after them, while every buffer is allocated and freed on
the compute stream. The same code therefore runs on CPU/gloo and CUDA/NCCL. The one stream fsdp1
uses is a user's, for a hook the user asked to run on it (``run_on_stream``).
"""

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn


def resolve_compute_device(
    module: nn.Module, device_id: Optional[Union[int, torch.device]], ignored_params: Iterable[nn.Parameter]
) -> torch.device:
    """``device_id`` when given (an int means that CUDA device), else the device of the module's
    managed parameters, which must agree."""
    if device_id is not None:
        return materialization_device(device_id)
    ignored = {id(p) for p in ignored_params}
    devices = {p.device for p in module.parameters() if id(p) not in ignored}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise RuntimeError(
            f"fsdp1: the module's parameters are on several devices ({names}); FSDP computes each unit "
            "on one device. Pass device_id=... to move the module there, or move it yourself first."
        )
    return devices.pop() if devices else torch.device("cpu")


def materialization_device(device_id: Optional[Union[int, torch.device]]) -> torch.device:
    """Where meta-built modules get their storage: ``device_id`` (an int means that CUDA device),
    else the CPU, where fsdp1 runs without ``device_id``."""
    if device_id is None:
        return torch.device("cpu")
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    index: Optional[int] = device.index  # None for "cuda" alone, which torch's stubs do not say
    if device.type == "cuda" and index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def move_to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside tuples, lists, dicts and dataclasses moved to ``device``."""
    return map_tensors(lambda t: t if t.device == device else t.to(device, non_blocking=True), obj)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside tuples (named too), lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def wait_for_device(device: torch.device) -> None:
    """Block until the work queued on ``device``'s current stream has run (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def run_on_stream(stream: Optional[Any], fn: Callable[[torch.Tensor], None], tensor: torch.Tensor) -> None:
    """``fn(tensor)`` with ``stream`` (a user's, or None: the current one) current on ``tensor``'s
    device: it first waits for the work queued so far, and the current stream waits for what ``fn``
    queued; ``tensor`` is marked used there, so that its memory is not reused before. On the CPU
    there is nothing to order, but ``fn`` runs with the ``torch.cpu.Stream`` it was given current,
    as torch's does."""
    if stream is None:
        fn(tensor)
        return
    module = torch.get_device_module(tensor.device)
    if tensor.device.type == "cpu":
        with module.stream(stream):
            fn(tensor)
        return
    current = module.current_stream(tensor.device)
    stream.wait_stream(current)
    with module.stream(stream) if hasattr(module, "stream") else contextlib.nullcontext():
        fn(tensor)
    tensor.record_stream(stream)
    current.wait_stream(stream)
