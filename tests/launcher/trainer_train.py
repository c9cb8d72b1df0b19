"""A Transformers Trainer script as its examples write one: every setting, FSDP's included, from the
command line (`--fsdp "full_shard auto_wrap" --fsdp_config ...`)."""

from _gpt2 import tiny_gpt2, token_batches
from _record import record
from transformers import HfArgumentParser, Trainer, TrainingArguments

(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
data = [{"input_ids": ids, "labels": ids} for batch in token_batches(6, 0) for ids in batch]
trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=data)
trainer.train()
record([log["loss"] for log in trainer.state.log_history if "loss" in log], trainer.model_wrapped)
