"""Imported at start-up by every Python process that a script run under ``python -m fsdp1.run`` starts
(``torch.multiprocessing.spawn``'s ranks, a Lightning ``Trainer`` starting its own, any launcher the
script calls): the launcher names this folder first on their PYTHONPATH. fsdp1 takes torch's place
in them too, as in the script's own process, once something imports ``torch.distributed.fsdp``
(processes that never do pay nothing); then the ``sitecustomize`` this one stands in front of, if
there is one, runs as it would have.
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

TRIGGER = "torch.distributed.fsdp"


def _initializing(module: Optional[ModuleType]) -> bool:
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _TakeTorchsPlace(importlib.abc.MetaPathFinder):
    """Puts fsdp1's names in torch's place as soon as ``torch.distributed.fsdp`` has loaded and no
    torch module is half-imported (torch's dynamo imports it mid-way through its own import, and
    fsdp1's names reach modules that import dynamo): at the end of that import, else at the next
    import after it. It answers no import itself."""

    def __init__(self) -> None:
        self._busy = False

    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None) -> Any:
        if not self._busy and sys.modules.get(TRIGGER) is not None:
            self.take_place_if_whole()
        if name != TRIGGER or self._busy:
            return None
        self._busy = True  # find the spec as the others would
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            sys.modules[name] = module
            self.take_place_if_whole(loaded=module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def take_place_if_whole(self, loaded: Optional[ModuleType] = None) -> None:
        if any(_initializing(module) for key, module in list(sys.modules.items())
               if key.startswith("torch") and module is not loaded):
            return
        self._busy = True
        try:
            import fsdp1

            fsdp1.use_as_torch_fsdp()
            sys.meta_path.remove(self)
        finally:
            self._busy = False


def _run_the_one_behind() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    shadowed = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    try:
        if importlib.util.find_spec("sitecustomize") is not None:
            importlib.import_module("sitecustomize")
        elif shadowed is not None:
            sys.modules["sitecustomize"] = shadowed
    finally:
        sys.path[:] = saved


if TRIGGER not in sys.modules:
    sys.meta_path.insert(0, _TakeTorchsPlace())
_run_the_one_behind()
