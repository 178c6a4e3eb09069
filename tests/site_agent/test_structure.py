"""The site agent's shape, checked by parsing its modules: the agent is a composition root that
no component imports back, and holds components rather than borrowed functions. How long a
module or a function is stays a reader's guide, never a test: files split where concepts part."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site_agent"
ASSEMBLERS = {"site_agent/launch.py", "site_agent/library.py"}
"""The modules that build an agent (and so import it); nothing the agent uses is among them."""
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
