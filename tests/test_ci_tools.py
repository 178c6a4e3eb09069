""".ci/tools, which `make test` runs first: it installs the tools the deploy tests check against
where it may (root, with apt-get) and otherwise prints one line saying which checks are skipped
and how to enable them; it never fails. Run with fake ``id``, ``apt-get`` and tools on a PATH of
their own, so nothing is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / ".ci" / "tools"
BASH = shutil.which("bash")
CHMOD = shutil.which("chmod")
ALL_TOOLS = ("promtool", "prometheus", "systemd-analyze")

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(BASH is None or CHMOD is None, reason="needs bash and chmod"),
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    apt_calls: list[str]


def _executable(path: Path, body: str) -> None:
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)


def run_tools(tmp_path: Path, *, present: tuple[str, ...], uid: int, apt: str | None) -> Run:
    """Run .ci/tools with only ``present`` tools on PATH, as ``uid``; ``apt`` is what the fake
    apt-get does: None (there is none), "installs" (the packages' tools appear), "fails" (exits
    100 with an error line) or "does-nothing"."""
    bin_dir, log = tmp_path / "bin", tmp_path / "apt.log"
    bin_dir.mkdir(parents=True)
    for tool in present:
        _executable(bin_dir / tool, "")
    _executable(bin_dir / "id", f'[ "$1" = -u ] && echo {uid}')
    if apt is not None:
        provide = {"prometheus": ("promtool", "prometheus"), "systemd": ("systemd-analyze",)}
        body = f'echo "$*" >> {log}\n'
        if apt == "installs":
            for package, tools in provide.items():
                make = "; ".join(f"echo > {bin_dir / t}; {CHMOD} +x {bin_dir / t}" for t in tools)
                body += f'[ "$1" = install ] && [[ " $* " == *" {package} "* ]] && {{ {make}; }}\n'
            body += "exit 0"
        elif apt == "fails":
            body += 'echo "E: Unable to locate package prometheus" >&2\nexit 100'
        _executable(bin_dir / "apt-get", body)
    done = subprocess.run(
        [str(BASH), str(SCRIPT)],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return Run(done.returncode, done.stdout, done.stderr, calls)


def test_silent_when_every_tool_is_present(tmp_path: Path) -> None:
    run = run_tools(tmp_path, present=ALL_TOOLS, uid=0, apt="installs")
    assert (run.returncode, run.stdout, run.stderr, run.apt_calls) == (0, "", "", [])


def test_without_root_one_line_names_the_skipped_checks_and_the_command(tmp_path: Path) -> None:
    run = run_tools(tmp_path, present=("systemd-analyze",), uid=1000, apt="installs")
    assert run.returncode == 0 and run.stdout == "" and run.apt_calls == []
    (line,) = run.stderr.splitlines()
    assert line.startswith("tools: promtool, prometheus not found: ")
    assert "live-Prometheus" in line and "systemd" not in line
    assert line.endswith(
        "; to run them: sudo apt-get install -y --no-install-recommends prometheus"
    )


def test_as_root_installs_only_the_missing_packages(tmp_path: Path) -> None:
    run = run_tools(tmp_path, present=("systemd-analyze",), uid=0, apt="installs")
    assert run.returncode == 0 and run.stderr == ""
    assert run.apt_calls == ["update -qq", "install -y -qq --no-install-recommends prometheus"]
    assert run.stdout == "tools: installed prometheus (for promtool, prometheus) with apt-get\n"
    both = run_tools(tmp_path / "none", present=(), uid=0, apt="installs")
    assert both.apt_calls[-1].endswith("--no-install-recommends prometheus systemd")
    assert both.returncode == 0 and both.stderr == "" and len(both.stdout.splitlines()) == 1


@pytest.mark.parametrize("apt", ["fails", "does-nothing"])
def test_as_root_a_failed_install_is_one_line_not_a_failure(tmp_path: Path, apt: str) -> None:
    run = run_tools(tmp_path, present=("promtool",), uid=0, apt=apt)
    assert run.returncode == 0 and run.stdout == ""
    (line,) = run.stderr.splitlines()
    why = "apt-get failed: E: Unable to locate package prometheus" if apt == "fails" else "PATH"
    assert line.startswith("tools: prometheus, systemd-analyze not found (") and why in line
    assert "live-Prometheus" in line and "systemd-analyze verify" in line
    assert line.endswith(": apt-get install -y --no-install-recommends prometheus systemd")


def test_without_apt_get_names_the_packages(tmp_path: Path) -> None:
    run = run_tools(tmp_path, present=("promtool", "prometheus"), uid=0, apt=None)
    assert run.returncode == 0 and run.stdout == ""
    (line,) = run.stderr.splitlines()
    assert line.startswith("tools: systemd-analyze not found: systemd-analyze verify")
    assert line.endswith("(Debian: systemd)")


def test_make_test_gets_the_tools_first_and_ci_runs_make_test() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: .*\btools\b", makefile, flags=re.M)
    assert re.search(r"^tools:\n\t@bash \.ci/tools \|\| true$", makefile, flags=re.M)
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln[:1] not in ("#", "")]
    assert ci[-1] == "make test"
