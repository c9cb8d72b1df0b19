"""Test scaffolding, on this CPU machine only: Accelerate and Lightning's Trainer run FSDP only on
accelerators. On the CPU, `accelerate launch` with an FSDP config starts processes that each train
alone, and a CPU run it sees as distributed drops the FSDP plugin and trains with DDP, without a word
either way; Lightning's Trainer refuses `FSDPStrategy` with `accelerator="cpu"`. This lifts those
gates (the processes run as Accelerate's multi-CPU launch runs them and its state becomes FSDP with
the plugin it was given; Lightning takes the strategy), so that the launcher's tests run the clients'
FSDP code unedited. The tests put it on PYTHONPATH for the torch and the fsdp1 runs alike."""

import importlib.abc
import importlib.util
import os
import sys

os.environ.setdefault("ACCELERATE_USE_CPU", "true")


def _accelerate_fsdp_on_cpu(state):
    original = state.AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == state.DistributedType.MULTI_CPU:
            self.distributed_type = state.DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    state.AcceleratorState.__init__ = __init__


def _lightning_fsdp_on_cpu(connector):
    original = connector._AcceleratorConnector._check_strategy_and_fallback

    def check(self):
        flag = self._accelerator_flag
        self._accelerator_flag = "gpu" if flag == "cpu" else flag  # what its FSDP check asks for
        try:
            original(self)
        finally:
            self._accelerator_flag = flag

    connector._AcceleratorConnector._check_strategy_and_fallback = check


PATCHES = {"accelerate.state": _accelerate_fsdp_on_cpu,
           "lightning.pytorch.trainer.connectors.accelerator_connector": _lightning_fsdp_on_cpu}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches each of those modules when something imports it (importing them here would slow every
    interpreter the launchers start)."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
