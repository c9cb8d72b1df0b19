"""Tests that fsdp1's modules import one way: each only from modules below it in ``LAYERS`` (the
order DESIGN.md gives), so that no lower layer reaches up for a name and no cycle hides anywhere.
Imports under ``TYPE_CHECKING`` are annotations only; the few that point upwards are listed here,
each with what it annotates, so that a new one fails."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp1"

# Lowest first; a module may import any module of an earlier layer.
LAYERS = [
    ["api"],
    ["_common", "_shard_math", "_traversal", "_device", "_collectives", "_placeholder", "wrap"],
    ["_redistribute", "comm_hooks", "sharded_grad_scaler", "checkpoint", "_mixed_precision"],
    ["_layout"],
    ["_shard_conversions", "_views"],
    ["_dtensor_views"],
    ["_flat_grad"],
    ["_flat_param"],
    ["_process_groups", "_unit_plan"],
    ["_initial_values"],
    ["_runtime", "_clip_grad"],
    ["_unit_state"],
    ["_unshard"],
    ["_state_dict", "_optim_params"],
    ["_optim_state_dict"],
    ["_optim_state_dict_api"],
    ["fully_sharded_data_parallel", "_fully_shard"],
    ["_torch_alias"],
    ["__init__"],
]

# (module, imported): annotations of a class defined above the module that uses it.
UPWARD_ANNOTATIONS = {
    ("_clip_grad", "fully_sharded_data_parallel"): "the unit class",
    ("_runtime", "_unit_state"): "the units' state, which the root's shared state lists",
    ("_state_dict", "fully_sharded_data_parallel"): "the unit class",
    ("_optim_state_dict", "fully_sharded_data_parallel"): "the unit class",
    ("_optim_params", "fully_sharded_data_parallel"): "the unit class, whose parameters the optimizer holds",
}


def _imports(path: Path):
    """(imported fsdp1 module, under TYPE_CHECKING) for every relative import in ``path``."""
    found = []

    def visit(node, annotation_only):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, True)
                continue
            if isinstance(child, ast.ImportFrom) and child.level == 1:
                names = [child.module.split(".")[0]] if child.module else [alias.name for alias in child.names]
                found.extend((name, annotation_only) for name in names)
            visit(child, annotation_only)

    visit(ast.parse(path.read_text()), False)
    return found


def test_every_module_is_in_a_layer():
    placed = [name for layer in LAYERS for name in layer]
    assert sorted(placed) == sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(placed) == len(set(placed))


def test_modules_import_only_from_lower_layers():
    rank = {name: index for index, layer in enumerate(LAYERS) for name in layer}
    upward = []
    for path in PACKAGE.glob("*.py"):
        for imported, annotation_only in _imports(path):
            if rank[imported] < rank[path.stem]:
                continue
            if annotation_only and (path.stem, imported) in UPWARD_ANNOTATIONS:
                continue
            upward.append(f"{path.stem} imports {imported}" + (" (under TYPE_CHECKING)" if annotation_only else ""))
    assert upward == []
