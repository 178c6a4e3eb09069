"""The site agent's shape, checked by parsing its modules: the agent is a composition root that
no component imports back, and its modules and functions stay small enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site_agent"
ASSEMBLERS = {"site_agent/launch.py", "site_agent/library.py"}
"""The modules that build an agent (and so import it); nothing the agent uses is among them."""
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_AGENT_ATTRIBUTES = 15


def _modules() -> list[Path]:
    return sorted(SITE.rglob("*.py"))


def _imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_component_imports_the_agent_back() -> None:
    offenders = []
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        if rel == "site_agent/agent.py" or rel in ASSEMBLERS:
            continue
        if "site_agent.agent" in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            offenders.append(rel)
    assert not offenders


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        source = path.read_text(encoding="utf-8")
        if len(source.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{rel}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    assert not too_long


def test_the_agent_holds_components_not_borrowed_functions() -> None:
    tree = ast.parse((SITE / "agent.py").read_text(encoding="utf-8"))
    (agent,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SiteAgent"]
    # No free function of another module bound as a method by a class-level alias.
    aliases = [n for n in agent.body if isinstance(n, ast.Assign)]
    assert not aliases
    attributes = {
        node.attr
        for node in ast.walk(agent)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    assert len(attributes) <= MAX_AGENT_ATTRIBUTES, sorted(attributes)
