"""A Lightning Trainer script that trains with each strategy named on its command line in turn, each set
up as Lightning's docs set it up: `fsdp` (FSDPStrategy, torch's FSDP1 wrapping each block),
`model_parallel` (ModelParallelStrategy: the module shards itself with torch's fully_shard in
configure_model) or `ddp`."""

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


STRATEGIES = {"fsdp": lambda: FSDPStrategy(auto_wrap_policy={Block}),
              "model_parallel": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
              "ddp": lambda: "ddp"}

runs = {}
for name in sys.argv[1:]:
    model = Sharded() if name == "model_parallel" else Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=STRATEGIES[name](), max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    runs[name] = (model.losses, trainer.strategy.model)
record({name: losses for name, (losses, _) in runs.items()}, *(model for _, model in runs.values()))
