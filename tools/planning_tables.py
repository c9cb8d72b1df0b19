"""The tables of docs/planning.md, made by the planner: public model sizes on a node of 8 GPUs of each
profile (A100 40 and 80 GB, H100 SXM, H200, at their memories), in full precision and in bf16 mixed
precision.

    python -m tools.planning_tables > tables.md        # about 25 minutes on a 2-core CPU

Run it from the repository root; Transformers must be installed. The step costs are each GPU's
profile (its vendor's peak rates), so no GPU is needed, and the ratios compare within a GPU's rows.
"""

import argparse
from typing import List, Optional

import torch

import fsdp1
from fsdp1.plan import PROFILES, NoPlanFits, profile
from fsdp1.plan.__main__ import PRESETS, _causal_lm_loss

GIB = 2**30


def _build(preset: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(PRESETS[preset])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    return lambda: AutoModelForCausalLM.from_config(config)


def _row(preset: str, gpu: str, dtype: Optional[torch.dtype], args: argparse.Namespace) -> str:
    positions = PRESETS[preset].get("max_position_embeddings") or PRESETS[preset]["n_positions"]
    tokens = torch.zeros(args.batch, min(args.seq, positions), dtype=torch.long)
    memory = PROFILES[gpu].memory
    label = f"{gpu} ({memory // GIB} GiB)"
    try:
        plan = fsdp1.plan(_build(preset), tokens, _causal_lm_loss, world_size=args.world_size, device_memory=memory,
                          param_dtypes=(dtype,), host_memory=args.host_memory,
                          calibration=profile(gpu, gpus_per_node=min(8, args.world_size)))
    except NoPlanFits as error:
        smallest = error.smallest.footprint.peak / GIB
        ways = ([f"{error.ranks} ranks"] if error.ranks else []) + ([f"a batch of {error.batch}"] if error.batch else [])
        return f"| {preset} | {label} | nothing fits (smallest peak {smallest:.1f} GiB) | | | | {' or '.join(ways) or '-'} |"
    return (f"| {preset} | {label} | {plan.settings.describe(plan.num_blocks)} | {plan.peak / GIB:.1f} | "
            f"{plan.host / GIB:.1f} | {plan.step_ratio:.2f} | {len(plan.candidates)} runs, {plan.seconds:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["gpt2-xl", "llama-2-7b", "llama-2-13b"])
    parser.add_argument("--gpus", nargs="+", choices=sorted(PROFILES), default=["a100-40gb", "a100-80gb", "h100-sxm", "h200"])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--host-memory", default="128GiB")
    args = parser.parse_args()
    for title, dtype in (("Full precision (fp32 parameters, gathers and compute)", None),
                         ("bf16 mixed precision (bf16 gathers and compute, fp32 reduction and optimizer)", torch.bfloat16)):
        lines: List[str] = [f"### {title}", "",
                            "| model | GPU | plan | peak GiB | host GiB a rank | step ratio | search / would fit |",
                            "|---|---|---|---|---|---|---|"]
        for preset in args.presets:
            for gpu in args.gpus:
                lines.append(_row(preset, gpu, dtype, args))
        print("\n".join(lines) + "\n", flush=True)
    print(f"{args.world_size} ranks, batch {args.batch} x {args.seq} tokens a rank (GPT-2's 1024 positions for gpt2-xl), AdamW, {args.host_memory} of host memory "
          f"a rank for offload, 10% of device memory left free; step costs from each GPU's profile, "
          f"{min(8, args.world_size)} GPUs a node.")


if __name__ == "__main__":
    main()
