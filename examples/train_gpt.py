"""Train a small character-level GPT with fsdp1 on the bundled sonnets.

Launch (2 CPU ranks, about a minute here):

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py

It also runs as one process (``python examples/train_gpt.py``), where FSDP falls back to NO_SHARD.
Every step prints the loss; the start prints each rank's parameter memory, sharded against the full
model. ``--strategy`` and ``--use-orig-params`` choose the sharding; ``--text`` another corpus.
"""

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import fsdp1
from fsdp1.wrap import ModuleWrapPolicy

DEFAULT_TEXT = Path(__file__).parent / "data" / "sonnets.txt"


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, d_model: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(positions))))


def init_distributed() -> None:
    """Join torchrun's group, or make a one-rank group when run as a plain script."""
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")


def batches(data: torch.Tensor, block_size: int, batch_size: int, seed: int):
    """Random windows of the text, a different stream per rank."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=gen)
        window = torch.stack([data[s : s + block_size + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--strategy", choices=[s.name for s in fsdp1.ShardingStrategy][:3], default="FULL_SHARD")
    parser.add_argument("--use-orig-params", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()

    text = args.text.read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    torch.manual_seed(0)  # the same initial model on every rank
    model = GPT(len(chars), args.block_size, args.d_model, args.layers, args.heads)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = fsdp1.FullyShardedDataParallel(
        model,
        sharding_strategy=fsdp1.ShardingStrategy[args.strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=args.use_orig_params,
    )
    local_bytes = sum(unit._flat_param.numel() * unit._flat_param.element_size()
                      for unit in fsdp1.FullyShardedDataParallel.fsdp_modules(model) if unit._has_params)
    for r in range(world_size):
        if r == rank:
            print(f"rank {rank}/{world_size}: parameters {local_bytes / 2**20:.3f} MiB sharded "
                  f"vs {full_bytes / 2**20:.3f} MiB full ({local_bytes / full_bytes:.1%})", flush=True)
        dist.barrier()

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    stream = batches(data, args.block_size, args.batch_size, seed=rank)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets = next(stream)
        loss = F.cross_entropy(model(inputs).reshape(-1, len(chars)), targets.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world_size
        if rank == 0 and (step % 25 == 0 or step == 1):
            print(f"step {step:4d} | loss {mean_loss.item():.4f} (uniform {math.log(len(chars)):.2f}) "
                  f"| {time.perf_counter() - start:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
