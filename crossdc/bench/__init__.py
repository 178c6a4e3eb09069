"""Benchmarks run by ``crossdc bench SUITE``; each prints JSON with ``--json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def print_report(out: Mapping[str, Any], *, as_json: bool) -> None:
    """The report as indented JSON, or one ``key: value`` line per figure (without its config)."""
    if as_json:
        print(json.dumps(out, indent=1))
        return
    for key, value in out.items():
        if key != "config":
            print(f"{key:>34}: {value}")
