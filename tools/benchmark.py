"""Side-by-side benchmark: fsdp1 against torch's FSDP1, torch's FSDP2 and DDP on one GPT model.

    python -m tools.benchmark                     # 2 gloo ranks on CPU, about a minute and a half
    python -m tools.benchmark --variants local fsdp1_full torch_fsdp1_full --rounds 8
    python -m tools.benchmark --device cuda       # NCCL, one rank per GPU

Run it from the repository root, where the ``tools`` and ``examples`` packages are.

Every variant is built in the same processes and timed in interleaved rounds (the order rotates
each round, a barrier precedes each step), next to ``local`` (the model alone, no collectives, run
on every rank at once: the compute floor) and ``local_aa`` (the same again: the A/A noise control).
Per variant it reports:

* median wall and CPU ms per step (max over ranks) and the per-round paired ratio to its anchor
  (torch's FSDP1 with the same strategy) as median [min, max]; a difference smaller than the A/A
  spread is noise;
* bytes all-gathered, reduce-scattered and all-reduced per rank and step, counted by a dispatch mode
  on the c10d operators in a separate step, against the minimum for the strategy;
* peak memory per rank over two training steps, counted by ``memory_estimator.measure`` (live
  storage from the model's construction on), and beside it the same count of the estimator's dry
  run on the meta device;
* parameters + gradients + optimizer state per rank after the optimizer step, against (P+G+O)/N.

Output: a table on the terminal, a JSON file, and a PNG plot next to it when matplotlib is installed.
"""

import argparse
import copy
import json
import os
import statistics
import time
import warnings
from collections import defaultdict
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp1._planner.dry_run import CommBytes, fake_process_group

from tools.memory_estimator import ESTIMATED, estimate, measure
from tools.workload import ANCHOR, CPU_ANCHOR, CUDA_ONLY, VARIANTS, GPTSize, Pipelined, make_optimizer

MIB = 2**20
WARMUP_STEPS = 2


