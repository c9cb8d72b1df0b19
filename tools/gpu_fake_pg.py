"""GPU peak memory and step time of the sharded paths on one GPU: each variant is rank 0 of a fake
process group of ``--world-size`` ranks (collectives move nothing), fsdp1 next to torch's FSDP1 and
FSDP2.

    python -m tools.gpu_fake_pg --world-size 8 --json out/gpu_fake_pg.json    # from the repository root

NCCL puts one rank on a GPU, and at world size 1 both FSDP1s fall back to NO_SHARD, so a single GPU
measures sharding only this way. The model is the benchmark's GPT
at the GPU configuration there; the losses are meaningless (gathered shards hold no data), the
allocator's peaks and the wrapper's time are real. Each variant runs in a process of its own, so that
no allocation of another counts; "left" is what stays allocated once the model and its optimizer
are deleted (0 unless something keeps them alive).
"""

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from fsdp1._planner.dry_run import fake_process_group

from tools.workload import BF16, VARIANTS, GPTSize

PAIRS = [(f"torch_fsdp1_{kind}", f"fsdp1_{kind}") for kind in ("full", "full_orig", "grad_op", "full_bf16", "full_offload")]
PAIRS.append(("torch_fsdp2", "fsdp1_fsdp2"))
"""The variants of tools/workload.py measured here: torch's, then fsdp1's."""


def measure(name: str, size: GPTSize, steps: int) -> dict:
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = VARIANTS[name](size.make_model(), device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not name.endswith("offload"))
    generator = torch.Generator().manual_seed(0)
    built = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(steps):
        tokens = size.make_batch(generator, device)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        size.loss(model, tokens).backward()
        optim.step()
        optim.zero_grad()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    stats = torch.cuda.memory_stats(device)
    del model, optim
    gc.collect()
    return {"built_mib": built / 2**20, "max_allocated_mib": stats["allocated_bytes.all.peak"] / 2**20,
            "max_reserved_mib": stats["reserved_bytes.all.peak"] / 2**20,
            "alloc_retries": stats["num_alloc_retries"], "step_ms": 1000 * statistics.median(times[1:]),
            "left_mib": torch.cuda.memory_allocated(device) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path, default=Path("out/gpu_fake_pg.json"))
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one variant, in this process: prints its row as JSON
    gpu = dict(vocab=32768, seq=1024, d_model=1024, layers=8, heads=16, batch=8)
    for field, default in gpu.items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args()
    size = GPTSize(*(getattr(args, field) for field in gpu))
    if args.only:
        torch.set_flush_denormal(True)
        torch.cuda.set_device(0)
        with fake_process_group(args.world_size):
            print(json.dumps(measure(args.only, size, args.steps)))
        return
    results = {}
    anchors = {ours: theirs for theirs, ours in PAIRS}
    for pair in PAIRS:
        for name in pair:
            run = subprocess.run([sys.executable, "-m", "tools.gpu_fake_pg", *sys.argv[1:], "--only", name],
                                 capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"{name} failed:\n{run.stderr[-4000:]}")
            results[name] = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"rank 0 of {args.world_size} fake ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"GPT {vars(size)}, bf16 = {BF16}")
    print(f"{'variant':<26}{'built MiB':>10}{'peak MiB':>10}{'reserved':>10}{'retries':>8}{'step ms':>9}{'left':>6}{'peak/torch':>11}")
    for name, row in results.items():
        anchor = results[anchors.get(name, name)]
        print(f"{name:<26}{row['built_mib']:>10.1f}{row['max_allocated_mib']:>10.1f}{row['max_reserved_mib']:>10.1f}"
              f"{row['alloc_retries']:>8}{row['step_ms']:>9.1f}{row['left_mib']:>6.0f}"
              f"{row['max_allocated_mib'] / anchor['max_allocated_mib']:>11.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"world_size": args.world_size, "size": vars(size), "results": results}, indent=1))


if __name__ == "__main__":
    main()
