"""torch's FSDP tutorial pattern: the script starts its own ranks with `torch.multiprocessing.spawn`
(run with plain `python`, no launcher of ranks)."""

import functools
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _record import record
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy


def fsdp_main(rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    model = FSDP(model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=500),
                 device_id=torch.device("cpu"))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step + rank))).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    record(losses, model)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(fsdp_main, args=(2,), nprocs=2, join=True)
