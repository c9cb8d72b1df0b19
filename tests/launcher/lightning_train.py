"""A Lightning Trainer script with its strategy named on the command line, as Lightning's docs set each
up: `fsdp` (FSDPStrategy, torch's FSDP1 wrapping each block), `model_parallel` (ModelParallelStrategy:
the module shards itself with torch's fully_shard in configure_model) or `ddp`."""

import sys

import lightning as L
from _lightning_model import Block, Regression
from _record import record
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard


class Sharded(Regression):
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


name = sys.argv[1]
strategy = {"fsdp": lambda: FSDPStrategy(auto_wrap_policy={Block}),
            "model_parallel": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            "ddp": lambda: "ddp"}[name]()
model = Sharded() if name == "model_parallel" else Regression()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model)
record(model.losses, trainer.strategy.model)
