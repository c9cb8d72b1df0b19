"""Train a small character-level GPT with fsdp1 on the bundled sonnets.

Launch (2 CPU ranks: about 35 s of training and a minute in all on the 2-core test machine):

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py

It also runs as one process (``python examples/train_gpt.py``), where FSDP falls back to NO_SHARD.
Rank 0 shows a progress bar with the loss (with tqdm installed; else a line every 25 steps). The end
reports throughput and each rank's memory for parameters, gradients and AdamW state against what
one process would hold for the unsharded model. ``--strategy`` and ``--use-orig-params`` choose the
sharding; ``--text`` another corpus.

Checkpoints: every ``--checkpoint-every`` steps (default 100) the model and the AdamW state are saved
as a sharded checkpoint (``SHARDED_STATE_DICT`` through ``torch.distributed.checkpoint``) in
``--checkpoint-dir``/step_NNNNNN by ``fsdp1.checkpoint.save``, which commits a checkpoint only once
every rank wrote its part (a manifest of every file's size and CRC-32, written last), keeping the
``--keep-checkpoints`` latest (default 3); ``--resume`` continues from the latest committed one,
each file checked against the manifest first, on any number of ranks; on as many ranks as before,
the losses are those of the uninterrupted run bit for bit.
``python tools/checkpoint.py consolidate out/checkpoints/step_000500 model.pt --prefix model.`` turns
one into a single file that loads into the plain model.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

import fsdp1
from fsdp1 import checkpoint
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


def load_corpus(path: Path) -> Tuple[torch.Tensor, int]:
    """The text as character indices, and the number of distinct characters."""
    text = path.read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(chars)


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def progress(first: int, last: int, enabled: bool) -> Iterable[int]:
    """Step numbers first..last, under a tqdm bar where tqdm is installed and ``enabled``."""
    try:
        from tqdm import tqdm
    except ImportError:
        return range(first, last + 1)
    return tqdm(range(first, last + 1), disable=not enabled, unit="step", dynamic_ncols=True)


def state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state: each storage once, and a
    DTensor's local shard (FSDP2's parameters and their optimizer state) rather than its wrapper."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for state in optim.state.values() for t in state.values() if torch.is_tensor(t)]
    storages = {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage() for t in tensors}
    return sum(storage.nbytes() for storage in storages)


def batch(data: torch.Tensor, block_size: int, batch_size: int, seed: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the text, a different stream per rank, drawn afresh from (rank, step) so that
    a resumed run sees the batches the uninterrupted one would have."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=gen)
    window = torch.stack([data[s : s + block_size + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


EVAL_STREAM = 1 << 40
"""``batch``'s stream of the windows ``--eval-batches`` scores (plus the rank): no run's, seed's or
setting's training stream, so that every run is scored on the same text."""


def fixed_batches_loss(loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], data: torch.Tensor,
                       block_size: int, batch_size: int, batches: int) -> float:
    """The mean of ``loss_of(inputs, targets)`` over ``batches`` fixed batches a rank and over the
    ranks, without gradients; rank 0 prints it."""
    with torch.no_grad():
        losses = [loss_of(*batch(data, block_size, batch_size, EVAL_STREAM + dist.get_rank(), index))
                  for index in range(batches)]
    mean = mean_over_ranks(torch.stack(losses).mean())
    if dist.get_rank() == 0:
        print(f"loss over {batches} fixed batches a rank: {mean:.6f}", flush=True)
    return mean


def latest_checkpoint(directory: Path) -> Tuple[int, Optional[Path]]:
    """The committed checkpoint of the highest step, or (0, None): a save cut short never commits."""
    path = checkpoint.latest(directory)
    return (int(path.name[5:]), path) if path is not None else (0, None)


def resume(directory: Path, load: Callable[[Path], None], rank: int) -> int:
    """``load`` the latest committed checkpoint under ``directory``, if any; the first step to train."""
    done, path = latest_checkpoint(directory)
    if path is None:
        return 1
    load(path)
    if rank == 0:
        print(f"resumed from {path} (step {done})", flush=True)
    return done + 1


def check_checkpoint_dir(directory: Path, first_step: int, every: int) -> None:
    """Before training: refuse a run that would save where a committed checkpoint of a step it will
    train is kept already (another run's: ``fsdp1.checkpoint`` never writes into one, and the save
    would fail after the steps before it had trained)."""
    done, path = latest_checkpoint(directory)
    if every and path is not None and done >= first_step:
        raise SystemExit(
            f"{path} is a committed checkpoint of another run at step {done}, which this one would save again: "
            "pass --resume to continue it, or another --checkpoint-dir (or remove this one) to start afresh"
        )


def save_checkpoint(model: nn.Module, optim: torch.optim.Optimizer, directory: Path, step: int, keep: int) -> None:
    """Every rank writes its own dim-0 rows of the parameters and the AdamW moments; the checkpoint is
    committed once every rank has, and only then are all but the ``keep`` latest removed."""
    FSDP = fsdp1.FullyShardedDataParallel
    with FSDP.state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT):
        checkpoint.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)},
                        directory / f"step_{step:06d}")
    checkpoint.prune(directory, keep)


def load_checkpoint(model: nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    """Fill templates of this run's model and fresh optimizer from the checkpoint, on any number of
    ranks; every file is checked against the checkpoint's manifest first."""
    FSDP = fsdp1.FullyShardedDataParallel
    with FSDP.state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        checkpoint.load(state, path)
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))


