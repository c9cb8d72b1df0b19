"""Train a Hugging Face Transformers GPT-2 (a small config built in memory, nothing downloaded) with
fsdp1 on the bundled sonnets, one unit per ``GPT2Block``: the character-level task of
``train_gpt.py`` on a model nobody here wrote (tied input and output embeddings). Run it from the
repository root, as a module (it imports ``examples.train_gpt``):

    torchrun --standalone --nproc-per-node 2 -m examples.train_hf_gpt2 --comm-quantization int8 --losses out/hf_int8.json

It needs transformers (``pip install -e ".[test]"``). ``--comm-quantization`` sends the gathers and the
gradient reductions block-quantized; ``examples/plot_losses.py`` compares the ``--losses`` of runs.
"""

import argparse
import time
from typing import List

import torch
import torch.distributed as dist

import fsdp1
from fsdp1.wrap import ModuleWrapPolicy

from examples.train_gpt import (
    COMM_QUANTIZATION,
    add_training_arguments,
    batch,
    fixed_batches_loss,
    init_distributed,
    load_corpus,
    write_losses,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser, steps=500)
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.set_num_threads(1)
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data, vocab = load_corpus(args.text)
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=vocab, n_positions=args.block_size, n_embd=args.d_model, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = fsdp1.FullyShardedDataParallel(GPT2LMHeadModel(config), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                                           comm_quantization=COMM_QUANTIZATION[args.comm_quantization])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def loss_of(inputs: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        return model(input_ids=inputs, labels=inputs).loss  # the model shifts the labels itself

    losses: List[torch.Tensor] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = loss_of(*batch(data, args.block_size, args.batch_size, args.seed * world_size + rank, step))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if rank == 0 and (step % 100 == 0 or step == args.steps):
            print(f"step {step:4d} | loss {loss.item():.4f} (rank 0) | {time.perf_counter() - start:.1f} s", flush=True)
    eval_loss = fixed_batches_loss(loss_of, data, args.block_size, args.batch_size, args.eval_batches) if args.eval_batches else None
    if args.losses is not None:
        write_losses(args.losses, 1, torch.stack(losses), rank, eval_loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
