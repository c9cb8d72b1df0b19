"""The round-trip error and the bytes of fsdp1's block quantization, by block size, on the weights and
the gradients of a real model: a Hugging Face GPT-2 built from a small config in memory, its
gradients from one batch of the bundled sonnets.

    python -m tools.codec_error                  # int8 and float8 e4m3, blocks of 32 to 4096 values

For each dtype and block size: bytes sent per value (codes and scales), and the relative error
``||decode(encode(x)) - x|| / ||x||`` over every weight and every gradient, each parameter encoded as
one run (as a rank's shard is); ``tensor`` is one scale for the whole parameter, the baseline that
block scales improve on. Needs transformers (``pip install -e ".[test]"``).
"""

import argparse
from typing import Dict, List

import torch

from fsdp1._engine.quantization import BlockCodec

from examples.train_gpt import DEFAULT_TEXT, batch, load_corpus


def _model_and_gradients(d_model: int, layers: int) -> List[Dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    data, vocab = load_corpus(DEFAULT_TEXT)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=d_model, n_layer=layers, n_head=4,
                                                   bos_token_id=0, eos_token_id=0))
    inputs, _ = batch(data, 64, 8, 0, 1)
    model(input_ids=inputs, labels=inputs).loss.backward()
    named = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    return [{name: p.detach().reshape(-1) for name, p in named}, {name: p.grad.reshape(-1) for name, p in named}]


def _relative_error(codec_of, tensors: Dict[str, torch.Tensor]) -> float:
    error = total = 0.0
    for values in tensors.values():
        codec = codec_of(values.numel())
        encoded = torch.empty(codec.encoded_nbytes(values.numel()), dtype=torch.uint8)
        codec.encode_into(values, encoded)
        decoded = torch.empty_like(values)
        codec.decode_into(encoded, decoded)
        error += (decoded - values).double().square().sum().item()
        total += values.double().square().sum().item()
    return (error / total) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    weights, grads = _model_and_gradients(args.d_model, args.layers)
    values = sum(v.numel() for v in weights.values())
    print(f"GPT-2 d={args.d_model} L={args.layers}: {values:,} values in {len(weights)} parameters")
    print(f"{'dtype':>14} {'block':>6} {'bytes/value':>11} {'weights error':>13} {'gradients error':>15}")
    for dtype in (torch.int8, torch.float8_e4m3fn):
        for block in (32, 64, 128, 256, 512, 1024, 4096, None):
            def codec_of(numel: int, block=block) -> BlockCodec:
                return BlockCodec(dtype, block or max(numel, 1))
            nbytes = sum(codec_of(v.numel()).encoded_nbytes(v.numel()) for v in weights.values()) / values
            print(f"{str(dtype).removeprefix('torch.'):>14} {block or 'tensor':>6} {nbytes:11.4f} "
                  f"{_relative_error(codec_of, weights):13.2e} {_relative_error(codec_of, grads):15.2e}")


if __name__ == "__main__":
    main()