COMM_QUANTIZATION = {
    "none": None,
    "int8": fsdp1.BlockQuantization(weights=torch.int8, gradients=torch.int8),
    "int8-weights": fsdp1.BlockQuantization(weights=torch.int8, gradients=None),
    "int8-gradients": fsdp1.BlockQuantization(weights=None, gradients=torch.int8),
    "fp8": fsdp1.BlockQuantization(weights=torch.float8_e4m3fn, gradients=torch.float8_e4m3fn),
}
"""``--comm-quantization``: what the gathers and gradient reductions send block-quantized (fsdp1's
own ``comm_quantization``, not torch's; docs/quantized-comm.md)."""


def add_training_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    """The corpus, the model's size and the optimizer's, what the collectives send and where the
    losses go, which every GPT example takes."""
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--comm-quantization", choices=list(COMM_QUANTIZATION), default="none",
                        help="send gathers and gradient reductions block-quantized (fsdp1's own)")
    parser.add_argument("--losses", type=Path, help="write this run's per-step mean losses (JSON)")
    parser.add_argument("--eval-batches", type=int, default=0, help="after training, the mean loss over this many "
                        "fixed batches a rank, the same in every run (also in the --losses file): a final loss that "
                        "the last batch's luck does not move")
    parser.add_argument("--seed", type=int, default=0, help="the initial model's and the batches' seed (a run's twin, "
                        "for telling a setting's effect from a trajectory's chance)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser, steps=500)
    parser.add_argument("--strategy", choices=[s.name for s in fsdp1.ShardingStrategy][:3], default="FULL_SHARD")
    parser.add_argument("--use-orig-params", action="store_true")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("out/checkpoints"))
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints; 0: none")
    parser.add_argument("--keep-checkpoints", type=int, default=3, help="how many of the latest to keep")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    args = parser.parse_args()

    torch.set_num_threads(1)
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data, vocab = load_corpus(args.text)

    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = GPT(vocab, args.block_size, args.d_model, args.layers, args.heads)
    num_params = sum(p.numel() for p in model.parameters())
    model = fsdp1.FullyShardedDataParallel(
        model,
        sharding_strategy=fsdp1.ShardingStrategy[args.strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=args.use_orig_params,
        comm_quantization=COMM_QUANTIZATION[args.comm_quantization],
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs).reshape(-1, vocab), targets.reshape(-1))

    first_step = resume(args.checkpoint_dir, lambda path: load_checkpoint(model, optim, path), rank) if args.resume else 1
    check_checkpoint_dir(args.checkpoint_dir, first_step, args.checkpoint_every)
    if first_step > args.steps:  # nothing left to train: the checkpoint is at or past --steps
        if rank == 0:
            print(f"the latest checkpoint is at step {first_step - 1}, at or past --steps {args.steps}: nothing to "
                  "train; pass a larger --steps to go on", flush=True)
        dist.destroy_process_group()
        return
    bar = progress(first_step, args.steps, enabled=rank == 0)
    losses: List[torch.Tensor] = []  # this rank's, averaged over the ranks once, at the end
    start = time.perf_counter()
    for step in bar:
        inputs, targets = batch(data, args.block_size, args.batch_size, args.seed * world_size + rank, step)
        loss = loss_of(inputs, targets)
        loss.backward()
        optim.step()
        losses.append(loss.detach())
        if step == args.steps:
            held = state_bytes(model, optim)  # with this step's gradients still in place
        optim.zero_grad(set_to_none=True)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save_checkpoint(model, optim, args.checkpoint_dir, step, args.keep_checkpoints)
        if step % 25 == 0 or step == first_step or step == args.steps:
            mean_loss = mean_over_ranks(loss)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{mean_loss:.4f}")
            elif rank == 0:
                print(f"step {step:4d} | loss {mean_loss:.4f} | {time.perf_counter() - start:.1f} s", flush=True)
    seconds = time.perf_counter() - start
    final_loss = mean_over_ranks(loss)
    report(rank, world_size, args, args.steps - first_step + 1, vocab, num_params, held, seconds, final_loss)
    eval_loss = fixed_batches_loss(loss_of, data, args.block_size, args.batch_size, args.eval_batches) if args.eval_batches else None
    if args.losses is not None:
        write_losses(args.losses, first_step, torch.stack(losses), rank, eval_loss)
    dist.destroy_process_group()


def write_losses(path: Path, first_step: int, losses: torch.Tensor, rank: int, eval_loss: Optional[float] = None) -> None:
    """Rank 0 writes every step's loss, averaged over the ranks, as ``train_gpt_fully_shard.py`` does,
    and the ``--eval-batches`` loss where there is one."""
    dist.all_reduce(losses)
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"first_step": first_step, "losses": (losses / dist.get_world_size()).tolist()}
        path.write_text(json.dumps(record if eval_loss is None else {**record, "eval_loss": eval_loss}))


def report(rank, world_size, args, steps, vocab, num_params, held, seconds, final_loss) -> None:
    """Throughput, and each rank's parameter + gradient + AdamW memory against one unsharded copy."""
    tokens = steps * args.batch_size * args.block_size * world_size
    unsharded = 16 * num_params  # fp32 parameter, gradient and two AdamW moments per element
    if rank == 0:
        print(f"{steps} steps in {seconds:.1f} s: {tokens / seconds:,.0f} tokens/s over {world_size} rank(s); "
              f"final loss {final_loss:.6f} (uniform guess {math.log(vocab):.2f})", flush=True)
    for r in range(world_size):
        if r == rank:
            line = (f"rank {rank}: parameters + gradients + AdamW state {held / 2**20:.2f} MiB, "
                    f"unsharded model {unsharded / 2**20:.2f} MiB ({held / unsharded:.0%})")
            if torch.cuda.is_available():
                line += f"; CUDA peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB"
            print(line, flush=True)
        dist.barrier()


if __name__ == "__main__":
    main()
