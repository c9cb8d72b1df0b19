"""torch's private names reach fsdp1 through one module, ``fsdp1/_torch_internals.py``: no other
module imports a private torch module or name, or reads a private attribute of torch's objects; and
every private path that module lists resolves on the torch release the suite runs under, so that a
new release that renames one fails here, by name, before any behaviour test."""

import ast
import importlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp1 import _torch_internals

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp1"
INTERNALS = PACKAGE / "_torch_internals.py"

# The private attributes of torch's classes that fsdp1 handles: a read of one of these on anything
# but ``self`` is torch's, even where fsdp1 has a field of the same name on an object of its own.
TORCH_CLASSES = (nn.Module, torch.Tensor, nn.Parameter, DTensor, DeviceMesh, dist.ProcessGroup, torch.UntypedStorage,
                 torch.optim.Optimizer, torch.amp.GradScaler)

# Private by their spelling but not torch's: Python's own (a named tuple's fields, the caller's frame),
# and the per-module overrides torch FSDP1's ``wrap`` reads, which fsdp1's ``wrap`` reads alike (part of
# the API fsdp1 re-implements, set by the scripts and clients written for it).
NOT_TORCHS = {"_fields", "_getframe", "_wrap_overrides"}


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def _torch_private_import(node):
    """The private torch import ``node`` makes, if it makes one."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names if alias.name.split(".")[0] == "torch"]
        return next((name for name in names if any(_is_private(part) for part in name.split("."))), None)
    if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
        module = node.module or ""
        if any(_is_private(part) for part in module.split(".")):
            return module
        return next((f"{module}.{alias.name}" for alias in node.names if _is_private(alias.name)), None)
    return None


def _attribute_reads(tree):
    """``(receiver, name, line, enclosing function)`` for every attribute of a private name that
    ``tree`` reads or writes, the constant names given to ``getattr``/``hasattr``/``setattr`` included."""
    found = []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            found.append((node.value, node.attr, node.lineno, function))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and _is_private(node.args[1].value)):
            found.append((node.args[0], node.args[1].value, node.lineno, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return found


def _own_names(trees):
    """The private names fsdp1 gives things of its own: functions, classes, class-level fields, and
    attributes it sets on ``self`` or ``cls`` (its mirror of torch FSDP1's protocol among them, such
    as ``_run_policy`` and ``_fsdp_wrapped_module``)."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
                    own.update(target.id for target in targets if isinstance(target, ast.Name))
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls")):
                own.add(node.attr)
    return own


def _is_super_call_of(receiver, name, function):
    """``super().name`` inside a method ``name``: an override calling torch's own."""
    return (function == name and isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super")


def test_no_module_but_the_internals_one_reaches_torch_privately():
    paths = sorted(path for path in PACKAGE.rglob("*.py") if path != INTERNALS)
    trees = {path: ast.parse(path.read_text()) for path in paths}
    own = _own_names(trees.values())
    torch_private = {name for cls in TORCH_CLASSES for name in dir(cls) if _is_private(name)}
    exempt = set(_torch_internals.MODULE_REGISTRIES) | NOT_TORCHS
    reached = []
    for path, tree in trees.items():
        where = path.relative_to(PACKAGE.parent)
        reached += [f"{where}:{node.lineno}: imports {name}" for node in ast.walk(tree)
                    if (name := _torch_private_import(node)) is not None]
        for receiver, name, line, function in _attribute_reads(tree):
            if name in exempt or _is_super_call_of(receiver, name, function):
                continue
            on_self = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
            if name not in own or (name in torch_private and not on_self):
                reached.append(f"{where}:{line}: reads {name}")
    assert not reached, "\n".join(reached)


def test_the_scan_finds_each_kind_of_private_reach(tmp_path):
    """The scan above, on code that reaches torch in each way it looks for."""
    tree = ast.parse(
        "import torch._dynamo\n"
        "from torch.utils._pytree import tree_map\n"
        "from torch.distributed.tensor.placement_types import _StridedShard\n"
        "def f(d, m):\n"
        "    return d._local_tensor, getattr(m, '_non_persistent_buffers_set'), m._parameters\n")
    imports = [name for node in ast.walk(tree) if (name := _torch_private_import(node)) is not None]
    assert imports == ["torch._dynamo", "torch.utils._pytree", "torch.distributed.tensor.placement_types._StridedShard"]
    assert [name for _, name, _, _ in _attribute_reads(tree)] == ["_local_tensor", "_non_persistent_buffers_set", "_parameters"]


def _resolve(path):
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(path)


@pytest.mark.parametrize("path", _torch_internals.PATHS)
def test_every_private_path_resolves_on_this_torch(path):
    assert _resolve(path) is not None, f"torch {torch.__version__} has no {path}: fsdp1/_torch_internals.py says what it is for"
