"""``crossdc.progress``: plain lines where stderr is not a terminal, a rich live display where it
is, ``--no-progress`` and ``CROSSDC_PROGRESS=0`` forcing plain lines, and stdout left alone."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from crossdc import demo, progress
from crossdc.bench import convergence, scale
from crossdc.cli import build_parser
from crossdc.progress import Progress, open_progress
from crossdc.progress_view import RoundsView, SiteView, rounds_view

pytestmark = pytest.mark.timeout(60)


class FakeTTY(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _status(done: int, *, open_round: int | None = None) -> dict[str, Any]:
    return {
        "rounds_completed": done,
        "open_rounds": [] if open_round is None else [open_round],
        "val_losses": {"0": 5.5, str(done): 4.1234},
        "wire_bytes_in": 1024,
        "wire_bytes_out": 1024 * 1024,
        "finished": False,
    }


def test_rounds_view_reads_the_coordinator_and_site_status() -> None:
    sites = {"eu": {"rounds_sent": 3, "inner_steps": 150}, "us": None}
    view = rounds_view(_status(3, open_round=4), total=8, sites=sites)
    assert view.done == 3 and view.total == 8 and view.open_rounds == (4,)
    assert view.val_loss == 4.1234 and view.val_version == 3
    assert view.wan_bytes == 1024 + 1024 * 1024
    assert view.sites == (SiteView("eu", 3, 150), SiteView("us", None, None))
    # An older coordinator status names only its one open round.
    assert rounds_view({"open_round": 2, "rounds_completed": 1}).open_rounds == (2,)


@pytest.mark.parametrize(
    ("kwargs", "environ", "wanted"),
    [
        ({}, {}, True),
        ({"no_progress": True}, {}, False),
        ({}, {"CROSSDC_PROGRESS": "0"}, False),
        ({}, {"CROSSDC_PROGRESS": "off"}, False),
        ({}, {"TERM": "dumb"}, False),
        ({}, {"CROSSDC_PROGRESS": "1", "NO_COLOR": "1"}, True),  # no colour, still live
    ],
)
def test_live_only_on_a_terminal_and_not_when_forced_plain(
    kwargs: dict[str, Any], environ: dict[str, str], wanted: bool
) -> None:
    assert progress.live_wanted(stream=FakeTTY(), environ=environ, **kwargs) is wanted
    assert progress.live_wanted(stream=io.StringIO(), environ=environ, **kwargs) is False


def test_plain_mode_writes_plain_lines_on_stderr_only(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress("crossdc bench x", mode="plain", clock=lambda: 0.0) as p:
        assert not p.live
        p.phase("demo with int8, seed 1", 2, 5)
        p.rounds(RoundsView(done=0, total=4))
        p.rounds(rounds_view(_status(1), total=4))
        p.rounds(rounds_view(_status(1, open_round=2), total=4))  # the same round: no line
        p.count(3, 10, "steps")  # live only
        p.log('{"case": 1}')
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "crossdc bench x: [2/5] demo with int8, seed 1 (0s elapsed)",
        "crossdc bench x: round 1/4 merged, val_loss 4.1234 (model v1), WAN 1.0 MiB (0s elapsed)",
        '{"case": 1}',
    ]


def test_plain_mode_without_round_lines_and_off_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress("crossdc demo", mode="plain", round_lines=False) as p:
        p.rounds(rounds_view(_status(2), total=4))
    with Progress("quiet", mode="off") as p:
        p.phase("nothing", 1, 2)
        p.rounds(rounds_view(_status(2), total=4))
        p.log("but this line")
    assert capsys.readouterr() == ("", "but this line\n")


def test_live_mode_renders_rounds_loss_sites_and_phase(
    capsys: pytest.CaptureFixture[str],
) -> None:
    file = io.StringIO()
    console = Console(force_terminal=True, file=file, width=140, color_system=None)
    with Progress("crossdc demo", mode="live", console=console, clock=lambda: 0.0) as p:
        assert p.live
        p.phase("demo with int8, seed 1", 2, 5)
        sites = {"eu": {"rounds_sent": 4, "inner_steps": 200}}
        p.rounds(rounds_view(_status(3, open_round=4), total=8, sites=sites))
        p.count(120, 600, "steps")
        p.log("a line above the display")
    assert not p.live
    text = file.getvalue()
    for needle in (
        "crossdc demo",
        "elapsed 0:00:00",
        "demo with int8, seed 1 [2/5]",
        "rounds 3/8",
        "merging round 4",
        "val_loss 4.1234 (model v3)",
        "WAN 1.0 MiB",
        "eu",
        "rounds sent 4/8",
        "inner steps 200",
        "steps 120/600",
        "a line above the display",
    ):
        assert needle in text, needle
    # A display on a console of its own leaves sys.stdout and sys.stderr alone.
    assert capsys.readouterr() == ("", "")


def test_the_live_display_on_stderr_takes_print_and_gives_stderr_back(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.delenv("CROSSDC_PROGRESS", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    with open_progress("crossdc bench y") as p:
        assert p.mode == "live" and p.live
        print("printed to stderr", file=sys.stderr)  # above the display, through rich
        p.rounds(rounds_view(_status(2), total=3))
        print("stdout is not the terminal: untouched")
    assert sys.stderr is tty
    assert "printed to stderr" in tty.getvalue() and "rounds 2/3" in tty.getvalue()
    assert capsys.readouterr().out == "stdout is not the terminal: untouched\n"


@pytest.mark.parametrize("forced", ["flag", "env"])
def test_flag_or_env_var_force_plain_lines_on_a_terminal(
    forced: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setenv("TERM", "xterm")
    if forced == "env":
        monkeypatch.setenv("CROSSDC_PROGRESS", "0")
    else:
        monkeypatch.delenv("CROSSDC_PROGRESS", raising=False)
    with open_progress("crossdc demo", no_progress=forced == "flag") as p:
        assert p.mode == "plain"
        p.phase("one", 1, 1)
    assert tty.getvalue() == "crossdc demo: [1/1] one (0s elapsed)\n"


def test_follow_reads_the_status_files_of_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "coordinator"
    state.mkdir()
    (state / "status.json").write_text(json.dumps(_status(2, open_round=3)))
    with Progress("crossdc bench z", mode="plain") as p:
        with p.follow(state, total=5, site_dirs={"eu": tmp_path / "site-eu"}, every_s=0.01):
            pass
        with p.follow(tmp_path / "nothing-yet", total=5):  # no status: nothing shown
            pass
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("crossdc bench z: round 2/5 merged")


def _demo_follow(tmp_path: Path, as_json: bool, reporter: Progress) -> None:
    state = tmp_path / "coordinator"
    state.mkdir()
    status = {
        **_status(1),
        "global_version": 1,
        "history": [
            {
                "round_id": 1,
                "global_version": 1,
                "train_loss": 4.5,
                "duration_s": 2.0,
                "wire_bytes_in": 10,
                "wire_bytes_out": 20,
            }
        ],
        "history_count": 1,
    }
    (state / "status.json").write_text(json.dumps(status))
    tracker = demo._Progress(
        state / "status.json",
        quiet=as_json,
        reporter=reporter,
        total=3,
        site_dirs={"eu": tmp_path / "site-eu"},
    )
    tracker.update()
    assert tracker.shown == (0 if as_json else 1)


@pytest.mark.parametrize("as_json", [True, False])
def test_demo_rounds_go_to_stdout_or_as_plain_lines_to_stderr(
    as_json: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Progress("crossdc demo", mode="plain", round_lines=as_json) as reporter:
        _demo_follow(tmp_path, as_json, reporter)
    out, err = capsys.readouterr()
    if as_json:  # stdout keeps only the report; the round is a line on stderr
        assert out == ""
        assert err.startswith("crossdc demo: round 1/3 merged, val_loss 4.1234 (model v1)")
    else:  # the table on stdout as before, nothing more on stderr
        assert out.split()[:3] == ["1", "4.1234", "4.5000"]
        assert err == ""


def test_demo_and_benches_take_no_progress(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["demo", "--no-progress"]).no_progress is True
    assert build_parser().parse_args(["demo"]).no_progress is False
    assert scale.main(["--no-progress", "--sites", "x"]) == 2
    assert "crossdc bench scale" in capsys.readouterr().err


def test_a_bench_reports_runs_as_plain_lines_and_keeps_stdout_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fake_run(codec: str, seed: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
        return {
            "val_loss_final": 2.0,
            "val_loss_initial": 5.0,
            "wan_bytes_total": 100 if codec == "fp32" else 25,
            "wall_seconds": 1.0,
        }

    monkeypatch.setattr(convergence, "run_one", fake_run)
    argv = ["--codecs", "int4", "--seeds", "1,2", "--json", "--no-progress"]
    assert convergence.main(argv) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert "no_progress" not in json.dumps(report)
    phases = [line.split(" (")[0] for line in err.splitlines()]
    assert phases == [
        "crossdc bench convergence: [1/4] demo with fp32, seed 1",
        "crossdc bench convergence: [2/4] demo with fp32, seed 2",
        "crossdc bench convergence: [3/4] demo with int4, seed 1",
        "crossdc bench convergence: [4/4] demo with int4, seed 2",
    ]
