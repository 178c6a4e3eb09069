"""``crossdc demo`` refuses bad arguments before it starts anything; its printout and report,
``crossdc bench wan`` and ``crossdc status`` read the whole round history from the state dir."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from comm.security.kits import issue_site
from coordinator.file_store import FileStateStore
from coordinator.history_log import read_history
from coordinator.state import GlobalState
from coordinator.status_board import StatusBoard
from crossdc import demo_report
from crossdc.bench import wan
from crossdc.cli import build_parser, main
from crossdc.demo_roles import make_kits
from crossdc.plot import FIGURES

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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["format1", "missing_site", "expired"])
def test_a_workdir_whose_kits_cannot_serve_the_run_is_refused(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A previous run's kits: refused with why, before any role starts, and left as they are."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    make_kits(workdir, ["eu", "us"])
    if damage == "format1":  # as kits before X.509 were laid out
        (workdir / "kit" / "ca.pem").rename(workdir / "kit" / "ca.pub")
        needle = "format-1 kit"
    elif damage == "missing_site":  # the run asks for a third site
        needle = "kit-ap"
    else:
        shutil.rmtree(workdir / "kit-us")
        issue_site(
            workdir / "kit", "us", 1, out_dir=workdir / "kit-us", now=time.time() - 2 * 86400
        )
        needle = "expired"
    before = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
    sites = "3" if damage == "missing_site" else "2"
    assert main(["demo", "--workdir", str(workdir), "--sites", sites, "--no-wan"]) == 2
    err = capsys.readouterr().err
    assert "holds a previous run whose kits cannot be used" in err and needle in err
    assert sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*")) == before


# ---- the full round history comes from the state directory, not status.json ----------------


def _round(round_id: int) -> dict[str, Any]:
    return {
        "round_id": round_id,
        "global_version": round_id,
        "train_loss": 3.0 - round_id / 100,
        "duration_s": 1.0 + round_id,
        "finished_unix": 1000.0 + 10 * round_id,
        "wire_bytes_in": 100,
        "wire_bytes_out": 200,
        "update_bytes": 10,
        "broadcast_bytes": 1,
        "tokens": 64,
    }


def _coordinator_dir(workdir: Path, rounds: int, *, final_val: bool = True) -> dict[str, Any]:
    """A finished coordinator's state dir and status.json as the service leaves them."""
    state_dir = workdir / "coordinator"
    store = FileStateStore(state_dir)
    params = {"w": np.zeros(4, np.float32)}
    vals = {v: 5.0 - v / 100 for v in range(rounds + (1 if final_val else 0))}
    history = tuple(_round(r) for r in range(1, rounds + 1))
    store.save(GlobalState(params, params, params, rounds, rounds, "fp", history, vals))
    status = {
        "finished": True,
        "global_version": rounds,
        "rounds_completed": rounds,
        "val_losses": {str(k): v for k, v in sorted(vals.items())},
        "history": list(history),
        "wire_bytes_in": 1000,
        "wire_bytes_out": 2000,
        "num_parameters": 4,
    }
    StatusBoard(state_dir / "status.json", lambda: 0.0, val_losses_tail=20).publish(status)
    published: dict[str, Any] = json.loads((state_dir / "status.json").read_text())
    return published


def test_demo_prints_every_round_of_a_run_longer_than_the_status_tail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = _coordinator_dir(tmp_path, 30)
    assert len(status["history"]) < 30
    assert demo_report.print_rounds(status, 0, tmp_path / "coordinator") == 30
    ids = [int(line.split()[0]) for line in capsys.readouterr().out.splitlines()]
    assert ids == list(range(1, 31))


def test_demo_follows_new_rounds_from_the_status_tail_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    status = _coordinator_dir(tmp_path, 30)

    def no_reads(_state_dir: Path) -> None:
        raise AssertionError("the tail covers these rounds")

    monkeypatch.setattr(demo_report, "read_history", no_reads)
    assert demo_report.print_rounds(status, 25, tmp_path / "coordinator") == 30
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split()[0]) for line in lines] == [26, 27, 28, 29, 30]
    assert lines[0].split()[1] == f"{5.0 - 26 / 100:.4f}"


