"""The package's layout holds: imports flow one way (entry points -> integrations -> core), with no
cycle, and the core imports no integration.

Read from the source with ``ast`` (every import statement, those inside functions too), so an
import that only runs on some path counts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attnguard"

# Outside the core: the start-up side, the entry points, the runtime that walks the integrations'
# registry, and the table of what is supported (it reads the integrations' version windows).
NOT_CORE = {
    "attnguard",
    "attnguard.__main__",
    "attnguard._bootstrap",
    "attnguard.importhooks",
    "attnguard.runtime",
    "attnguard.cli",
    "attnguard.doctor",
    "attnguard.support",
}
INTEGRATIONS = "attnguard.integrations"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(module: str, target: str) -> str:
    """The module ``target`` names (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def _imports(module: str, *, module_level_only: bool) -> set[str]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    if module_level_only:  # module level includes ``if``/``try`` blocks, not function bodies
        nodes = [n for top in tree.body for n in _outside_functions(top)]
    else:
        nodes = list(ast.walk(tree))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "attnguard":
                continue
            target = _resolve(module, name)
            if target and target not in (module, "attnguard"):
                found.add(target)
    return found


def _outside_functions(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return []
    out = [node]
    for child in ast.iter_child_nodes(node):
        out += _outside_functions(child)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return groups


def _is_integration(module: str) -> bool:
    return module == INTEGRATIONS or module.startswith(INTEGRATIONS + ".")


def test_the_walk_sees_the_package() -> None:
    assert {"attnguard.callguard", "attnguard.integrations.transformers.attention"} <= set(MODULES)
    # a function-level import is seen (the guard imports the selection lazily)
    assert "attnguard.selection.decisions" in _imports(
        "attnguard.callguard", module_level_only=False
    )
    assert "attnguard.selection.decisions" not in _imports(
        "attnguard.callguard", module_level_only=True
    )


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module-level", "all"])
def test_no_import_cycle(module_level_only: bool) -> None:
    graph = {m: _imports(m, module_level_only=module_level_only) for m in MODULES}
    assert _cycles(graph) == []


def test_the_core_imports_no_integration() -> None:
    core = [m for m in MODULES if m not in NOT_CORE and not _is_integration(m)]
    assert "attnguard.callguard" in core and "attnguard.plan" in core
    found = {
        m: sorted(t for t in _imports(m, module_level_only=False) if _is_integration(t))
        for m in core
    }
    assert {m: t for m, t in found.items() if t} == {}


def test_no_integration_imports_another() -> None:
    """Each library's package imports the core and the integrations' shared parts (the protocol,
    the ledger), never another library's package."""
    shared = {INTEGRATIONS, f"{INTEGRATIONS}.protocol", f"{INTEGRATIONS}.ledger"}
    crossing = {}
    for m in MODULES:
        if not _is_integration(m) or m in shared:
            continue
        own = ".".join(m.split(".")[:3])  # attnguard.integrations.<library>
        other = sorted(
            t
            for t in _imports(m, module_level_only=False)
            if _is_integration(t) and t not in shared and not t.startswith(own)
        )
        if other:
            crossing[m] = other
    assert crossing == {}
