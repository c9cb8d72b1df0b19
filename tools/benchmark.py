"""Side-by-side benchmark: fsdp1 against torch's FSDP1, torch's FSDP2 and DDP on one GPT model.

    python tools/benchmark.py                  # 2 gloo ranks on CPU, about a minute
    python tools/benchmark.py --json out.json

Every variant is built in the same two processes and timed in interleaved rounds (the order rotates
each round, a barrier precedes each step), against a ``local`` variant (no wrapper, no collectives,
run on both ranks at once: the compute floor) and a second ``local`` as the A/A noise control.
Reported per variant: median wall and CPU ms per step (max over ranks), the per-round paired ratio
to torch's FSDP1 as median [min, max], bytes all-gathered / reduce-scattered / all-reduced per
rank and step (counted by a dispatch mode on c10d ops, in a separate step), and the bytes of
parameters + gradients + optimizer state that the optimizer can see, per rank after a step and
``zero_grad(set_to_none=True)`` (so 12 bytes per sharded parameter with AdamW). Storage hidden
from the optimizer (e.g. torch's flat gradient kept under use_orig_params) is not in that column;
peak memory needs a live-storage tracker, which is not built yet.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp1

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPT, Block  # noqa: E402 - the example's model, so both measure the same code

VOCAB, SEQ, D_MODEL, LAYERS, HEADS, BATCH = 4096, 128, 256, 4, 4, 2


def make_model() -> nn.Module:
    """The GPT of examples/train_gpt.py, at the benchmark's size."""
    return GPT(VOCAB, SEQ, D_MODEL, LAYERS, HEADS)


def _ours(strategy, use_orig_params, model):
    return fsdp1.FullyShardedDataParallel(
        model, sharding_strategy=fsdp1.ShardingStrategy[strategy],
        auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)


def _torch_fsdp1(strategy, use_orig_params, model):
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FullyShardedDataParallel(
        model, sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params, device_id=torch.device("cpu"))


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _ddp(model):
    return nn.parallel.DistributedDataParallel(model)


VARIANTS = {
    "local": lambda m: m,
    "local_aa": lambda m: m,
    "ddp": _ddp,
    "torch_fsdp1_full": partial(_torch_fsdp1, "FULL_SHARD", False),
    "fsdp1_full": partial(_ours, "FULL_SHARD", False),
    "torch_fsdp1_full_orig": partial(_torch_fsdp1, "FULL_SHARD", True),
    "fsdp1_full_orig": partial(_ours, "FULL_SHARD", True),
    "torch_fsdp1_grad_op": partial(_torch_fsdp1, "SHARD_GRAD_OP", False),
    "fsdp1_grad_op": partial(_ours, "SHARD_GRAD_OP", False),
    "torch_fsdp1_no_shard": partial(_torch_fsdp1, "NO_SHARD", False),
    "fsdp1_no_shard": partial(_ours, "NO_SHARD", False),
    "torch_fsdp2": _fsdp2,
}
ANCHOR = {"fsdp1_full": "torch_fsdp1_full", "fsdp1_full_orig": "torch_fsdp1_full_orig",
          "fsdp1_grad_op": "torch_fsdp1_grad_op", "fsdp1_no_shard": "torch_fsdp1_no_shard"}


