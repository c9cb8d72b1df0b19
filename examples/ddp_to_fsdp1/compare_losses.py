"""Compare the loss curves of train_ddp.py and train_fsdp1.py (and plot them with matplotlib installed).

    python examples/ddp_to_fsdp1/compare_losses.py ddp.json fsdp1.json --plot losses.png
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ddp", type=Path)
    parser.add_argument("fsdp1", type=Path)
    parser.add_argument("--plot", type=Path, help="write a PNG of both curves here")
    args = parser.parse_args()
    ddp, ours = json.loads(args.ddp.read_text()), json.loads(args.fsdp1.read_text())
    worst = max(range(len(ddp)), key=lambda i: abs(ddp[i] - ours[i]))
    print(f"{len(ddp)} steps: loss {ddp[0]:.4f} -> {ddp[-1]:.4f} with DDP, {ours[0]:.4f} -> {ours[-1]:.4f} with fsdp1; "
          f"{sum(a == b for a, b in zip(ddp, ours))} of {len(ddp)} steps bitwise equal, largest difference "
          f"{abs(ddp[worst] - ours[worst]):.3g} (step {worst + 1})")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot")
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(range(1, len(ddp) + 1), ddp, label="DDP", linewidth=3, alpha=0.5)
        ax.plot(range(1, len(ours) + 1), ours, label="fsdp1 FULL_SHARD", linestyle="--")
        ax.set(xlabel="step", ylabel="mean loss over ranks", title="The same script, DDP and fsdp1")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
