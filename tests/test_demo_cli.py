"""``crossdc demo`` refuses bad arguments before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from crossdc.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--sites", "0"], "--sites, --rounds and --inner-steps must be >= 1"),
        (["--outer-warmup-steps", "-1"], "--outer-warmup-steps must be >= 0"),
    ],
)
def test_bad_demo_arguments_exit_2_and_start_nothing(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = tmp_path / "run"
    assert main(["demo", "--workdir", str(workdir), *argv]) == 2
    assert needle in capsys.readouterr().err
    assert not workdir.exists()
