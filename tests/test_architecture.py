"""The package's shape: imports go down the data path, never up it, and never in a circle.

Every import counts: module level, inside functions (a lazy import dodges a circle at import
time but keeps the circle in the design) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "otel_rollouts"
EXPORTERS = ROOT / "exporters"

# Rank of each part: a module may import modules of its own rank or of a lower one. The data
# path reads record -> sampling -> delivery -> exporters; decode feeds recording; correlate sits
# beside recording; ``_rollouts`` assembles everything and the root exposes it. The adapters are
# clients of the public API, as a user's training loop is (they close steps with otr.end_step).
RANKS: dict[str, int] = {
    "conventions": 0,
    "_core": 1,
    "exporters": 2,
    "delivery": 3,
    "sampling": 4,
    "record": 5,
    "correlate": 6,
    "decode": 7,
    "_rollouts": 8,
    "__init__": 9,  # the public root: only its clients stand above it
    "adapters": 10,
    "_demo": 11,
    "cli": 12,
}


def _module_name(path: pathlib.Path) -> str:
    if path.is_relative_to(EXPORTERS):
        parts = ["otel_rollouts", "exporters", *path.relative_to(EXPORTERS).with_suffix("").parts]
    else:
        parts = ["otel_rollouts", *path.relative_to(PACKAGE).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    paths = [*PACKAGE.rglob("*.py"), *EXPORTERS.glob("*.py")]
    return {_module_name(p): p for p in paths}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every module of the package that ``module`` imports, at any depth of its code."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            # `from package import module` imports the module; `from module import name`, the module
            names = [f"{origin}.{alias.name}" for alias in node.names]
            names = [n if n in known else origin for n in names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("otel_rollouts") and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items()}


def test_every_part_of_the_package_has_a_rank() -> None:
    assert {_part(m) for m in _modules()} <= set(RANKS), (
        "a new folder or root module needs its place on the data path in RANKS"
    )


def test_no_import_reaches_back_up_the_data_path() -> None:
    upward = []
    for module, imports in _graph().items():
        for target in imports:
            if RANKS[_part(target)] > RANKS[_part(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports up the data path:\n" + "\n".join(sorted(upward))


def test_the_import_graph_has_no_circle() -> None:
    graph = _graph()
    # a package imports its own submodules through __init__ only by choice: count it as an edge
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                circles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize("module", ["otel_rollouts._core", "otel_rollouts.exporters"])
def test_the_base_imports_nothing_of_the_stages_above_it(module: str) -> None:
    graph = _graph()
    mine = [m for m in graph if m == module or m.startswith(module + ".")]
    above = {
        f"{m} -> {t}" for m in mine for t in graph[m]
        if RANKS[_part(t)] > RANKS[_part(module + ".x")]
    }
    assert not above



def test_adapters_import_the_library_only_through_the_public_kit() -> None:
    """The built-in adapters are written with the public adapter kit (``adapters.kit``) and the
    public root, as an adapter outside this repository would be: only the kit reaches into
    ``_core``. Any import counts (module level, lazy, under ``TYPE_CHECKING``)."""
    graph = _graph()
    kit = "otel_rollouts.adapters.kit"
    adapters = [m for m in graph if _part(m) == "adapters"]
    assert kit in adapters
    private = {
        f"{m} -> {t}" for m in adapters if m != kit for t in graph[m] if _part(t) == "_core"
    }
    assert not private, "adapters importing _core instead of the kit:\n" + "\n".join(sorted(private))

# Module state that is allowed: the one process slot (the installed instance and the exit hooks
# that must be process-wide), and caches documented as such. Anything else is a bug: state lives
# in the installed ``Rollouts`` instance.
ALLOWED_MODULE_STATE: dict[str, set[str]] = {
    "otel_rollouts._core.runtime": {"_slot", "_DISABLED"},  # the process slot; the no-op instance
    "otel_rollouts._core.exit": {"_hooks"},  # signal dispositions are per process
    "otel_rollouts.decode.batch": {"TOKENIZERS"},  # what was learned of each tokenizer (a cache)
    "otel_rollouts.adapters._tinker_groups": {"_LAYOUTS"},  # each tokenizer's message layout (a weak cache)
    # context variables (a value per thread / task, as OpenTelemetry's own context): the worker
    # task whose log records travel back with its result; the handler's re-entry guard
    "otel_rollouts.correlate.logs": {"TASK_LOGS", "_EMITTING"},
}

_MUTABLE_CALLS = {
    "dict", "list", "set", "OrderedDict", "Counter", "defaultdict", "deque", "WeakKeyDictionary",
    "WeakValueDictionary", "WeakSet", "Lock", "RLock", "Event", "Condition", "local",
}


# classes whose instances hold no state (values, stateless strategies, precompiled formats)
_VALUE_TYPES = {"TypeVar", "ParamSpec", "TraceFlags", "Decimal", "Path", "Status", "Resource",
                "CompositePropagator", "_Sink", "Struct"}


def _module_state(path: pathlib.Path) -> set[str]:
    """Names a module rebinds with ``global`` or binds at top level to a mutable container or lock
    (constants in CAPITALS are read-only by convention and not counted)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            names.update(node.names)
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                                         ast.SetComp))
            instance = False
            if isinstance(value, ast.Call):
                func = value.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                mutable = called in _MUTABLE_CALLS
                # an instance of a class (CamelCase): state unless the class is a value type
                instance = called.lstrip("_")[:1].isupper() and called not in _VALUE_TYPES
            for target in targets:
                if not isinstance(target, ast.Name) or target.id.startswith("__"):
                    continue
                if instance or (mutable and not target.id.isupper()):
                    names.add(target.id)
    return names


def test_no_module_level_mutable_state_outside_the_slot_and_documented_caches() -> None:
    found = {}
    for module, path in _modules().items():
        state = _module_state(path) - ALLOWED_MODULE_STATE.get(module, set())
        if state:
            found[module] = sorted(state)
    assert not found, f"module-level mutable state: {found}"
