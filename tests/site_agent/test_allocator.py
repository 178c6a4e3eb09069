"""A sharded site's ranks return large freed blocks to the system (site_agent.allocator)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt"),
]

# A block of 16 MiB freed below another: a heap that serves them keeps the first one's pages (it
# gives back only what is free at its top); mapped on its own, it goes back when freed.
CHURN = """
from site_agent.allocator import return_large_blocks

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096

print(return_large_blocks(), return_large_blocks(), flush=True)
first = b"\\x01" * (24 << 20)
del first  # glibc's threshold would rise to this size here (up to 32 MiB)
base = rss()
below = b"\\x01" * (16 << 20)
above = b"\\x01" * (16 << 20)
del below
print(rss() - base, flush=True)
"""


def _run(env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", CHURN],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    return out.stdout.split("\n")


def test_freed_large_blocks_go_back_to_the_system() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    set_twice, growth = _run(env)[:2]
    assert set_twice == "True True"
    assert int(growth) < 24 << 20  # the block above, not the one freed below it too


def test_an_operators_malloc_setting_stands() -> None:
    set_twice = _run({"MALLOC_MMAP_THRESHOLD_": str(1 << 30)})[0]
    assert set_twice == "False False"
