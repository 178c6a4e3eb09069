"""What a fresh interpreter loads: the ``crossdc`` commands that only parse, print help or ask a
role for its status import no torch, nor does parsing a frame or a coordinator's config; a
command imports what it runs when it runs it. Each case runs in its own interpreter, since
``sys.modules`` of this one holds whatever earlier tests imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

# Runs ``crossdc ARGV`` as ``python -m crossdc`` would, then writes its exit code and every module
# loaded to the file named first.
_RUN_COMMAND = """
import json, runpy, sys
out, argv = sys.argv[1], sys.argv[2:]
sys.argv = ["crossdc", *argv]
try:
    runpy.run_module("crossdc", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exc:
    code = exc.code
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def _loaded_by_command(tmp_path: Path, *argv: str) -> tuple[int, set[str]]:
    out = tmp_path / "loaded.json"
    subprocess.run(
        [sys.executable, "-c", _RUN_COMMAND, str(out), *argv],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    result = json.loads(out.read_text())
    return int(result["code"] or 0), set(result["modules"])


def _loaded_by_import(module: str) -> set[str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    return set(json.loads(proc.stdout))


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--version"], 0),
        (["keys", "--help"], 0),
        (["status", "--help"], 0),
        # Nothing listens on port 1: the status command fails to reach it, exit 1.
        (["status", "--url", "http://127.0.0.1:1"], 1),
    ],
)
def test_commands_that_only_parse_or_ask_import_no_torch(
    argv: list[str], code: int, tmp_path: Path
) -> None:
    got_code, loaded = _loaded_by_command(tmp_path, *argv)
    assert got_code == code
    assert "torch" not in loaded


def test_building_the_parser_imports_no_role_and_no_third_party_package(tmp_path: Path) -> None:
    """``crossdc --version`` builds the whole parser: every command's arguments and defaults
    come from the standard library and crossdc's own light modules."""
    code, loaded = _loaded_by_command(tmp_path, "--version")
    assert code == 0
    heavy = {"torch", "numpy", "zmq", "rich", "cryptography", "matplotlib", "msgpack"}
    assert not loaded & heavy
    assert not {m for m in loaded if m.split(".")[0] in ("coordinator", "site_agent")}


def test_a_subcommand_imports_what_it_runs(tmp_path: Path) -> None:
    """The check above is not vacuous: a run of the status command loads its HTTP client."""
    _code, loaded = _loaded_by_command(tmp_path, "status", "--url", "http://127.0.0.1:1")
    assert "urllib.request" in loaded


@pytest.mark.parametrize(
    "module",
    ["comm.wire.frames", "comm.codecs.registry", "comm.transport.profile", "coordinator.config"],
)
def test_parsing_a_frame_or_a_config_imports_no_torch(module: str) -> None:
    assert "torch" not in _loaded_by_import(module)


@pytest.mark.parametrize("module", ["coordinator.service", "site_agent.launch", "crossdc.demo"])
def test_the_roles_and_the_demo_import_no_matplotlib(module: str) -> None:
    """matplotlib is the optional ``plot`` extra: a coordinator or a site runs without it, and
    the demo imports it only to draw its figures."""
    assert "matplotlib" not in _loaded_by_import(module)
