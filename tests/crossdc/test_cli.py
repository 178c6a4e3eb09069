"""The ``crossdc`` command's global face: --version, log options before or after the command,
bad values refused with a message naming them, JSON log lines."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from crossdc.cli import build_parser
from crossdc.cli_common import TextLogFormatter

pytestmark = pytest.mark.timeout(60)


def crossdc(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "crossdc", *argv],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, **(env or {})},
    )


def test_version_is_the_installed_package_version() -> None:
    proc = crossdc("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"crossdc {version('crossdc')}"


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "debug", "--log-format", "json", "status"],
        ["status", "--log-level", "debug", "--log-format", "json"],
        ["--log-level", "info", "status", "--log-level", "DEBUG", "--log-format", "JSON"],
        ["keys", "init", "kit", "--log-level", "debug", "--log-format", "json"],
    ],
)
def test_global_options_before_or_after_the_command(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.log_level, args.log_format) == ("debug", "json")


def test_defaults_when_no_option_is_given() -> None:
    args = build_parser().parse_args(["status"])
    assert (args.log_level, args.log_format) == ("info", "text")


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--log-level", "loud", "status"], {}, "log level must be one of"),
        (["status", "--log-level", "loud"], {}, "log level must be one of"),
        (["status", "--log-format", "xml"], {}, "log format must be one of"),
        (["status"], {"CROSSDC_LOG_LEVEL": "verbose"}, "CROSSDC_LOG_LEVEL must be one of"),
        (["status"], {"CROSSDC_LOG_FORMAT": "yaml"}, "CROSSDC_LOG_FORMAT must be one of"),
    ],
)
def test_bad_log_options_are_refused(argv: list[str], env: dict[str, str], named: str) -> None:
    proc = crossdc(*argv, env=env)
    assert proc.returncode == 2
    assert named in proc.stderr


def test_json_logs_are_one_object_a_line(tmp_path: Path) -> None:
    proc = crossdc("keys", "init", str(tmp_path / "kit"), "--log-format", "json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines
    for line in lines:
        entry = json.loads(line)
        assert set(entry) >= {"time", "level", "logger", "message"}
        assert entry["time"].endswith("Z") and entry["level"] in ("info", "warning")
    assert any("created federation kit" in json.loads(line)["message"] for line in lines)


def test_text_logs_escape_what_a_peer_could_put_in_a_line() -> None:
    forged = "eu\n2026-12-02 07:00:00,000 INFO coordinator round 9 closed\x1b[2J\u2028"
    record = logging.LogRecord(
        "coordinator", logging.WARNING, __file__, 1, "join from %s", (forged,), None
    )
    line = TextLogFormatter().format(record)
    assert "\n" not in line and "\x1b" not in line and "\u2028" not in line
    assert line.endswith(
        "join from eu\\n2026-12-02 07:00:00,000 INFO coordinator round 9 closed\\x1b[2J\\u2028"
    )
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert (
        TextLogFormatter().format(record).splitlines()[-1] == "ValueError: boom"
    )  # traceback kept
