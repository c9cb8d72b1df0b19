"""train_ddp.py migrated to fsdp1: `diff train_ddp.py train_fsdp1.py` shows every changed line.

    torchrun --standalone --nproc-per-node 2 -m examples.ddp_to_fsdp1.train_fsdp1 --losses fsdp1.json

from the repository root (``-m``: it imports the GPT of ``examples/train_gpt.py``).
"""

import argparse
import json
from pathlib import Path

import torch
from torch.nn import functional as F

import fsdp1
from fsdp1.wrap import ModuleWrapPolicy

from examples.train_gpt import DEFAULT_TEXT, GPT, Block, batch, init_distributed, load_corpus, mean_over_ranks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--losses", type=Path, help="write the per-step mean loss here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_distributed()
    rank = torch.distributed.get_rank()
    data, vocab = load_corpus(DEFAULT_TEXT)

    torch.manual_seed(0)
    model = GPT(vocab, block_size=64, d_model=128, n_layers=4, n_heads=4)
    model = fsdp1.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

    losses = []
    for step in range(args.steps):
        inputs, targets = batch(data, block_size=64, batch_size=8, seed=rank, step=step)
        loss = F.cross_entropy(model(inputs).reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss))
    if rank == 0:
        print(f"{args.steps} steps, final loss {losses[-1]:.6f}")
        if args.losses:
            args.losses.write_text(json.dumps(losses))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
