"""``crossdc bench fuzz --live``: mutated valid frames against a live coordinator process.

A real ``crossdc coordinator`` runs with a fresh key kit (CURVE, certificates, the ZAP handler)
and short rounds. Two simulated sites close rounds on their own CURVE connections while a third
certified site, the attacker, sends what it likes under its own name (the sites:
``crossdc.bench.fuzz_live_sites``; the attacker: ``crossdc.bench.fuzz_live_peers``). The
coordinator must stay up and keep closing rounds: a finding is its exit, a traceback in its log, no round closed while the frames were flying, or
none within a minute after they stopped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from comm.ops.configio import dump_toml
from comm.security.kits import init_kit, issue_site
from crossdc.bench.fuzz_live_peers import ATTACKER, Attacker
from crossdc.bench.fuzz_live_sites import SITES, SiteThread

RECOVERY_S = 60.0
"""After the frames stop, a round must close within this long."""
STARTUP_S = 120.0


def model() -> dict[str, np.ndarray]:
    """The federation's model: three small tensors."""
    rng = np.random.default_rng(0)
    return {
        "layers.0.w": rng.standard_normal((32, 32)).astype(np.float32),
        "layers.0.b": np.zeros(32, np.float32),
        "head.w": rng.standard_normal((32, 8)).astype(np.float32),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_config(workdir: Path, kit: Path, port: int) -> Path:
    table = {
        "bind": f"tcp://127.0.0.1:{port}",
        "state_dir": str(workdir / "coordinator"),
        "metrics_port": 0,
        "min_sites": 2,
        "quorum_fraction": 0.5,
        "num_inner_steps": 1,
        "max_rounds": 0,
        "overlap": False,
        "uplink_codec": "fp32",
        "downlink_codec": "fp32",
        "align_arrivals": False,
        "round_deadline_s": 15.0,
        "site_timeout_s": 30.0,
        "grace_floor_s": 0.2,
        "grace_ceiling_s": 1.0,
        "keep_checkpoints": 1,
        "final_eval_wait_s": 1.0,
        "channel": {"max_transfer_bytes": 16 << 20, "receive_budget_bytes": 32 << 20},
        "security": {"kit_dir": str(kit)},
    }
    path = workdir / "coordinator.toml"
    path.write_text(dump_toml({"coordinator": table}))
    return path


# --------------------------------------------------------------------------------------------
# The run


def _wait(cond: Callable[[], object], timeout_s: float, coord: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        if coord.poll() is not None:
            return False
        time.sleep(0.05)
    return bool(cond())


def _start_coordinator(workdir: Path, log: Any) -> tuple[subprocess.Popen[bytes], str]:
    """A fresh kit (the two sites and the attacker issued), a config, the process."""
    kit = init_kit(workdir / "kit")
    for site in (*SITES, ATTACKER):
        issue_site(kit, site, days=2, out_dir=workdir / f"kit-{site}")
    port = _free_port()
    config = _write_config(workdir, kit, port)
    coord = subprocess.Popen(
        [sys.executable, "-m", "crossdc", "coordinator", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return coord, f"tcp://127.0.0.1:{port}"


def _fuzz(
    seconds: float, coord: subprocess.Popen[bytes], sites: SiteThread, attacker: Attacker
) -> dict[str, Any]:
    """The attacker's frames for ``seconds``, then a minute for a round to close; figures."""
    closed = sites.seen.rounds_closed
    before, started = len(closed), time.monotonic()
    while time.monotonic() - started < seconds and coord.poll() is None:
        attacker.step(sites.seen.open_round)
    stopped = time.monotonic()
    during = len(closed) - before
    attacker.close()
    recovered = _wait(lambda: bool(closed) and closed[-1] > stopped, RECOVERY_S, coord)
    elapsed = max(stopped - started, 1e-9)
    return {
        "frames_sent": attacker.frames_sent,
        "frames_mutated": attacker.mutated,
        "frames_per_second": round(attacker.frames_sent / elapsed),
        "sends_blocked": attacker.blocked,
        "sends_abandoned": attacker.abandoned,
        "messages_by_type": dict(attacker.by_type),
        "coordinator_replies": dict(attacker.replies),
        "rounds_closed_while_fuzzing": during,
        "rounds_closed_per_minute": round(60.0 * during / elapsed, 1),
        "round_closed_after": recovered,
        "site_errors": dict(sites.seen.errors),
    }


def _stop(coord: subprocess.Popen[bytes]) -> bool:
    """Stop the coordinator (SIGTERM, as systemd does); whether it was still running."""
    alive = coord.poll() is None
    if alive:
        coord.terminate()
        try:
            coord.wait(timeout=30)
        except subprocess.TimeoutExpired:
            coord.kill()
            coord.wait()
    return alive


def run_live(seconds: float, *, seed: int, workdir: Path) -> dict[str, Any]:
    """Fuzz a live coordinator for ``seconds``; its report (``findings`` empty when it held)."""
    workdir.mkdir(parents=True, exist_ok=True)
    params = model()
    report: dict[str, Any] = {"seconds": seconds}
    log_path = workdir / "coordinator.log"
    with log_path.open("wb") as log:
        coord, endpoint = _start_coordinator(workdir, log)
        sites = SiteThread(endpoint, workdir, params)
        attacker: Attacker | None = None
        try:
            sites.start()
            up = _wait(lambda: sites.seen.rounds_closed or sites.seen.failure, STARTUP_S, coord)
            if not up or sites.seen.failure:
                why = sites.seen.failure or f"no round closed within {STARTUP_S:.0f}s"
                raise RuntimeError(f"the live federation did not start: {why}")
            attacker = Attacker(endpoint, workdir / f"kit-{ATTACKER}", params, seed)
            report.update(_fuzz(seconds, coord, sites, attacker))
        finally:
            sites.stop.set()
            sites.join(timeout=10)
            if attacker is not None:
                attacker.close()
            report["coordinator_alive"] = _stop(coord)
    report["coordinator_exit_code"] = coord.returncode
    report["findings"] = _findings(report, log_path.read_text(errors="replace"))
    try:
        status = json.loads((workdir / "coordinator" / "status.json").read_text())
        report["coordinator_rejected"] = status.get("rejected", {})
        report["rounds_completed"] = status.get("rounds_completed", 0)
    except (OSError, ValueError):
        pass
    return report


def _findings(report: dict[str, Any], log: str) -> list[dict[str, Any]]:
    out = []
    if not report["coordinator_alive"]:
        out.append(_finding("coordinator_exit", f"exited with {report['coordinator_exit_code']}"))
    if report.get("rounds_closed_while_fuzzing", 0) == 0:
        out.append(_finding("no_progress", "no round closed while the frames were sent"))
    if not report.get("round_closed_after", False):
        out.append(_finding("no_recovery", f"no round closed within {RECOVERY_S:.0f}s after"))
    if "Traceback" in log:
        at = log.index("Traceback")
        out.append(_finding("traceback", log[at : at + 2000]))
    return out


def _finding(kind: str, message: str) -> dict[str, Any]:
    return {
        "target": "live",
        "kind": kind,
        "error": kind,
        "where": "coordinator",
        "message": message,
    }
