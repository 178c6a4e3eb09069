"""Import rules between packages, checked by parsing every module's imports.

``ALLOWED`` is the whole rule set, written once: for each package, the other packages of this
project it may import. Every import counts, wherever it is written: at module level, inside a
function, under ``if TYPE_CHECKING:``. A module belongs to the longest package name that prefixes
it (``crossdc.lab.wanem`` to ``crossdc.lab``, ``crossdc.cli`` to ``crossdc``); importing a module
of one's own package is always allowed.
"""

from __future__ import annotations

import ast
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
    "site_agent": set(_COMM),
    # The lab (WAN emulation) is tooling on the crossdc side and stands alone.
    "crossdc.lab": set(),
    "crossdc": _COMM | {"coordinator", "site_agent", "crossdc.lab"},
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