def test_demo_report_covers_the_whole_history(tmp_path: Path) -> None:
    status = _coordinator_dir(tmp_path, 30)
    args = build_parser().parse_args(["demo", "--sites", "2", "--rounds", "30"])
    report = demo_report.build_report(args, status, 99.0, read_history(tmp_path / "coordinator"))
    assert report["round_seconds"] == [1.0 + r for r in range(1, 31)]
    assert report["val_loss_initial"] == 5.0 and report["val_loss_final"] == 5.0 - 30 / 100
    assert len(report["val_loss_by_version"]) == 31


def test_bench_wan_reads_the_whole_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    workdir = tmp_path / "crossdc"
    _coordinator_dir(workdir, 30)
    demo_report = {"val_loss_final": 4.7, "batch_size": 8, "context_len": 128}

    def fake_demo(argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, json.dumps(demo_report), "")

    monkeypatch.setattr(wan.subprocess, "run", fake_demo)
    args = wan.build_parser().parse_args(
        ["--rounds", "30", "--inner-steps", "10", "--codec", "int4", "--timeout", "60"]
    )
    got = wan.run_crossdc(args, workdir)
    assert got["sync_bytes"] == 30 * 11 and got["tokens_merged"] == 30 * 64
    # From the start of round 1 (finished at 1010 after 2 s) to the end of round 30.
    assert got["train_seconds"] == pytest.approx(1300.0 - 1008.0)


