"""Tests the architecture the folder listing shows: the engine (``fsdp1/_engine``) knows neither API,
the two fronts (``_wrapper``: FullyShardedDataParallel, ``_fully_shard``: ``fully_shard``) never
import each other, the state dicts serve both without reaching either, the public modules at torch's
paths re-export what one package builds, every module has a rule, and no module imports itself back
through a chain, annotations under ``TYPE_CHECKING`` included. Every module may import the one room of
torch's private names (``_torch_internals``), which imports nothing of fsdp1."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp1"

ENGINE, STATE_DICTS, WRAPPER_FRONT, FULLY_SHARD_FRONT = "_engine", "_state_dict", "_wrapper", "_fully_shard"
TORCH_INTERNALS = "_torch_internals"

# What each module may import besides its own package: the four packages, then every public module
# (one at the top of ``fsdp1``). A package may import no public module but the configuration data of
# ``api``, and the FSDP1 front the wrap policies' planner of ``wrap`` and the comm hooks it registers;
# the FSDP1 class's module at torch's path re-exports the front's class, ``FlatParameter`` and ``api``'s
# names; only the package's assembly (``__init__``, the alias of torch's modules) and the launcher see
# more.
ALLOWED = {
    ENGINE: {"api"},
    STATE_DICTS: {ENGINE, "api"},
    WRAPPER_FRONT: {ENGINE, STATE_DICTS, "api", "wrap", "comm_hooks"},
    FULLY_SHARD_FRONT: {ENGINE, STATE_DICTS, "api", "_torch_version"},  # what the running release's fully_shard does
    "_children": set(),  # the launcher's start-up hook for the processes a script starts: imports fsdp1 whole, as a user would
    "api": set(),
    "wrap": set(),
    "_torch_version": set(),
    TORCH_INTERNALS: set(),
    "fully_sharded_data_parallel": {WRAPPER_FRONT, ENGINE, "api"},
    "comm_hooks": {ENGINE},
    "sharded_grad_scaler": {ENGINE},
    "checkpoint": {ENGINE},
    "run": {"_children", "_torch_alias"},
    "_planner": {ENGINE, WRAPPER_FRONT, FULLY_SHARD_FRONT, "api", "wrap"},  # applies what it plans, with either front; its probe times the engine's codec
    "plan": {"_planner"},
    "_torch_alias": {FULLY_SHARD_FRONT, "api", "fully_sharded_data_parallel", "sharded_grad_scaler"},
    "_torch_recognition": {ENGINE, FULLY_SHARD_FRONT, "_torch_alias", "fully_sharded_data_parallel"},
    "__init__": {ENGINE, FULLY_SHARD_FRONT, "_torch_alias", "_torch_recognition", "_torch_version", "api", "comm_hooks",
                 "fully_sharded_data_parallel", "plan", "sharded_grad_scaler", "wrap"},
}


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


def test_every_module_has_a_rule():
    assert sorted(name for name in _graph() if _area(name) not in ALLOWED) == []


def test_packages_import_only_what_their_rule_allows():
    broken = []
    for module, imported in _graph().items():
        area = _area(module)
        allowed = ALLOWED[area] | {area, TORCH_INTERNALS}
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
