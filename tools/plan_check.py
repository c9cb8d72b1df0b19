"""Check the planner against a stopwatch: plan a model, then train every candidate that fits on real
ranks, and compare predicted peaks and step-time ratios with measured ones.

    python -m tools.plan_check                         # the benchmark's GPT, FSDP1, 2 gloo ranks
    python -m tools.plan_check --model llama --api fully_shard --world-size 2

Run it from the repository root. The budget is set halfway between FULL_SHARD's peak with no block
and with every block checkpointed (or ``--budget-mib``), so the plan must trade speed for memory;
the cost model is calibrated by the planner's own probe of this machine. Each rank builds every
candidate that fits (and the bare model: forward and backward, no wrapper, the reference of the
step ratio; and again, as the A/A noise control) and times them in interleaved rounds, as the
benchmark does (the order rotates each
round, a barrier precedes each step, a step's time is the slowest rank's). Peaks are counted on
each rank over two training steps of each candidate by ``LiveStorageTracker``.

It prints one row a candidate: predicted and measured peak, predicted and measured step ratio, and
whether the plan's choice is the measured fastest or within 5% of it.
"""

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

import fsdp1
from fsdp1._planner.dry_run import DryRun, Workload
from fsdp1._planner.settings import Settings, blocks_of, find_blocks
from fsdp1.plan import Plan

from tools.workload import GPTSize

MIB = 2**20


def _gpt() -> nn.Module:
    return GPTSize().make_model()


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=4096, n_embd=256, n_layer=4, n_head=4, n_positions=128))


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=4096, hidden_size=256, intermediate_size=344, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                                            num_local_experts=4, num_experts_per_tok=2, experts_implementation="grouped_mm"))


