"""What a CPU cannot show, on a machine with one CUDA GPU: fsdp1 next to torch's FSDP on the GPU.

    make gpu-check                                   # or: python -m tools.gpu_check
    python -m tools.gpu_check --device cpu           # the same checks over gloo on the CPU

Part 1 trains the benchmark's GPT (the CPU configuration) for three AdamW steps at world size 1 over
NCCL, once under torch's FSDP and once under fsdp1 with the same code, and compares losses and
parameters bit for bit: FSDP1 in fp32, bf16, with CPU offload (the shards in pinned memory) and
with activation checkpointing; ``fully_shard`` the same ways; a model built on the CPU given a CUDA
mesh (both move it to the GPU); and a model built on the meta device, sharded, then materialised with
``to_empty(device="cuda")``. Part 2 runs ``tools.gpu_fake_pg``: rank 0 of 4 and of 8 simulated ranks
(torch's fake process group) for peak memory and step time next to torch's FSDP1 and FSDP2.

Without CUDA it says so and exits 0. It exits 1 when a check differs from torch's.
"""

import argparse
import contextlib
import os
import subprocess
import sys
from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp1

from tools.workload import BF16, Block, GPTSize, _fsdp1, _torch_fsdp1

STEPS = 3
Build = Callable[[str, GPTSize, torch.device], nn.Module]
"""A check's model: ``impl`` ("torch" or "fsdp1"), the GPT's size, the device; built on the CPU from
the seed set before."""

SMALL = GPTSize(vocab=64, seq=16, d_model=32, layers=2, heads=2)
"""``--small``: a GPT that checks the checks in seconds (the suite runs them so on the CPU)."""


def _checkpointed(model: nn.Module) -> nn.Module:
    """torch's activation checkpointing of every block (it wraps fsdp1's units as torch's)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    return model


def _fsdp1_api(checkpointed: bool = False, **options) -> Build:
    def build(impl: str, size: GPTSize, device: torch.device) -> nn.Module:
        wrapped = (_fsdp1 if impl == "fsdp1" else _torch_fsdp1)("FULL_SHARD", False, size.make_model(), device, **options)
        return _checkpointed(wrapped) if checkpointed else wrapped

    return build


def _fully_shard_api(move_first: bool = True, checkpointed: bool = False, on_meta: bool = False, **options) -> Build:
    """``on_meta``: built on the meta device, sharded, then materialised on the device and initialised
    there."""

    def build(impl: str, size: GPTSize, device: torch.device) -> nn.Module:
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            model = size.make_model()
        if impl == "fsdp1":
            fully_shard, policies = fsdp1.fully_shard, fsdp1
        else:
            import torch.distributed.fsdp as policies  # the oracle
            from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        kwargs = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
        if options.get("bf16"):
            kwargs["mp_policy"] = policies.MixedPrecisionPolicy(**BF16)
        if options.get("offload"):
            kwargs["offload_policy"] = policies.CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if move_first:
            model.to(device)
        if checkpointed:
            _checkpointed(model)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        if on_meta:
            model.to_empty(device=device)
            torch.manual_seed(0)
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        return model

    return build


CHECKS: Dict[str, Build] = {
    "FSDP1 fp32": _fsdp1_api(),
    "FSDP1 bf16": _fsdp1_api(mixed_precision=BF16),
    "FSDP1 CPU offload": _fsdp1_api(cpu_offload=dict(offload_params=True)),
    "FSDP1 activation checkpointing": _fsdp1_api(checkpointed=True),
    "fully_shard fp32": _fully_shard_api(),
    "fully_shard bf16": _fully_shard_api(bf16=True),
    "fully_shard CPU offload": _fully_shard_api(offload=True),
    "fully_shard activation checkpointing": _fully_shard_api(checkpointed=True),
    "fully_shard, model built on the CPU": _fully_shard_api(move_first=False),
    "fully_shard, meta -> to_empty": _fully_shard_api(move_first=False, on_meta=True),
}

CUDA_ONLY = {"FSDP1 CPU offload"}
"""torch's FSDP1 offloads only from an accelerator."""


def _values(model: nn.Module) -> List[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone() for p in model.parameters()]


def _placement(model: nn.Module) -> Tuple[str, str]:
    """The device types of the (local) parameters, and the same with pinning named."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    pinned = sorted({f"{p.device.type}{' pinned' if p.device.type == 'cpu' and p.is_pinned() else ''}" for p in local})
    return ", ".join(sorted({p.device.type for p in local})), ", ".join(pinned)


def _trained(build: Build, impl: str, device: torch.device,
             size: GPTSize) -> Tuple[List[float], List[torch.Tensor], Tuple[str, str]]:
    """Three steps; the losses, the parameters, and where the parameters were put (see ``_placement``)."""
    torch.manual_seed(0)
    model = build(impl, size, device)
    where = _placement(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        loss = size.loss(model, size.make_batch(generator, device))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, _values(model), where


def correctness(device: torch.device, size: GPTSize) -> Iterator[Tuple[str, bool, str]]:
    """Each check: its name, whether fsdp1's losses, parameters and placement equal torch's, and a
    line of detail."""
    for name, build in CHECKS.items():
        if name in CUDA_ONLY and device.type != "cuda":
            continue
        try:
            theirs, ours = _trained(build, "torch", device, size), _trained(build, "fsdp1", device, size)
        except Exception as error:  # a failed check is a row of the table, not the end of the run
            yield name, False, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            continue
        same = theirs[0] == ours[0] and all(torch.equal(a, b) for a, b in zip(theirs[1], ours[1]))
        same = same and theirs[2][0] == ours[2][0]  # pinned or not is a detail: fsdp1 pins its offloaded shards always
        yield name, same, f"losses {ours[0][0]:.6f} .. {ours[0][-1]:.6f}; parameters on {ours[2][1]} (torch's: {theirs[2][1]})"


@contextlib.contextmanager
def _one_rank_group(backend: str) -> Iterator[None]:
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--world-sizes", default="4,8", help="simulated world sizes of part 2")
    parser.add_argument("--small", action="store_true", help="a tiny GPT, to check the checks")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
              "nothing to check. Run it on a machine with a GPU and a CUDA build of torch.")
        return 0
    if args.device == "cuda":
        torch.cuda.set_device(0)
        where = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL world size 1"
    else:
        where = f"CPU, torch {torch.__version__}, gloo world size 1"
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    print(f"Part 1: fsdp1 against torch's FSDP, {STEPS} AdamW steps of the benchmark GPT ({where})")
    print(f"{'check':<40}{'as torch':<10}detail")
    failed = 0
    with _one_rank_group("nccl" if args.device == "cuda" else "gloo"):
        for name, same, detail in correctness(device, SMALL if args.small else GPTSize()):
            failed += not same
            print(f"{name:<40}{'yes' if same else 'NO':<10}{detail}", flush=True)
    if args.device == "cuda":
        for world_size in args.world_sizes.split(","):
            print(f"\nPart 2: rank 0 of {world_size} simulated ranks (torch's fake process group)", flush=True)
            run = subprocess.run([sys.executable, "-m", "tools.gpu_fake_pg", "--world-size", world_size, "--steps", "4",
                                  "--json", f"out/gpu_fake_pg_{world_size}.json"], env={**os.environ})
            failed += run.returncode != 0
    print(f"\n{failed} of the checks failed" if failed else "\nevery check agrees with torch's")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