def test_status_from_a_state_dir_with_the_full_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _coordinator_dir(tmp_path, 30)
    state_dir = str(tmp_path / "coordinator")
    assert main(["status", "--state-dir", state_dir, "--json"]) == 0
    tail = json.loads(capsys.readouterr().out)
    assert tail["history_count"] == 30 and len(tail["history"]) == 20
    assert main(["status", "--state-dir", state_dir, "--history", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert [h["round_id"] for h in full["history"]] == list(range(1, 31))
    assert full["val_losses"]["0"] == 5.0 and len(full["val_losses"]) == 31
    assert main(["status", "--state-dir", state_dir, "--history"]) == 0
    out = capsys.readouterr().out
    assert "rounds_completed: 30" in out
    assert len([line for line in out.splitlines() if line.startswith("round ")]) == 30


def test_status_history_needs_a_state_dir(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--history"]) == 2
    assert "--history reads the state directory" in capsys.readouterr().err


# ---- a final validation loss that never arrived ----------------------------------------------


def test_demo_report_and_summary_without_a_final_validation_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = _coordinator_dir(tmp_path, 3, final_val=False)
    args = build_parser().parse_args(["demo", "--sites", "2", "--rounds", "3"])
    report = demo_report.build_report(args, status, 9.0, read_history(tmp_path / "coordinator"))
    assert report["val_loss_final"] is None and report["val_loss_initial"] == 5.0
    assert json.loads(json.dumps(report))["val_loss_final"] is None
    report["compute_utilization"] = 0.5
    demo_report.print_summary(report)
    assert "validation loss 5.0000 -> n/a (n/a)" in capsys.readouterr().out
    demo_report.print_summary({**report, "val_loss_initial": None})
    assert "validation loss n/a -> n/a (n/a)" in capsys.readouterr().out


def _bench_wan(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    val_loss_final: float | None,
    *,
    ddp_final: bool = True,
) -> dict[str, Any]:
    """``crossdc bench wan --json`` over fake runs: crossdc's final loss and the baseline's."""
    ours = {
        "val_loss_final": val_loss_final,
        "batch_size": 8,
        "context_len": 128,
        "tokens_merged": 3 * 8 * 128 * 40,
        "sync_bytes": 4000,
        "wan_bytes_total": 5000,
        "train_seconds": 100.0,
        "compute_utilization": 0.9,
        "site_compute_utilization": {"eu": 0.9},
        "links": {},
    }
    monkeypatch.setattr(wan, "run_crossdc", lambda _args, _workdir: ours)

    def fake_ddp(
        *, sites: int, steps: int, eval_every: int, wan: bool, timeout_s: float
    ) -> dict[str, Any]:
        losses = {0: 5.0, 20: 4.6, steps: 4.4} if ddp_final else {0: 5.0, 20: 4.6}
        return {
            "run_seconds": 50.0,
            "steps": 20 if wan else steps,
            "compute_utilization": 0.3,
            "wan_bytes_per_inner_step": 1000.0,
            "val_loss_by_step": {} if wan else losses,
        }

    monkeypatch.setattr(wan, "run_ddp", fake_ddp)
    argv = ["--sites", "3", "--rounds", "2", "--inner-steps", "20", "--skip-goodput"]
    assert wan.main([*argv, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert wan.main(argv) == 0  # the text report prints too
    capsys.readouterr()
    return out


def test_bench_wan_compares_final_losses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _bench_wan(monkeypatch, capsys, 4.6)
    assert out["inner_steps"] == 40
    assert out["val_loss_gap"] == pytest.approx((4.6 - 4.4) / 4.4)
    assert out["target_val_loss"] == 4.6 and out["ddp_steps_to_target"] == 20
    assert out["time_to_target_ratio_estimate"] == pytest.approx(20 * 2.5 / 100.0)


@pytest.mark.parametrize("ours_final", [None, 4.6])
def test_bench_wan_without_a_final_validation_loss(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ours_final: float | None
) -> None:
    # crossdc's final loss missing (ours_final None), or the baseline's (ddp_final False).
    out = _bench_wan(monkeypatch, capsys, ours_final, ddp_final=ours_final is None)
    assert out["val_loss_crossdc"] == ours_final
    assert out["val_loss_ddp_equal_tokens"] == (4.4 if ours_final is None else None)
    for key in (
        "val_loss_gap",
        "target_val_loss",
        "ddp_steps_to_target",
        "ddp_seconds_to_target_estimate",
        "time_to_target_ratio_estimate",
    ):
        assert out[key] is None, key
    assert out["crossdc_seconds_to_target"] is None
    # Every byte against every byte; the sync traffic alone is its own, named, ratio.
    assert out["bytes_ratio_vs_ddp"] == pytest.approx(1000.0 / (5000 / 40))
    assert out["sync_bytes_ratio_vs_ddp"] == pytest.approx(1000.0 / (4000 / 40))


@pytest.mark.timeout(400)
def test_a_real_demo_run_reports_and_draws(tmp_path: Path) -> None:
    """The demo end to end (real processes, no WAN emulation, no keys): θ0 built on both sides
    (nothing uploaded), the report's figures written next to it."""
    report = tmp_path / "out" / "report.json"
    report.parent.mkdir()
    argv = ["demo", "--sites", "2", "--rounds", "2", "--inner-steps", "4", "--batch-size", "4"]
    argv += ["--no-wan", "--insecure", "--workdir", str(tmp_path / "run"), "--report", str(report)]
    proc = subprocess.run(
        [sys.executable, "-m", "crossdc", *argv], capture_output=True, text=True, timeout=380
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["rounds_completed"] == 2 and r["val_loss_final"] < r["val_loss_initial"]
    assert sorted(Path(f).name for f in r["figures"]) == sorted(FIGURES)
    assert all(Path(f).parent == report.parent and Path(f).stat().st_size > 0 for f in r["figures"])
    log = (tmp_path / "run" / "coordinator.log").read_text()
    assert "initial model" in log and "need_init=True" not in log
    # Both ways the scheduler's codec; the socket's bytes are the rounds' bytes, every one.
    hist = [
        json.loads(line) for line in (tmp_path / "run" / "coordinator" / "history.jsonl").open()
    ]
    assert sum(h["wire_bytes_in"] + h["wire_bytes_out"] for h in hist) <= r["wan_bytes_total"]


@pytest.mark.parametrize(
    ("script", "code", "why"),
    [
        (
            "print('starting'); print('crossdc agent: cannot start: no job'); print('===');"
            " raise SystemExit(2)",
            2,
            ": crossdc agent: cannot start: no job (log: ",
        ),
        ("raise RuntimeError('the stage broke')", 1, ": RuntimeError: the stage broke (log: "),
        ("print('last words'); raise SystemExit(3)", 3, ": last words (log: "),
    ],
)
def test_a_role_that_exits_is_named_with_its_status_and_why(
    script: str, code: int, why: str, tmp_path: Path
) -> None:
    from crossdc.demo_roles import DemoRun

    run = DemoRun(tmp_path)
    try:
        run.spawn("site-eu", [sys.executable, "-c", script], {})
        run.procs["site-eu"].wait(timeout=30)
        said = run.failure("site-eu")
    finally:
        run.close()
    assert said.startswith(f"site-eu exited with status {code}{why}")
    assert said.endswith(f"{tmp_path / 'site-eu.log'})")
