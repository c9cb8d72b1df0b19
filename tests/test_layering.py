"""Tests the architecture the folder listing shows: the engine (``fsdp1/_engine``) knows neither API,
the two fronts (``_wrapper``: FullyShardedDataParallel, ``_fully_shard``: ``fully_shard``) never
import each other, the state dicts serve both without reaching either, and no module imports
itself back through a chain, annotations under ``TYPE_CHECKING`` included."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp1"

ENGINE, STATE_DICTS, WRAPPER_FRONT, FULLY_SHARD_FRONT = "_engine", "_state_dict", "_wrapper", "_fully_shard"

# The modules at the top: those at torch's paths, the launcher and the two that serve ``__init__``;
# each may import any package.
PUBLIC = {"__init__", "api", "wrap", "fully_sharded_data_parallel", "checkpoint", "comm_hooks", "sharded_grad_scaler",
          "run", "_torch_alias", "_torch_version"}

# What each package may import besides itself: a package is never allowed a public module but the
# configuration data of ``api`` and the wrap policies' planner of ``wrap``.
ALLOWED = {
    ENGINE: {"api"},
    STATE_DICTS: {ENGINE, "api"},
    WRAPPER_FRONT: {ENGINE, STATE_DICTS, "api", "wrap"},
    FULLY_SHARD_FRONT: {ENGINE, STATE_DICTS, "api"},
    "_children": set(),  # the launcher's start-up hook for the processes a script starts: imports fsdp1 whole, as a user would
}
# The public modules that are pure data or planning, below every package.
BASE = {"api": set(), "wrap": set()}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _resolve(own: str, level: int, target: str) -> str:
    """The dotted name under fsdp1 that a relative import of ``level`` dots from module ``own`` names."""
    parts = own.split(".")  # a package's ``__init__`` counts as a part, so one dot names the package
    base = parts[: len(parts) - level]
    return ".".join(p for p in [*base, target] if p)


def _imports(path: Path, modules):
    """Every fsdp1 module imported by ``path`` (relative imports; a ``from pkg import mod`` names
    the module, one of ``modules``), annotations under ``TYPE_CHECKING`` included."""
    own = _module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            package = _resolve(own, node.level, node.module or "")
            for alias in node.names:
                candidate = f"{package}.{alias.name}" if package else alias.name
                found.add(candidate if candidate in modules else package)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp1"):
            found.add(node.module.removeprefix("fsdp1").lstrip("."))
    found.discard("")
    return {name.removesuffix(".__init__") for name in found}


def _all_modules():
    names = set()
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        names.add(name.removesuffix(".__init__"))
    return names


def _graph():
    modules = _all_modules()
    return {_module_name(path).removesuffix(".__init__"): _imports(path, modules) for path in PACKAGE.rglob("*.py")}


def _area(module: str) -> str:
    """The package a module belongs to, or the public module's own name."""
    return module.split(".")[0]


def test_every_module_is_public_or_in_a_package():
    loose = sorted(name for name in _graph() if "." not in name and name not in PUBLIC and name not in ALLOWED)
    assert loose == []


def test_packages_import_only_what_their_rule_allows():
    broken = []
    for module, imported in _graph().items():
        area = _area(module)
        if area not in ALLOWED and area not in BASE:
            continue
        allowed = ALLOWED.get(area, BASE.get(area, set())) | {area}
        broken.extend(f"{module} imports {name}" for name in sorted(imported) if _area(name) not in allowed)
    assert broken == []


def test_no_import_cycle():
    graph = _graph()
    cycles = []
    visiting, done = [], set()

    def visit(module):
        if module in done:
            return
        if module in visiting:
            cycles.append(" -> ".join(visiting[visiting.index(module):] + [module]))
            return
        visiting.append(module)
        for name in sorted(graph.get(module, ())):
            if name in graph:
                visit(name)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert cycles == []
