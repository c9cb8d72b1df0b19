"""torch as it will be once it drops FSDP1, for ``make test-without-torch-fsdp1``: imported at start-up
by pytest and by every Python process the tests start (this folder is first on their PYTHONPATH).

FSDP1's modules (``torch.distributed.fsdp.fully_sharded_data_parallel``, ``wrap``, ``_flat_param``,
``_runtime_utils`` and the rest of its files) and FSDP1's names in the ``torch.distributed.fsdp``
package are refused to everyone but the parts of torch that stay, FSDP2 (``torch.distributed.fsdp``'s
``_fully_shard``, which imports FSDP1's ``_common_utils`` today) and DCP (``torch.distributed.checkpoint``,
whose ``optimizer`` and ``state_dict`` modules import FSDP1 today): they load as they do now, as torch
would keep what they need. A refusal is one of two errors:

* ``TorchFSDP1Removed``: a test, or a client it runs, wanted torch's FSDP1 (an oracle); the suite's
  ``conftest`` reports the test as skipped, saying so;
* ``FSDP1ReachedTorchFSDP1``: fsdp1 itself wanted it, directly or through another module of torch's
  (torch's ``apply_activation_checkpointing`` imports FSDP1's ``wrap``): a failure, unless fsdp1
  handles the missing module as it would handle a release without it.
"""

import importlib.abc
import importlib.util
import os
import sys
import sysconfig
from types import ModuleType
from typing import Any, Optional, Sequence

PACKAGE = "torch.distributed.fsdp"
FSDP1_FILES = ("fully_sharded_data_parallel", "wrap", "api", "sharded_grad_scaler", "_flat_param", "_runtime_utils",
               "_common_utils", "_debug_utils", "_dynamo_utils", "_exec_order_utils", "_fsdp_extensions", "_init_utils",
               "_limiter_utils", "_optim_utils", "_shard_utils", "_state_dict_utils", "_trace_utils", "_traversal_utils",
               "_unshard_param_utils", "_wrap_utils")
FSDP1_MODULES = {f"{PACKAGE}.{name}" for name in FSDP1_FILES} | {"torch.distributed.tensor.parallel.fsdp"}  # TP's FSDP1 extension
KEEPERS = (PACKAGE, "torch.distributed.checkpoint")
REMOVED = "torch's FSDP1 removed (make test-without-torch-fsdp1)"
FSDP1_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fsdp1")
LIBRARY_ROOTS = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})


class TorchFSDP1Removed(ModuleNotFoundError):
    pass


class FSDP1ReachedTorchFSDP1(ModuleNotFoundError):
    """Also a ``ModuleNotFoundError``, as the import would be on such a release: fsdp1's code that looks
    for a module torch may not have goes on without it."""


def _importer(depth: int) -> Any:
    """The first frame above ``depth`` that is not the import machinery's."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
        frame = frame.f_back
    return frame


def _refuse(what: str, frame: Any) -> BaseException:
    """The error for ``what`` wanted from ``frame``: fsdp1's fault where fsdp1's code is met, going out
    from the importer, before any code of the user's (the tests, a script); else the user's."""
    importer = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(FSDP1_ROOT + os.sep):
            return FSDP1ReachedTorchFSDP1(f"fsdp1 reached torch's FSDP1 ({what}) through {importer}: {REMOVED}")
        if not path.startswith(LIBRARY_ROOTS) and not path.startswith("<"):
            break
        frame = frame.f_back
    return TorchFSDP1Removed(f"{what}, imported by {importer}: {REMOVED}")


def _kept(frame: Any) -> bool:
    """Whether the importer is torch's FSDP2 or DCP, or one of FSDP1's modules loading for them."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.startswith(KEEPERS) or name in FSDP1_MODULES


class _FSDP1Module(ModuleType):
    """An FSDP1 module (or the package, for FSDP1's names) whose attributes only keepers read."""

    _fsdp1_names: frozenset = frozenset()

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") or name == "_fsdp1_names":
            return super().__getattribute__(name)
        value = super().__getattribute__(name)
        own = super().__getattribute__("__name__")
        is_torchs = (getattr(value, "__name__", "") if isinstance(value, ModuleType)
                     else getattr(value, "__module__", None) or own).startswith("torch.")  # not one fsdp1's alias put there
        if (own in FSDP1_MODULES or name in super().__getattribute__("_fsdp1_names")) and is_torchs \
                and not _kept(_importer(1)):
            raise _refuse(f"{own}.{name}", _importer(1))
        return value


class _RefuseFSDP1(importlib.abc.MetaPathFinder):
    """Refuses FSDP1's modules to non-keepers, and marks every module of the package on load."""

    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None) -> Any:
        if name in FSDP1_MODULES and not _kept(_importer(1)):
            raise _refuse(name, _importer(1))
        if name != PACKAGE and name not in FSDP1_MODULES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            if name == PACKAGE:
                kept = set(sys.modules[f"{PACKAGE}._fully_shard"].__all__)
                module._fsdp1_names = frozenset(set(module.__all__) - kept | {"FlatParameter", *FSDP1_FILES})
            module.__class__ = _FSDP1Module

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("FSDP1_WITHOUT_TORCH_FSDP1") == "1":
    sys.meta_path.insert(0, _RefuseFSDP1())
