"""Compare the loss curves of runs of one example on the same data (``--losses`` files of
``train_gpt.py``, ``train_gpt_fully_shard.py`` or ``train_hf_gpt2.py``), and plot them with matplotlib
installed. The first run is the baseline the others are measured against; where every run has an
``--eval-batches`` loss, that too.

    python examples/plot_losses.py none=out/none.json int8=out/int8.json --plot out/curves.png
"""

import argparse
import json
from pathlib import Path
from typing import Dict, List

LAST = 25  # steps the end-of-run mean covers: one batch's loss alone is noisy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=FILE", help="a label and a --losses file; the first is the baseline")
    parser.add_argument("--plot", type=Path, help="write a PNG of every curve here")
    parser.add_argument("--title", default="the same data, each setting")
    args = parser.parse_args()
    curves: Dict[str, List[float]] = {}
    eval_losses: Dict[str, float] = {}  # --eval-batches's, where every run has one
    for run in args.runs:
        label, _, path = run.partition("=")
        record = json.loads(Path(path).read_text())
        curves[label] = record["losses"]
        if "eval_loss" in record:
            eval_losses[label] = record["eval_loss"]
    (base_label, base), *_ = curves.items()
    for label, losses in curves.items():
        final, mean = losses[-1], sum(losses[-LAST:]) / len(losses[-LAST:])
        base_mean = sum(base[-LAST:]) / len(base[-LAST:])
        line = (f"{label:>16}: {len(losses)} steps, loss {losses[0]:.4f} -> {final:.4f} "
                f"({(final / base[-1] - 1) * 100:+.2f}% against {base_label}); mean of the last {LAST} steps {mean:.4f} "
                f"({(mean / base_mean - 1) * 100:+.2f}%)")
        if len(eval_losses) == len(curves):
            line += f"; fixed batches {eval_losses[label]:.4f} ({(eval_losses[label] / eval_losses[base_label] - 1) * 100:+.2f}%)"
        print(line)
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot")
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, losses in curves.items():
            ax.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1)
        ax.set(xlabel="step", ylabel="mean loss over ranks", title=args.title)
        ax.legend()
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
