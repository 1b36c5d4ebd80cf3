"""a4ray's own import graph, read with `ast` (nothing is imported): imports point down the layers.

- no import cycle among a4ray modules (module-level imports, `if TYPE_CHECKING:` ones included);
- no import of an a4ray module inside a function, except the few on DEFERRED, each with its reason;
- no two modules share a name (a reader never wonders which `stage.py` is meant);
- the top level holds only the public surface: the API, the CLI and the `python -m a4ray.<job>` modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "a4ray"

# module that imports inside a function -> {a4ray module it imports there: why it may not be at the top}
DEFERRED = {
    "a4ray.runtime.reaper": {
        "a4ray.runtime.process": "a reaper waits a whole launch long on a pipe; it imports psutil only to kill",
    },
    "a4ray.commands.kube": {
        "a4ray.k8s.client": "the kubernetes client takes ~1 s to import; `a4ray render` never needs it",
    },
    "a4ray.staging.standins": {
        "a4ray.staging.tiny": "transformers takes seconds to import; only making the stand-ins needs it",
    },
    "a4ray.hf2mcore.converter": {
        "a4ray.hf2mcore.native": "it and torch take 1.8 s of CPU; planning a conversion (a dry run) needs neither",
        "a4ray.hf2mcore.verify": "it imports torch's checkpoint stack; only a conversion's check needs it",
    },
    "a4ray.staging.sources": {
        "a4ray.staging.sources.hub": "huggingface_hub is imported only for hf:// sources",
        "a4ray.staging.sources.git": "one module per scheme, imported for the schemes a spec names",
        "a4ray.staging.sources.http": "one module per scheme, imported for the schemes a spec names",
        "a4ray.staging.sources.fs": "one module per scheme, imported for the schemes a spec names",
    },
}
# The top level: what users import or run by name (`a4ray.<kind>` modules are named in rendered RayJobs).
PUBLIC = {"__init__", "api", "cli", "convert", "ddp_test", "nccl_test", "deepep_test", "qwen3", "qwen3_next",
          "swift_dpo", "stage"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _target(name: str) -> str | None:
    """The a4ray module an import of `name` loads (a name inside a module counts as its module)."""
    while name.startswith("a4ray"):
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, tree: ast.AST) -> list[tuple[str, bool, int]]:
    """(imported a4ray module, inside a function?, line) for every import statement of `module`."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                names = [f"{base}.{alias.name}" for alias in child.names]
            else:
                visit(child, inner)
                continue
            for name in names:
                target = _target(name)
                if target and target != module:
                    found.append((target, in_function, child.lineno))

    visit(tree, False)
    return found


GRAPH: dict[str, set[str]] = {}
FUNCTION_LEVEL: list[tuple[str, str, int]] = []
for _name, _path in MODULES.items():
    GRAPH[_name] = set()
    for _target_name, _inside, _line in _imports(_name, ast.parse(_path.read_text())):
        if _inside:
            FUNCTION_LEVEL.append((_name, _target_name, _line))
        else:
            GRAPH[_name].add(_target_name)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a cycle or several."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_graph_is_read():
    assert len(MODULES) > 80 and "a4ray.runtime.gang" in GRAPH["a4ray.workloads.workload"]


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_no_function_level_imports_of_a4ray_modules_but_the_deferred_ones():
    unexplained = [f"{MODULES[m].relative_to(REPO)}:{line} imports {t}" for m, t, line in FUNCTION_LEVEL
                   if t not in DEFERRED.get(m, {})]
    assert unexplained == []


def test_every_deferred_import_still_exists():
    seen = {(m, t) for m, t, _ in FUNCTION_LEVEL}
    assert [(m, t) for m, targets in DEFERRED.items() for t in targets if (m, t) not in seen] == []


def test_no_two_modules_share_a_name():
    by_name: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        if path.name == "__main__.py":
            continue
        # a package's name counts too: `convert.py` beside a `convert/` package is a clash
        by_name.setdefault(name.rpartition(".")[2], []).append(name)
    assert {stem: names for stem, names in by_name.items() if len(names) > 1} == {}


def test_the_top_level_is_the_public_surface():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == PUBLIC