class Rank:
    """One rank's side of the benchmark: every variant's model, optimizer and batches."""

    def __init__(self, size: GPTSize, names: List[str], device: torch.device) -> None:
        self.size, self.names, self.device = size, names, device
        torch.manual_seed(0)
        self.base = size.make_model()
        gen = torch.Generator().manual_seed(dist.get_rank())
        self.batches = [size.make_batch(gen, device) for _ in range(4)]

    def build(self, name: str):
        model = VARIANTS[name](copy.deepcopy(self.base), self.device)
        return model, make_optimizer(model)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, model, optim, i: int, phases: Optional[Dict[str, float]] = None) -> float:
        marks = [time.perf_counter()]
        batch = self.batches[i % len(self.batches)]
        if isinstance(model, Pipelined):  # the schedule runs forward and backward together: all in fwd
            loss = model.forward_backward(batch)
            self._sync()
            marks += [time.perf_counter()] * 2
        else:
            loss = self.size.loss(model, batch)
            self._sync()
            marks.append(time.perf_counter())
            loss.backward()
            self._sync()
            marks.append(time.perf_counter())
        optim.step()
        optim.zero_grad(set_to_none=True)
        self._sync()
        marks.append(time.perf_counter())
        if phases is not None:
            for phase, start, end in zip(("fwd", "bwd", "opt"), marks, marks[1:]):
                phases[phase] = end - start
        return loss.item()

    def time_rounds(self, rounds: int, steps_per_round: int):
        built = {name: self.build(name) for name in self.names}
        for name, (model, optim) in built.items():
            for i in range(WARMUP_STEPS):
                self.step(model, optim, i)
        samples = defaultdict(list)  # name -> [(round, wall, cpu, fwd, bwd, opt)]
        for r in range(rounds):
            order = self.names[r % len(self.names):] + self.names[: r % len(self.names)]
            for name in order:
                model, optim = built[name]
                for i in range(steps_per_round):
                    phases: Dict[str, float] = {}
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    self.step(model, optim, i, phases)
                    times = torch.tensor([time.perf_counter() - t0, time.process_time() - c0,
                                          phases["fwd"], phases["bwd"], phases["opt"]], device=self.device)
                    dist.all_reduce(times, op=dist.ReduceOp.MAX)
                    samples[name].append([r] + times.tolist())
        comm = {}
        for name, (model, optim) in built.items():
            counter = CommBytes()
            with counter:
                self.step(model, optim, 0)
            comm[name] = dict(counter.payload)
        return samples, comm

    def measure_memory(self, name: str) -> Dict[str, float]:
        """Peak live storage over two steps, counted from construction; the state after a step."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        result = vars(measure(self.size, lambda: copy.deepcopy(self.base), VARIANTS[name], self.device, self.batches[:2]))
        if self.device.type == "cuda":
            result["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return result


def _quiet_no_shard_deprecation() -> None:
    """torch and fsdp1 both warn on every NO_SHARD unit; the benchmark measures it on purpose."""
    warnings.filterwarnings("ignore", "The `NO_SHARD` sharding strategy is deprecated", FutureWarning)


def _run(rank, world_size, port, device_type, names, size, rounds, steps_per_round, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _quiet_no_shard_deprecation()
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world_size)
    bench = Rank(size, names, device)
    samples, comm = bench.time_rounds(rounds, steps_per_round)
    memory = {}
    for name in names:
        measured = torch.tensor(list(bench.measure_memory(name).values()), dtype=torch.float64, device=device)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        keys = ["step_start", "peak", "state"] + (["cuda_max_allocated"] if device_type == "cuda" else [])
        memory[name] = dict(zip(keys, measured.tolist()))
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"samples": samples, "comm": comm, "memory": memory}, f)
    dist.destroy_process_group()


def _paired_ratio(samples, name, anchor, column):
    def per_round(rows):
        rounds = defaultdict(list)
        for row in rows:
            rounds[row[0]].append(row[column])
        return {r: statistics.median(v) for r, v in rounds.items()}

    mine, theirs = per_round(samples[name]), per_round(samples[anchor])
    ratios = [mine[r] / theirs[r] for r in mine]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def minimum_comm_bytes(name: str, num_params: int, root_params: int, world_size: int) -> int:
    """Fewest bytes a rank must send (= receive) per step for the variant's strategy (fp32; the
    ``bf16`` variants gather 2 bytes a parameter and reduce in fp32)."""
    f = (world_size - 1) / world_size
    if name.startswith("local") or name.endswith(("_tp", "_pp", "_float8", "_q8")):  # TP moves activations; PP halves the model; float8 and q8 send 1 byte a value: no bound here
        return 0
    gathered = 2 if "bf16" in name else 4
    if "full" in name or name.endswith("fsdp2"):  # all-gather forward and backward (not the root's), reduce-scatter
        return int(f * (gathered * (2 * num_params - root_params) + 4 * num_params))
    return int(f * 4 * 2 * num_params)  # one all-reduce, or all-gather + reduce-scatter


def summarize(raw, size: GPTSize, world_size: int, predicted: Dict[str, Dict[str, int]]):
    model = size.make_model()
    num_params = sum(p.numel() for p in model.parameters())
    root_params = num_params - sum(p.numel() for p in model.blocks.parameters())
    rows = {}
    for name, samples in raw["samples"].items():
        comm = raw["comm"][name]
        comm_bytes = sum(comm.values())  # bytes each kind of collective sent, counted over its own group
        minimum = minimum_comm_bytes(name, num_params, root_params, world_size)
        sharded = "fsdp2" in name or "full" in name or "grad_op" in name
        row = {
            "wall_ms": statistics.median(s[1] for s in samples) * 1e3,
            "cpu_ms": statistics.median(s[2] for s in samples) * 1e3,
            "fwd_bwd_opt_ms": [statistics.median(s[c] for s in samples) * 1e3 for c in (3, 4, 5)],
            "comm_mib": comm_bytes / MIB,
            "comm_vs_min": comm_bytes / minimum if minimum else None,
            "peak_mib": raw["memory"][name]["peak"] / MIB,
            "step_start_mib": raw["memory"][name]["step_start"] / MIB,
            "state_mib": raw["memory"][name]["state"] / MIB,
            "state_bound_mib": 16 * num_params / (world_size if sharded else 1) / MIB,
            "predicted_peak_mib": predicted[name]["peak"] / MIB if name in predicted else None,
        }
        if "cuda_max_allocated" in raw["memory"][name]:
            row["cuda_max_allocated_mib"] = raw["memory"][name]["cuda_max_allocated"] / MIB
        anchor = ANCHOR.get(name)
        if anchor not in raw["samples"]:
            anchor = CPU_ANCHOR.get(name)
        if anchor in raw["samples"]:
            row["wall_vs_anchor"] = _paired_ratio(raw["samples"], name, anchor, 1)
            row["cpu_vs_anchor"] = _paired_ratio(raw["samples"], name, anchor, 2)
            row["peak_vs_anchor"] = raw["memory"][name]["peak"] / raw["memory"][anchor]["peak"]
        rows[name] = row
    return {"num_params": num_params, "root_params": root_params, "rows": rows}


def print_table(summary, size: GPTSize, world_size: int, backend: str) -> None:
    psi = summary["num_params"]
    print(f"GPT V={size.vocab} T={size.seq} d={size.d_model} L={size.layers}: {psi:,} params "
          f"({psi * 4 / MIB:.2f} MiB fp32), {world_size} {backend} ranks, batch {size.batch}/rank, AdamW(foreach)")

    def ratio(r):
        return f"{r['median']:.2f} [{r['min']:.2f},{r['max']:.2f}]" if r else "-"

    def opt(value, fmt):
        return format(value, fmt) if value is not None else "-"

    header = (f"{'variant':22} {'wall ms':>7} {'cpu ms':>7} {'fwd/bwd/opt ms':>15} {'wall/anchor':>17} {'cpu/anchor':>17} "
              f"{'comm MiB':>8} {'/min':>5} {'peak MiB':>8} {'/anchor':>7} {'predicted':>9} {'P+G+O MiB':>9} {'/bound':>6}")
    print(header)
    print("-" * len(header))
    for name, row in summary["rows"].items():
        phases = "/".join(f"{v:.0f}" for v in row["fwd_bwd_opt_ms"])
        print(f"{name:22} {row['wall_ms']:7.1f} {row['cpu_ms']:7.1f} {phases:>15} {ratio(row.get('wall_vs_anchor')):>17} "
              f"{ratio(row.get('cpu_vs_anchor')):>17} {row['comm_mib']:8.2f} {opt(row['comm_vs_min'], '5.3f'):>5} "
              f"{row['peak_mib']:8.2f} {opt(row.get('peak_vs_anchor'), '7.3f'):>7} {opt(row['predicted_peak_mib'], '9.2f'):>9} "
              f"{row['state_mib']:9.2f} {row['state_mib'] / row['state_bound_mib']:6.3f}")
    print("anchor: torch's FSDP1 with the same strategy (torch's fully_shard for fsdp1_fsdp2, local for local_aa). /min: bytes against the strategy's "
          "minimum. predicted: memory_estimator's dry run. /bound: against (P+G+O)/N = 16 B x params / N "
          "(x N for unsharded variants).")


def plot(summary, path: str) -> bool:
    """Wall time, peak memory and bytes per variant, as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = summary["rows"]
    names = list(rows)
    colors = ["tab:green" if n.startswith("fsdp1") else "tab:gray" if n.startswith("local") else "tab:blue" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), sharey=True)
    panels = [("wall ms per step", [rows[n]["wall_ms"] for n in names]),
              ("peak MiB per rank (o: predicted)", [rows[n]["peak_mib"] for n in names]),
              ("MiB communicated per rank and step", [rows[n]["comm_mib"] for n in names])]
    for ax, (title, values) in zip(axes, panels):
        ax.barh(names, values, color=colors)
        ax.set_title(title)
        ax.invert_yaxis()
    for i, n in enumerate(names):
        if rows[n]["predicted_peak_mib"] is not None:
            axes[1].plot(rows[n]["predicted_peak_mib"], i, "ko")
    fig.suptitle("fsdp1 (green) vs torch FSDP1 / FSDP2 / DDP (blue) and no wrapper (gray)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world-size", type=int, help="default: 2 on CPU, every GPU on CUDA")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: every one the device runs")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--json", default="bench_out/benchmark.json")
    defaults = GPTSize()
    for field in ("vocab", "seq", "d_model", "layers", "heads", "batch"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    args = parser.parse_args()
    size = GPTSize(args.vocab, args.seq, args.d_model, args.layers, args.heads, args.batch)
    world_size = args.world_size or (torch.cuda.device_count() if args.device == "cuda" else 2)
    args.variants = args.variants or [v for v in VARIANTS if args.device == "cuda" or v not in CUDA_ONLY]
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)

    _quiet_no_shard_deprecation()
    predicted = {}
    with fake_process_group(world_size):
        for name in args.variants:
            if name in ESTIMATED:
                predicted[name] = vars(estimate(size, VARIANTS[name], device_type=args.device))

    raw_path = args.json + ".raw"
    port = 29600 + os.getpid() % 1000
    mp.spawn(_run, nprocs=world_size, args=(world_size, port, args.device, args.variants, size, args.rounds,
                                            args.steps_per_round, raw_path))
    with open(raw_path) as f:
        raw = json.load(f)
    os.remove(raw_path)
    summary = summarize(raw, size, world_size, predicted)
    print_table(summary, size, world_size, "nccl" if args.device == "cuda" else "gloo")
    with open(args.json, "w") as f:
        json.dump({"size": vars(size), "world_size": world_size, "device": args.device, **summary, "raw": raw}, f, indent=1)
    png = os.path.splitext(args.json)[0] + ".png"
    print(f"wrote {args.json}" + (f" and {png}" if plot(summary, png) else " (install matplotlib for a plot)"))


if __name__ == "__main__":
    main()
