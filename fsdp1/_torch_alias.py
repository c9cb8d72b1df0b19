"""``use_as_torch_fsdp``: fsdp1's class under torch's names, for clients that construct and recognise
FSDP units by torch's class (HF Accelerate, the Transformers Trainer, Lightning).

Those clients import ``FullyShardedDataParallel`` from ``torch.distributed.fsdp`` or from
``torch.distributed.fsdp.fully_sharded_data_parallel`` when they need it, and test
``isinstance(model, FSDP)`` or even ``type(model) is FSDP``; a subclass of torch's class would fail
the latter. So both module attributes are pointed at fsdp1's class, and put back on undo. This is
the one place the library touches ``torch.distributed.fsdp``, and only when asked: importing fsdp1
does not import it.
"""

import importlib
from types import ModuleType
from typing import Any, List, Tuple

from .fully_sharded_data_parallel import FullyShardedDataParallel

TORCH_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed.fsdp.fully_sharded_data_parallel")
"""Where clients import torch's FSDP1 class from."""


class use_as_torch_fsdp:  # noqa: N801 - used as a function, as torch's own context-manager functions are
    """Make ``torch.distributed.fsdp.FullyShardedDataParallel`` (at both of its import paths) be
    fsdp1's class, so that a client that builds and recognises FSDP units by torch's name uses fsdp1.

    Call it once before the client builds its model (``fsdp1.use_as_torch_fsdp()``), or use it as a
    context manager, which puts torch's class back on exit. A client module that bound torch's class
    to a name of its own when it was imported keeps that binding: call this before importing it.
    """

    def __init__(self) -> None:
        self._replaced: List[Tuple[ModuleType, Any]] = []
        for name in TORCH_FSDP_MODULES:
            module = importlib.import_module(name)
            self._replaced.append((module, module.FullyShardedDataParallel))
            module.FullyShardedDataParallel = FullyShardedDataParallel

    def __enter__(self) -> "use_as_torch_fsdp":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def undo(self) -> None:
        """Put torch's class back where it was replaced."""
        while self._replaced:
            module, original = self._replaced.pop()
            module.FullyShardedDataParallel = original
