"""Import rules between packages, checked by parsing every module's imports.

``ALLOWED`` is the whole rule set, written once: for each package, the other packages of this
project it may import. Every import counts, wherever it is written: at module level, inside a
function, under ``if TYPE_CHECKING:``. A module belongs to the longest package name that prefixes
it (``crossdc.lab.wanem`` to ``crossdc.lab``, ``crossdc.cli`` to ``crossdc``); importing a module
of one's own package is always allowed.

Inside a package the modules form no circle either: no module imports, directly or through
others, a module that imports it back (``_import_cycles``: the strongly connected components of
the module graph, Tarjan's algorithm, every import counted as above).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = ("comm", "coordinator", "site_agent", "crossdc")

_COMM = {"comm.codecs", "comm.wire", "comm.security", "comm.transport", "comm.ops", "comm.durable"}

ALLOWED: dict[str, set[str]] = {
    # comm: the shared layer, layered inside; it never imports coordinator, site_agent, crossdc.
    "comm": set(),
    # Crash-safe file writes: the standard library only, for every layer that writes a file.
    "comm.durable": set(),
    "comm.codecs": set(),
    "comm.wire": {"comm.codecs"},
    "comm.security": {"comm.durable"},
    "comm.ops": set(),
    "comm.transport": {"comm.wire", "comm.security"},
    # The two roles share only comm: neither imports the other, nor crossdc.
    "coordinator": set(_COMM),
    # The site's core knows a job only through the job contract, never a built-in job itself.
    "site_agent": _COMM | {"site_agent.jobs.contract"},
    # The job contract: what a job gives crossdc and how a factory is found and checked.
    "site_agent.jobs.contract": set(_COMM),
    # The built-in jobs (the byte GPT, digits, Hugging Face): the contract and each other only;
    # never the site's core (its trainer, agent, config), which drives them through the contract.
    "site_agent.jobs": _COMM | {"site_agent.jobs.contract"},
    # The lab (WAN emulation) is tooling on the crossdc side and stands alone.
    "crossdc.lab": set(),
    "crossdc": _COMM
    | {"coordinator", "site_agent", "site_agent.jobs", "site_agent.jobs.contract", "crossdc.lab"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(module: str) -> str | None:
    """The longest package of ``ALLOWED`` that is ``module`` or contains it."""
    best = None
    for pkg in ALLOWED:
        if (module == pkg or module.startswith(pkg + ".")) and (
            best is None or len(pkg) > len(best)
        ):
            best = pkg
    return best


def _imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Every (line, module) an import statement anywhere in ``tree`` names. ``from P import X``
    names ``P.X`` as well, since X may be a module of P."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                if not is_package:
                    anchor.pop()
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return found


def _modules() -> list[Path]:
    return sorted(p for top in TOP_LEVEL for p in (ROOT / top).rglob("*.py"))


def _violations() -> list[str]:
    problems = []
    for path in _modules():
        module = _module_name(path)
        own = _package_of(module)
        if own is None:
            problems.append(f"{module}: belongs to no package of ALLOWED")
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        seen: set[tuple[int, str]] = set()
        for line, target in _imported_modules(tree, module, path.name == "__init__.py"):
            if target.split(".")[0] not in TOP_LEVEL:
                continue
            other = _package_of(target)
            if other is None or other == own or (line, other) in seen:
                continue
            seen.add((line, other))
            if other not in ALLOWED[own]:
                allowed = ", ".join(sorted(ALLOWED[own])) or "nothing"
                problems.append(
                    f"{path.relative_to(ROOT)}:{line}: {own} imports {target} ({other}); "
                    f"{own} may import only {allowed}"
                )
    return problems


def test_every_module_keeps_its_package_import_rules() -> None:
    problems = _violations()
    assert not problems, "import rules broken:\n" + "\n".join(problems)


def test_every_module_belongs_to_a_package_of_the_rules() -> None:
    assert _modules(), "no modules found: is ROOT right?"
    loose = [m for m in map(_module_name, _modules()) if _package_of(m) is None]
    assert not loose


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import comm.wire.schema", {"comm.wire.schema"}),
        ("from comm.wire import schema", {"comm.wire", "comm.wire.schema"}),
        ("def f():\n    from coordinator import service", {"coordinator", "coordinator.service"}),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from site_agent.agent import X",
            {"typing", "typing.TYPE_CHECKING", "site_agent.agent", "site_agent.agent.X"},
        ),
        ("from .frames import to_wire", {"comm.wire.frames", "comm.wire.frames.to_wire"}),
    ],
)
def test_imports_are_found_wherever_they_are_written(source: str, expected: set[str]) -> None:
    found = {name for _, name in _imported_modules(ast.parse(source), "comm.wire.tensors", False)}
    assert found == expected


def test_a_forbidden_import_is_reported() -> None:
    tree = ast.parse("def f():\n    from coordinator.service import Service\n")
    targets = {name for _, name in _imported_modules(tree, "comm.wire.frames", False)}
    assert {_package_of(t) for t in targets} == {"coordinator"}
    assert "coordinator" not in ALLOWED["comm.wire"]


# ---- no import circles ---------------------------------------------------------------------

ACYCLIC_PACKAGES = TOP_LEVEL
"""The top-level packages whose modules must form no import circle: every one."""


def _import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], tuple[str, int]]]:
    """Module -> the project's modules it imports (by name: ``from P import X`` counts P.X
    only where X is a module), and where each edge is written: (path, line)."""
    paths = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    where: dict[tuple[str, str], tuple[str, int]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, target in _imported_modules(tree, module, path.name == "__init__.py"):
            if target in paths and target != module:
                graph[module].add(target)
                where.setdefault((module, target), (str(path.relative_to(ROOT)), line))
    return graph, where


def _strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph``, each sorted, iteratively (no
    recursion limit); nodes only named as targets count as nodes too."""
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def _a_cycle(graph: Mapping[str, Iterable[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module: [m, ..., m]."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, ())):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if target in members and target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {start}")


def _import_cycles(package: str) -> list[str]:
    """Every import circle with a module of ``package``, one line each: its modules, and one
    circle through them with where each import is written."""
    graph, where = _import_graph()
    problems = []
    for component in _strongly_connected(graph):
        if len(component) < 2 or not any(m.split(".")[0] == package for m in component):
            continue
        cycle = _a_cycle(graph, component)
        steps = ", ".join(
            f"{a} -> {b} ({where[(a, b)][0]}:{where[(a, b)][1]})"
            for a, b in zip(cycle, cycle[1:], strict=False)
        )
        problems.append(f"{len(component)} modules import each other: {component}; {steps}")
    return problems


@pytest.mark.parametrize("package", ACYCLIC_PACKAGES)
def test_no_import_circle_among_the_modules_of(package: str) -> None:
    problems = _import_cycles(package)
    assert not problems, "import circles:\n" + "\n".join(problems)


def test_strongly_connected_components_golden() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"f"}}
    assert sorted(_strongly_connected(graph)) == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert _a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert _a_cycle(graph, ["d", "e"]) == ["d", "e", "d"]
