"""Fine-tune a Hugging Face GPT-2 through HF Accelerate with fsdp1 in place of torch's FSDP1, and resume.

The GPT-2 is small and built from a config (nothing is downloaded); it is checkpointed mid-run with
Accelerate's FSDP functions and resumed from that checkpoint.

    torchrun --standalone --nproc-per-node 2 examples/hf_accelerate_fsdp1.py --losses out/run.json
    torchrun --standalone --nproc-per-node 2 examples/hf_accelerate_fsdp1.py --resume --losses out/resumed.json
    torchrun --standalone --nproc-per-node 2 examples/hf_accelerate_fsdp1.py --impl torch --losses out/torch.json

(`make accelerate-example` runs all three, the last two with ``--expect out/run.json``, which fails
unless their losses equal the uninterrupted fsdp1 run's bit for bit.) The script is what an Accelerate user of torch's FSDP1
writes; the one fsdp1 line is ``fsdp1.use_as_torch_fsdp()``.

On a GPU, Accelerate's own FSDP mode does everything: ``Accelerator(fsdp_plugin=...)``, ``prepare``
wraps the model, ``backward``, ``clip_grad_norm_``, ``save_state`` and ``load_state``. Accelerate
enters that mode only on an accelerator, so on CPU the script wraps the model itself with the
plugin's options and calls the same checkpoint functions ``save_state`` would
(``save_fsdp_model`` / ``save_fsdp_optimizer`` and their loaders).
"""

import argparse
import json
import time
from pathlib import Path

import torch

import fsdp1

BLOCK = "GPT2Block"
VOCAB, CONTEXT, BATCH = 96, 32, 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["fsdp1", "torch"], default="fsdp1", help="whose FSDP1 Accelerate drives")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", type=int, default=4, help="checkpoint after this many steps")
    parser.add_argument("--checkpoint", type=Path, default=Path("out/accelerate_checkpoint"))
    parser.add_argument("--state-dict-type", choices=["SHARDED_STATE_DICT", "FULL_STATE_DICT"], default="SHARDED_STATE_DICT")
    parser.add_argument("--use-orig-params", action="store_true")
    parser.add_argument("--resume", action="store_true", help="start from --checkpoint instead of step 0")
    parser.add_argument("--losses", type=Path, help="write the mean loss over ranks of each step run here (JSON)")
    parser.add_argument("--expect", type=Path, help="fail unless the losses equal those of this --losses file bit for bit")
    return parser.parse_args()


def batch(step: int, rank: int, device: torch.device) -> torch.Tensor:
    """Each rank's tokens at ``step``: the same in the uninterrupted and the resumed run."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=generator).to(device)


def main() -> None:
    args = parse_args()
    if args.impl == "fsdp1":
        fsdp1.use_as_torch_fsdp()  # before Accelerate builds anything: it then builds fsdp1 units
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import GPT2Config, GPT2LMHeadModel

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[BLOCK],
        state_dict_type=args.state_dict_type, use_orig_params=args.use_orig_params)
    on_accelerator = torch.cuda.is_available()
    accelerator = Accelerator(fsdp_plugin=plugin) if on_accelerator else Accelerator(cpu=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=CONTEXT,
                                       bos_token_id=0, eos_token_id=0,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # no RNG to resume
    if on_accelerator:
        assert accelerator.distributed_type == DistributedType.FSDP
        model = accelerator.prepare(model)
    else:
        plugin.set_auto_wrap_policy(model)
        model = FSDP(model, auto_wrap_policy=plugin.auto_wrap_policy, use_orig_params=args.use_orig_params,
                     device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if on_accelerator:
        optim = accelerator.prepare(optim)
    accelerator.print(f"{args.impl}: {len(FSDP.fsdp_modules(model))} units of {type(model).__module__}."
                      f"{type(model).__name__}, {'Accelerate FSDP mode on ' + str(accelerator.device) if on_accelerator else 'CPU'}")

    first = 0
    if args.resume:
        if on_accelerator:
            accelerator.load_state(str(args.checkpoint))
        else:
            load_fsdp_model(plugin, accelerator, model, str(args.checkpoint))
            load_fsdp_optimizer(plugin, accelerator, optim, model, str(args.checkpoint))
        first = args.save_at
    losses = []
    for step in range(first, args.steps):
        inputs = batch(step, accelerator.process_index, accelerator.device)
        loss = model(input_ids=inputs, labels=inputs).loss
        accelerator.backward(loss)
        if on_accelerator:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        else:
            model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
        losses.append(mean_loss)
        accelerator.print(f"step {step + 1}: loss {mean_loss:.6f}")
        if step + 1 == args.save_at and not args.resume:
            if on_accelerator:
                accelerator.save_state(str(args.checkpoint))
            else:
                save_fsdp_model(plugin, accelerator, model, str(args.checkpoint))
                save_fsdp_optimizer(plugin, accelerator, optim, model, str(args.checkpoint))
            accelerator.print(f"saved {args.checkpoint}")
    if args.losses and accelerator.is_main_process:
        args.losses.parent.mkdir(parents=True, exist_ok=True)
        args.losses.write_text(json.dumps({"first_step": first, "losses": losses}))
    if args.expect:
        expected = json.loads(args.expect.read_text())
        expected = expected["losses"][first - expected["first_step"]:]
        if losses != expected:
            raise SystemExit(f"losses differ from {args.expect}: {losses} vs {expected}")
        accelerator.print(f"the {len(losses)} losses equal {args.expect}'s bit for bit")
    if args.impl == "torch":
        # gloo's workers may still be releasing the last collective (the loss reduction) when the
        # interpreter finalizes, which aborts the job after its work; fsdp1 waits for them at exit
        # itself (docs/fully_shard.md), torch's does not
        time.sleep(0.1)


if __name__ == "__main__":
    main()