class CommBytes(TorchDispatchMode):
    """Payload bytes per collective kind: all-gather output, reduce-scatter input, all-reduce tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.payload = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.__name__
            if name.startswith(("_allgather_base_", "allgather_")):
                self.payload["all_gather"] += _nbytes(args[0])
            elif name.startswith(("_reduce_scatter_base_", "reduce_scatter_")):
                self.payload["reduce_scatter"] += _nbytes(args[1])
            elif name.startswith("allreduce"):
                self.payload["all_reduce"] += _nbytes(args[0])
        return func(*args, **(kwargs or {}))


def _nbytes(obj):
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return sum(_nbytes(o) for o in obj) if isinstance(obj, (list, tuple)) else 0


def _state_bytes(model, optim):
    """Bytes of distinct storages held by parameters, gradients and optimizer state on this rank."""
    seen, total = set(), 0
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optim.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _run(rank, world_size, port, rounds, steps_per_round, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    base = make_model()
    num_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(4)]
    models, optims = {}, {}
    for name, wrap in VARIANTS.items():
        models[name] = wrap(copy.deepcopy(base))
        optims[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3, foreach=True)

    def step(name, i):
        tokens = data[i % len(data)]
        logits = models[name](tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optims[name].step()
        optims[name].zero_grad(set_to_none=True)
        return loss.item()

    losses = {name: [step(name, i) for i in range(2)] for name in VARIANTS}  # warm-up
    wall, cpu = defaultdict(list), defaultdict(list)
    names = list(VARIANTS)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            for i in range(steps_per_round):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                step(name, i)
                times = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
                dist.all_reduce(times, op=dist.ReduceOp.MAX)
                wall[name].append((r, times[0].item()))
                cpu[name].append((r, times[1].item()))
    comm, state = {}, {}
    for name in names:
        counter = CommBytes()
        with counter:
            step(name, 0)
        comm[name] = dict(counter.payload)
        state[name] = _state_bytes(models[name], optims[name])
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"world_size": world_size, "num_params": num_params, "wall": wall, "cpu": cpu,
                       "comm": comm, "state_bytes": state, "losses": losses}, f)
    dist.destroy_process_group()


def _per_round(samples):
    rounds = defaultdict(list)
    for r, value in samples:
        rounds[r].append(value)
    return {r: statistics.median(v) for r, v in rounds.items()}


def report(result):
    ws, psi = result["world_size"], result["num_params"]
    f = (ws - 1) / ws
    print(f"GPT V={VOCAB} T={SEQ} d={D_MODEL} L={LAYERS}: {psi:,} params ({psi * 4 / 2**20:.2f} MiB fp32), "
          f"{ws} gloo ranks, batch {BATCH}/rank, AdamW(foreach)")
    header = f"{'variant':24} {'wall ms':>8} {'cpu ms':>8} {'wall/anchor':>18} {'cpu/anchor':>18} {'comm MiB/rank':>14} {'P+O MiB/rank':>15}"
    print(header)
    print("-" * len(header))
    rows = {}
    for name, samples in result["wall"].items():
        wall_ms = statistics.median(v for _, v in samples) * 1e3
        cpu_ms = statistics.median(v for _, v in result["cpu"][name]) * 1e3
        comm = result["comm"][name]
        per_rank = f * (comm.get("all_gather", 0) + comm.get("reduce_scatter", 0)) + 2 * f * comm.get("all_reduce", 0)
        ratios = {}
        anchor = ANCHOR.get(name)
        for kind in ("wall", "cpu"):
            if anchor:
                mine, theirs = _per_round(result[kind][name]), _per_round(result[kind][anchor])
                paired = [mine[r] / theirs[r] for r in mine]
                ratios[kind] = f"{statistics.median(paired):.2f} [{min(paired):.2f},{max(paired):.2f}]"
            else:
                ratios[kind] = "-"
        rows[name] = dict(wall_ms=wall_ms, cpu_ms=cpu_ms, wall_vs_anchor=ratios["wall"], cpu_vs_anchor=ratios["cpu"],
                          comm_mib_per_rank=per_rank / 2**20, state_mib_per_rank=result["state_bytes"][name] / 2**20)
        print(f"{name:24} {wall_ms:8.1f} {cpu_ms:8.1f} {ratios['wall']:>18} {ratios['cpu']:>18} "
              f"{per_rank / 2**20:14.2f} {result['state_bytes'][name] / 2**20:15.2f}")
    print(f"minimum comm per rank: FULL_SHARD <= 3f*psi*4 B = {3 * f * psi * 4 / 2**20:.2f} MiB "
          f"(less the root's backward all-gather), SHARD_GRAD_OP/NO_SHARD/DDP 2f*psi*4 B = {2 * f * psi * 4 / 2**20:.2f} MiB; "
          f"params+optimizer state after zero_grad (P+O)/N = {12 * psi / ws / 2**20:.2f} MiB")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--json", default="bench_out/benchmark.json")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    raw = args.json + ".raw"
    port = 29600 + os.getpid() % 1000
    mp.spawn(_run, args=(args.world_size, port, args.rounds, args.steps_per_round, raw), nprocs=args.world_size)
    with open(raw) as f:
        result = json.load(f)
    os.remove(raw)
    rows = report(result)
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "raw": result}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
