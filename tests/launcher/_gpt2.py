"""A tiny Hugging Face GPT-2, built from a config in memory, and its seeded token batches."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 61


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def token_batches(count, rank):
    generator = torch.Generator().manual_seed(rank)
    return [torch.randint(0, VOCAB, (2, 9), generator=generator) for _ in range(count)]
