"""The tables of docs/planning.md, made by the planner: public model sizes on 8 devices of 24, 40 and
80 GiB, in full precision and in bf16 mixed precision.

    python -m tools.planning_tables > tables.md        # about 20 minutes on a 2-core CPU

Run it from the repository root; Transformers must be installed. Every plan uses one probe of this
machine (saved next to the output as calibration.json), so the step ratios are comparable with each
other, and hold for this machine only.
"""

import argparse
import json
from typing import List, Optional

import torch

import fsdp1
from fsdp1.plan import Calibration, NoPlanFits
from fsdp1.plan.__main__ import PRESETS, _causal_lm_loss

GIB = 2**30


def _build(preset: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(PRESETS[preset])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    return lambda: AutoModelForCausalLM.from_config(config)


def _row(preset: str, memory: int, dtype: Optional[torch.dtype], args: argparse.Namespace, calibration: Calibration) -> str:
    positions = PRESETS[preset].get("max_position_embeddings") or PRESETS[preset]["n_positions"]
    tokens = torch.zeros(args.batch, min(args.seq, positions), dtype=torch.long)
    try:
        plan = fsdp1.plan(_build(preset), tokens, _causal_lm_loss, world_size=args.world_size, device_memory=f"{memory}GiB",
                          param_dtypes=(dtype,), host_memory=args.host_memory, calibration=calibration)
    except NoPlanFits as error:
        smallest = error.smallest.footprint.peak / GIB
        ways = ([f"{error.ranks} ranks"] if error.ranks else []) + ([f"a batch of {error.batch}"] if error.batch else [])
        return f"| {preset} | {memory} | nothing fits (smallest peak {smallest:.1f} GiB) | | | | {' or '.join(ways) or '-'} |"
    return (f"| {preset} | {memory} | {plan.settings.describe(plan.num_blocks)} | {plan.peak / GIB:.1f} | "
            f"{plan.host / GIB:.1f} | {plan.step_ratio:.2f} | {len(plan.candidates)} runs, {plan.seconds:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["gpt2-xl", "llama-2-7b", "llama-2-13b"])
    parser.add_argument("--memory", nargs="+", type=int, default=[24, 40, 80], help="GiB a device")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--host-memory", default="128GiB")
    parser.add_argument("--calibration", default="calibration.json")
    args = parser.parse_args()
    calibration = Calibration.measure("cuda", fsdp1._planner.cost.OptimizerKind(torch.optim.AdamW, {}))
    with open(args.calibration, "w") as f:
        json.dump({"calibration": calibration.as_dict()}, f, indent=1)
    for title, dtype in (("Full precision (fp32 parameters, gathers and compute)", None),
                         ("bf16 mixed precision (bf16 gathers and compute, fp32 reduction and optimizer)", torch.bfloat16)):
        lines: List[str] = [f"### {title}", "",
                            "| model | GiB a device | plan | peak GiB | host GiB a rank | step ratio | search / would fit |",
                            "|---|---|---|---|---|---|---|"]
        for preset in args.presets:
            for memory in args.memory:
                lines.append(_row(preset, memory, dtype, args, calibration))
        print("\n".join(lines) + "\n", flush=True)
    print(f"{args.world_size} ranks, batch {args.batch} x {args.seq} tokens a rank (GPT-2's 1024 positions for gpt2-xl), AdamW, {args.host_memory} of host memory "
          f"a rank for offload, 10% of device memory left free; step costs calibrated on {calibration.measured_on}.")


if __name__ == "__main__":
    main()
