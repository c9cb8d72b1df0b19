"""Fine-tune a Hugging Face GPT-2 with the Transformers Trainer, fsdp1 in place of torch's FSDP1, and resume.

The GPT-2 is small and built from a config (nothing is downloaded); the Trainer runs it with
``fsdp="full_shard"`` (FSDP1: ``fsdp_config["version"] = 1``), saves a checkpoint mid-run and resumes
from it. Needs a GPU: the Trainer enters FSDP through Accelerate, whose
FSDP mode runs only on accelerators (on CPU, see examples/hf_accelerate_fsdp1.py).

    torchrun --standalone --nproc-per-node 1 examples/hf_trainer_fsdp1.py --output out/trainer --losses out/trainer.json
    torchrun --standalone --nproc-per-node 1 examples/hf_trainer_fsdp1.py --output out/trainer --resume --expect out/trainer.json
    torchrun --standalone --nproc-per-node 1 examples/hf_trainer_fsdp1.py --impl torch --output out/trainer_torch --expect out/trainer.json

``--expect`` fails unless this run's logged losses equal those of an earlier ``--losses`` file at the
same steps, bit for bit. The only fsdp1 line is ``fsdp1.use_as_torch_fsdp()``, called before
``transformers`` is imported (``trainer_seq2seq`` binds torch's class when it is imported).
"""

import argparse
import json
from pathlib import Path

import torch

import fsdp1

VOCAB, CONTEXT, EXAMPLES = 96, 32, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["fsdp1", "torch"], default="fsdp1", help="whose FSDP1 the Trainer drives")
    parser.add_argument("--output", type=Path, default=Path("out/trainer"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", type=int, default=4)
    parser.add_argument("--resume", action="store_true", help="resume from the checkpoint saved at --save-at")
    parser.add_argument("--losses", type=Path, help="write the logged loss of each step here (JSON)")
    parser.add_argument("--expect", type=Path, help="fail unless the losses equal those of this --losses file bit for bit")
    return parser.parse_args()


class TokenData(torch.utils.data.Dataset):
    """Fixed random token sequences: the same in every run, so a resumed run sees the same batches."""

    def __init__(self) -> None:
        self.tokens = torch.randint(0, VOCAB, (EXAMPLES, CONTEXT), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the Trainer's FSDP mode needs a GPU; on CPU run examples/hf_accelerate_fsdp1.py")
    if args.impl == "fsdp1":
        fsdp1.use_as_torch_fsdp()
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class LossLog(TrainerCallback):
        def __init__(self) -> None:
            self.losses = {}

        def on_log(self, _args, state, _control, logs=None, **_kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = logs["loss"]

    training = TrainingArguments(
        output_dir=str(args.output), max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_steps=args.save_at, save_strategy="steps", report_to=[], seed=0,
        fsdp="full_shard", fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["GPT2Block"]}, dataloader_drop_last=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=CONTEXT,
                                       bos_token_id=0, eos_token_id=0,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    log = LossLog()
    trainer = Trainer(model=model, args=training, train_dataset=TokenData(), callbacks=[log])
    checkpoint = str(args.output / f"checkpoint-{args.save_at}") if args.resume else None
    trainer.train(resume_from_checkpoint=checkpoint)
    wrapped = trainer.model_wrapped
    from torch.distributed.fsdp import FullyShardedDataParallel

    if type(wrapped) is not FullyShardedDataParallel:
        raise SystemExit(f"the Trainer did not wrap the model in FSDP1 but in {type(wrapped)}")
    trainer.accelerator.print(f"{args.impl}: trained {len(FullyShardedDataParallel.fsdp_modules(wrapped))} units of "
                              f"{type(wrapped).__module__}.{type(wrapped).__name__}; losses {log.losses}")
    losses = {str(step): loss for step, loss in log.losses.items()}
    if args.losses and trainer.is_world_process_zero():
        args.losses.parent.mkdir(parents=True, exist_ok=True)
        args.losses.write_text(json.dumps(losses))
    if args.expect:
        expected = json.loads(args.expect.read_text())
        differing = {step: (loss, expected.get(step)) for step, loss in losses.items() if expected.get(step) != loss}
        if differing or not losses:
            raise SystemExit(f"losses differ from {args.expect} at steps {differing}")
        trainer.accelerator.print(f"the {len(losses)} losses equal {args.expect}'s bit for bit")


if __name__ == "__main__":
    main()