def _gpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _causal_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def _padded_loss(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, mask, labels = batch
    return model(input_ids=tokens, attention_mask=mask, labels=labels, use_cache=False).loss


def _tokens(length: int) -> Callable[[int], torch.Tensor]:
    """A rank's batch: two sequences of ``length`` tokens."""
    return lambda rank: torch.randint(0, 4096, (2, length), generator=torch.Generator().manual_seed(rank))


def _padded(rank: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank's batch of two sequences, the second padded after a quarter, the padding's labels -100."""
    tokens, mask = _tokens(128)(rank), torch.ones(2, 128, dtype=torch.long)
    mask[1, 32:] = 0
    return tokens, mask, tokens.masked_fill(mask == 0, -100)


MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[nn.Module, Any], torch.Tensor], Callable[[int], Any]]] = {
    "gpt": (_gpt, _gpt_loss, _tokens(129)), "llama": (_llama, _causal_lm_loss, _tokens(128)),
    "gpt2": (_gpt2, _causal_lm_loss, _tokens(128)), "llama-padded": (_llama, _padded_loss, _padded),
    "mixtral": (_mixtral, _causal_lm_loss, _tokens(128))}
"""The benchmark's GPT (5.3 M parameters) and Transformers models of its size: factory, loss, a
rank's batch. ``llama-padded`` trains on padded rows with ignored labels and ``mixtral`` routes its
tokens to experts: forwards that read the batch's values."""


def _budget(model: str, api: str, world_size: int) -> int:
    build, loss, batch = MODELS[model]
    with torch.device("meta"):
        classes = find_blocks(build(), None)
        blocks = len(blocks_of(build(), classes))
    dry_run = DryRun(Workload(build, batch(0), loss, torch.optim.AdamW), classes, "cpu", None)
    settings = Settings(api, fsdp1.ShardingStrategy.FULL_SHARD)
    with dry_run.process_group(world_size):
        none, every = dry_run.measure(settings), dry_run.measure(settings.replace(checkpointed=blocks))
    return (none.peak + every.peak) // 2


def _rank(rank: int, world_size: int, port: int, model: str, plan: Plan, rounds: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    build, loss, batch = MODELS[model]
    tokens = batch(rank)
    fitting = [c.settings for c in plan.candidates if c.fits]
    peaks = {}
    for index, settings in enumerate(fitting):
        torch.manual_seed(0)
        peaks[index] = dataclasses.replace(plan, settings=settings).measure_peak(build, tokens, loss)
    torch.manual_seed(0)
    runs: Dict[Any, Tuple[nn.Module, Any]] = {"bare": (build(), None)}
    torch.manual_seed(0)
    runs["bare_aa"] = (build(), None)  # the same again: the A/A noise control
    for index, settings in enumerate(fitting):
        torch.manual_seed(0)
        wrapped = dataclasses.replace(plan, settings=settings).apply(build())
        runs[index] = (wrapped, torch.optim.AdamW(wrapped.parameters()))
    names = list(runs)
    times: Dict[Any, List[Tuple[int, float]]] = {name: [] for name in names}
    for r in range(-1, rounds):  # round -1 warms up
        for name in names[r % len(names):] + names[: r % len(names)]:
            module, optimizer = runs[name]
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                loss(module, tokens).backward()
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                else:
                    module.zero_grad(set_to_none=True)
                seconds = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                if r >= 0:
                    times[name].append((r, seconds.item()))
    peak_list = torch.tensor([peaks[i] for i in range(len(fitting))], dtype=torch.float64)
    dist.all_reduce(peak_list, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"peaks": peak_list.tolist(), "times": {str(k): v for k, v in times.items()}}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    parser.add_argument("--api", choices=["FullyShardedDataParallel", "fully_shard"], default="FullyShardedDataParallel")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--budget-mib", type=float)
    parser.add_argument("--bf16", action="store_true", help="let the plan choose bfloat16 too")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--json", default="bench_out/plan_check.json")
    args = parser.parse_args()
    build, loss, batch = MODELS[args.model]
    budget = int(args.budget_mib * MIB) if args.budget_mib else _budget(args.model, args.api, args.world_size)
    plan = fsdp1.plan(build, batch(0), loss, world_size=args.world_size, device_memory=budget, api=args.api,
                      device_type="cpu", headroom=0.0, param_dtypes=(None, torch.bfloat16) if args.bf16 else (None,))
    print(plan)
    raw = args.json + ".raw"
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    mp.spawn(_rank, nprocs=args.world_size, args=(args.world_size, 29700 + os.getpid() % 1000, args.model, plan,
                                                   args.rounds, args.steps_per_round, raw))
    with open(raw) as f:
        measured = json.load(f)
    os.remove(raw)
    _report(plan, measured, args)


def _report(plan: Plan, measured: Dict[str, Any], args: argparse.Namespace) -> None:
    def per_round_median(rows: List[List[float]]) -> Dict[int, float]:
        rounds: Dict[int, List[float]] = {}
        for r, seconds in rows:
            rounds.setdefault(int(r), []).append(seconds)
        return {r: statistics.median(v) for r, v in rounds.items()}

    bare = per_round_median(measured["times"]["bare"])
    fitting = [c for c in plan.candidates if c.fits]
    ratios = []
    for index in range(len(fitting)):
        mine = per_round_median(measured["times"][str(index)])
        ratios.append(statistics.median(mine[r] / bare[r] for r in mine))
    fastest = min(ratios)
    aa = per_round_median(measured["times"]["bare_aa"])
    noise = [aa[r] / bare[r] for r in aa]
    rows = []
    print(f"\n{'candidate':46} {'peak MiB pred':>13} {'measured':>9} {'/':>6} {'ratio pred':>10} {'measured':>9}")
    for candidate, peak, ratio in zip(fitting, measured["peaks"], ratios):
        chosen = candidate.settings == plan.settings
        predicted_ratio = plan.ratio(candidate)
        assert predicted_ratio is not None
        rows.append({"candidate": candidate.settings.describe(plan.num_blocks), "chosen": chosen,
                     "predicted_peak": candidate.footprint.peak, "measured_peak": peak,
                     "predicted_ratio": predicted_ratio, "measured_ratio": ratio})
        print(f"{'* ' if chosen else '  '}{candidate.settings.describe(plan.num_blocks):44} "
              f"{candidate.footprint.peak / MIB:13.2f} {peak / MIB:9.2f} {candidate.footprint.peak / peak:6.3f} "
              f"{predicted_ratio:10.2f} {ratio:9.2f}")
    choice = ratios[[c.settings for c in fitting].index(plan.settings)]
    verdict = "the measured fastest" if choice == fastest else f"{choice / fastest - 1:.1%} slower than the measured fastest"
    print(f"\nThe plan's choice is {verdict} ({'within' if choice <= 1.05 * fastest else 'NOT within'} 5%). "
          f"A/A (the bare model against itself, per round): {min(noise):.2f}-{max(noise):.2f}. "
          f"Step ratios are to the bare model's forward and backward on the same ranks; "
          f"costs calibrated on {plan.calibration.measured_on}.")
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "api": args.api, "world_size": args.world_size, "budget": plan.device_memory,
                   "calibration": plan.calibration.as_dict(), "rows": rows, "choice_over_fastest": choice / fastest,
                   "aa": [min(noise), max(noise)]}, f, indent=1)


if __name__ == "__main__":
    main()
