"""HF Accelerate's FSDP checkpoint functions called as its ``Accelerator.save_state`` /
``load_state`` call them, for tests on CPU: Accelerate only enters its FSDP mode on accelerators, so
a stand-in carries the attributes those functions read."""

import types

import torch.distributed as dist


def accelerator_stand_in() -> types.SimpleNamespace:
    from accelerate import PartialState

    PartialState(cpu=True)  # Accelerate's logging needs its state
    rank = dist.get_rank()
    return types.SimpleNamespace(process_index=rank, num_processes=dist.get_world_size(), is_fsdp2=False,
                                 is_main_process=rank == 0, wait_for_everyone=dist.barrier)


def save_with_accelerate(plugin, accelerator, model, optim, directory: str) -> None:
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    save_fsdp_model(plugin, accelerator, model, directory)
    save_fsdp_optimizer(plugin, accelerator, optim, model, directory)


def load_with_accelerate(plugin, accelerator, model, optim, directory: str) -> None:
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer

    load_fsdp_model(plugin, accelerator, model, directory)
    load_fsdp_optimizer(plugin, accelerator, optim, model, directory)
