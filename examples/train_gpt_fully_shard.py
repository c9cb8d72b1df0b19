"""Train the character-level GPT of ``train_gpt.py`` with fsdp1's ``fully_shard`` (torch's FSDP2 API),
and carry a checkpoint over from fsdp1's ``FullyShardedDataParallel``.

Launch (2 CPU ranks):

    torchrun --standalone --nproc-per-node 2 examples/train_gpt_fully_shard.py

Each block is sharded on its own, then the whole model (``fully_shard(block)`` for every block, then
``fully_shard(model)``): every parameter becomes a DTensor sharded along its rows, and
``model.parameters()`` gives the optimizer those DTensors. ``--bf16`` computes in bfloat16
(``MixedPrecisionPolicy``), keeping fp32 parameters, gradients and AdamW state.

Checkpoints are the DTensor state dicts, written through ``torch.distributed.checkpoint`` by
``fsdp1.checkpoint.save`` (committed once every rank wrote its part): the model's ``state_dict()`` and
the optimizer's ``get_optimizer_state_dict``, both keyed by the plain model's names. That is also what
``train_gpt.py`` writes under ``SHARDED_STATE_DICT``, so ``--resume-from out/checkpoints`` continues a
run that ``train_gpt.py`` started with ``FullyShardedDataParallel``: the migration from FSDP1 to FSDP2
needs no conversion step (``make fully-shard`` does exactly this and checks the losses).
"""

import argparse
import json
import time
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.nn import functional as F

import fsdp1
from fsdp1 import checkpoint

from examples.train_gpt import (
    COMM_QUANTIZATION,
    GPT,
    add_training_arguments,
    batch,
    check_checkpoint_dir,
    fixed_batches_loss,
    init_distributed,
    load_corpus,
    mean_over_ranks,
    resume,
)


def shard(model: GPT, bf16: bool, quantization: Optional[fsdp1.BlockQuantization]) -> GPT:
    """Blocks first, then the root (which holds the embeddings and the head)."""
    policy = fsdp1.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else fsdp1.MixedPrecisionPolicy()
    for block in model.blocks:
        fsdp1.fully_shard(block, mp_policy=policy, comm_quantization=quantization)
    return fsdp1.fully_shard(model, mp_policy=policy, comm_quantization=quantization)


def save_checkpoint(model: nn.Module, optim: torch.optim.Optimizer, directory: Path, step: int) -> None:
    checkpoint.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)},
                    directory / f"step_{step:06d}")


def load_checkpoint(model: nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    """Templates of this model and optimizer filled from the checkpoint (written by this script or by
    ``train_gpt.py``'s FullyShardedDataParallel), on any number of ranks."""
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)}
    checkpoint.load(state, path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser, steps=300)
    parser.add_argument("--bf16", action="store_true", help="compute in bfloat16 (MixedPrecisionPolicy)")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("out/fully_shard_checkpoints"))
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints; 0: none")
    parser.add_argument("--resume-from", type=Path, help="a checkpoint directory (this script's or train_gpt.py's)")
    parser.add_argument("--expect", type=Path, help="a --losses file of an uninterrupted run: fail unless this "
                        "run's losses equal its losses of the same steps, bit for bit")
    args = parser.parse_args()

    torch.set_num_threads(1)
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data, vocab = load_corpus(args.text)
    torch.manual_seed(args.seed)
    model = shard(GPT(vocab, args.block_size, args.d_model, args.layers, args.heads), args.bf16,
                  COMM_QUANTIZATION[args.comm_quantization])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs).reshape(-1, vocab).float(), targets.reshape(-1))

    first_step = 1
    if args.resume_from is not None:
        first_step = resume(args.resume_from, lambda path: load_checkpoint(model, optim, path), rank)
    check_checkpoint_dir(args.checkpoint_dir, first_step, args.checkpoint_every)
    losses: List[float] = []
    start = time.perf_counter()
    for step in range(first_step, args.steps + 1):
        inputs, targets = batch(data, args.block_size, args.batch_size, args.seed * world_size + rank, step)
        loss = loss_of(inputs, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss))
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save_checkpoint(model, optim, args.checkpoint_dir, step)
        if rank == 0 and (step % 25 == 0 or step == args.steps):
            print(f"step {step:4d} | loss {losses[-1]:.4f} | {time.perf_counter() - start:.1f} s", flush=True)
    record = {"first_step": first_step, "losses": losses}
    if args.eval_batches:
        record["eval_loss"] = fixed_batches_loss(loss_of, data, args.block_size, args.batch_size, args.eval_batches)
    if rank == 0 and args.losses is not None:
        args.losses.parent.mkdir(parents=True, exist_ok=True)
        args.losses.write_text(json.dumps(record))
    dist.destroy_process_group()
    if args.expect is not None:
        expected = json.loads(args.expect.read_text())
        same_steps = expected["losses"][first_step - expected["first_step"]:]
        if losses != same_steps[: len(losses)]:
            raise SystemExit(f"the losses of steps {first_step}..{args.steps} differ from {args.expect}'s")
        if rank == 0:
            print(f"steps {first_step}..{args.steps}: losses equal {args.expect}'s bit for bit", flush=True)


if __name__ == "__main__":
    main()
