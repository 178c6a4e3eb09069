"""Where secure aggregation may be named in the product (``coordinator/``, ``site_agent/``,
``comm/``).

Secure aggregation lives in its aggregator, its key handling, its wire fields and its config;
every other module reaches it through a seam chosen once when a role is assembled (the site's
payload form, the coordinator's aggregator). ``PLACES`` lists exactly the files that may name
it, and why; a file that names it outside the list fails, named with what it names, and a listed
file that no longer names it fails too, so the list stays exact. ``MOST_PLACES`` bounds the list.

"Naming it" is read from the code, not from its prose: an identifier (a name, an attribute, a
function, class, argument or keyword, an imported module) or a string that is not a docstring,
matching ``NAMES``. A docstring or a comment may still say how a module stands beside it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("comm", "coordinator", "site_agent")

NAMES = re.compile(r"secure_?agg|secagg|masked|masking|unmask|remask", re.IGNORECASE)
"""``secure_aggregation``, ``SecAggConfig``, ``comm.security.masking``, ``MaskingPlan``,
``masked_payload``, log lines that say "masking" ... but not a bare ``mask`` (a boolean array, the
process umask, attention masks)."""

MOST_PLACES = 10

PLACES: dict[str, str] = {
    "comm/security/masking.py": "the math: fixed point, pair keys, mask streams, SecAggConfig",
    "comm/security/secagg.py": "the protocol: peer trust, a site's session, plans, unmasking",
    "comm/wire/schema.py": "its wire field, RoundStart.secagg",
    "site_agent/config.py": "the site's config field, site.secure_aggregation",
    "site_agent/payload.py": "the site's side: its key, its session, the masked payload",
    "coordinator/config.py": "the coordinator's config field, coordinator.secure_aggregation",
    "coordinator/secure_aggregation.py": "the masked-sum aggregator, its key relay and plans",
    "coordinator/service.py": "choosing the aggregator when the coordinator is assembled",
}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of every string that stands alone as a statement: module, class and function
    docstrings and the attribute docstrings after a field."""
    out: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else ():
            if (
                isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                out.add(id(stmt.value))
    return out


def _names(source: str) -> Iterator[str]:
    """Every identifier and every string but docstrings of ``source``."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name
        elif isinstance(node, ast.arg | ast.keyword) and node.arg is not None:
            yield node.arg
        elif isinstance(node, ast.alias):
            yield node.name
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            yield node.module
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node.value


def _naming_it(source: str) -> list[str]:
    return sorted({n for n in _names(source) if NAMES.search(n)})


def _product_files() -> Iterator[Path]:
    for package in PRODUCT:
        yield from sorted((ROOT / package).rglob("*.py"))


def _where_named() -> dict[str, list[str]]:
    """Each product file that names secure aggregation, with what it names."""
    found = {}
    for path in _product_files():
        names = _naming_it(path.read_text(encoding="utf-8"))
        if names:
            found[path.relative_to(ROOT).as_posix()] = names
    return found


def test_reading_a_module_finds_code_that_names_it_and_skips_prose() -> None:
    source = '''
"""Module prose may say secure aggregation and masked updates."""
from comm.security.masking import SecAggConfig  # a comment: masking
import comm.security.secagg

class Config:
    field: int = 0
    """An attribute docstring about masking."""

def run(secure_aggregation=None, mask=None):
    """A function docstring: secagg."""
    log(f"{mask} not masking")
    return Form(masked=True).unmask_sum
'''
    assert _naming_it(source) == [
        " not masking",
        "SecAggConfig",
        "comm.security.masking",
        "comm.security.secagg",
        "masked",
        "secure_aggregation",
        "unmask_sum",
    ]
    assert _naming_it('"""secure aggregation, masked, masking"""\nmask = umask = 0\n') == []


def test_only_the_listed_files_name_secure_aggregation() -> None:
    found = _where_named()
    elsewhere = {path: names for path, names in found.items() if path not in PLACES}
    assert not elsewhere, (
        "secure aggregation is named outside its places (reach it through the role's seam, or "
        "list the file in PLACES with why): "
        + "; ".join(f"{path}: {', '.join(names[:5])}" for path, names in sorted(elsewhere.items()))
    )


def test_every_listed_place_still_names_it() -> None:
    found = _where_named()
    stale = sorted(path for path in PLACES if path not in found)
    assert not stale, f"listed in PLACES but naming secure aggregation no more: {stale}"


def test_secure_aggregation_lives_in_at_most_ten_files() -> None:
    assert len(PLACES) <= MOST_PLACES, sorted(PLACES)
