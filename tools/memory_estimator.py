"""Predict fsdp1's memory per rank before you have the ranks: a dry run on the meta device.

    python -m tools.memory_estimator --world-size 8 --variant fsdp1_grad_op
    python -m tools.memory_estimator --world-size 64 --d-model 1024 --layers 24 --batch 4

Run it from the repository root, where the ``tools`` and ``examples`` packages are.

The model is built on the meta device (no memory, no data) and trained for two steps under a fake
process group of the requested world size, in this one process, as rank 0 of N. Collectives move no
data, but every tensor is created with its real size, so counting the live storage
(``LiveStorageTracker``) gives the peak one rank of a real run reaches: parameters, gradients,
optimizer state, activations, unsharded units and every temporary, as each exists at that moment.

From Python, ``estimate(size, wrapper)`` does the same for any variant of ``workload.VARIANTS``
that runs on the meta device under a fake group (fsdp1's, and ``local``); pass your own
``GPTSize``. For any other model, and to choose the settings too, use the library's planner
(``fsdp1.plan``, ``python -m fsdp1.plan``), which runs the same count. DDP refuses the fake group, so
it has no estimate. ``measure`` is the same count on any device; the benchmark and the tests use it
for real runs, so prediction and measurement are counted by one piece of code.
"""

import argparse
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from fsdp1._planner.dry_run import FusedAttention, fake_process_group
from fsdp1._planner.live_memory import LiveStorageTracker

from tools.workload import VARIANTS, GPTSize, Wrapper, forward_backward, make_optimizer, state_bytes

META = torch.device("meta")
ESTIMATED = [name for name in VARIANTS if (name.startswith("fsdp1_") and not name.endswith("_pp")) or name == "local"]
"""The benchmark's variants that the dry run can execute (a pipeline's stages exchange real activations)."""


@dataclass(frozen=True)
class StepMemory:
    """Bytes per rank: alive when the last training step starts (after ``zero_grad(set_to_none=True)``),
    the most alive at any moment of the steps, and parameters + gradients + optimizer state right
    after the last optimizer step."""

    step_start: int
    peak: int
    state: int


def measure(size: GPTSize, make_model: Callable[[], nn.Module], wrapper: Wrapper, device: torch.device,
            batches: Sequence[torch.Tensor]) -> StepMemory:
    """Build and wrap the model under a ``LiveStorageTracker`` and train one step per batch; the peak
    counts from the first step on. Needs a process group unless ``wrapper`` is ``local``."""
    with LiveStorageTracker() as tracker:
        model = wrapper(make_model(), device)
        optim = make_optimizer(model)
        tracker.reset_peak()
        for tokens in batches:
            step_start = tracker.live
            forward_backward(size, model, tokens)
            optim.step()
            state = state_bytes(model, optim)
            optim.zero_grad(set_to_none=True)
        return StepMemory(step_start, tracker.peak, state)


def _meta_model(size: GPTSize) -> nn.Module:
    with META:
        return size.make_model()


def estimate(size: GPTSize, wrapper: Wrapper, steps: int = 2, device_type: str = "cpu") -> StepMemory:
    """Dry-run ``steps`` training steps of the wrapped model on the meta device (see ``measure``), its
    attention through the fused kernel ``device_type`` runs."""
    tokens = size.make_batch(torch.Generator().manual_seed(0), META)
    with FusedAttention(device_type):
        return measure(size, lambda: _meta_model(size), wrapper, META, [tokens] * steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--variant", choices=ESTIMATED, default="fsdp1_full")
    defaults = GPTSize()
    for field in ("vocab", "seq", "d_model", "layers", "heads", "batch"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    args = parser.parse_args()
    size = GPTSize(args.vocab, args.seq, args.d_model, args.layers, args.heads, args.batch)
    num_params = sum(p.numel() for p in size.make_model().to(META).parameters())
    with fake_process_group(args.world_size):
        result = estimate(size, VARIANTS[args.variant])
    mib = 2**20
    print(f"{args.variant} on {args.world_size} ranks, GPT {num_params:,} params, batch {size.batch}x{size.seq}/rank, "
          f"AdamW: step start {result.step_start / mib:.2f} MiB, peak {result.peak / mib:.2f} MiB per rank "
          f"(unsharded params+grads+AdamW state: {16 * num_params / mib:.2f} MiB)")


if __name__ == "__main__":
    main()
