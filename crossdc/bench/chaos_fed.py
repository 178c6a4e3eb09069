"""The federation ``crossdc bench chaos`` runs: roles as processes, a supervisor, observation.

A :class:`Federation` is the operator path of ``crossdc demo`` (a fresh key kit, TOML configs,
``crossdc coordinator`` and ``crossdc agent`` processes, each site behind a userspace WAN
emulator) with two differences: the coordinator binds a fixed port, so that the emulators still
reach it after a restart, and a supervisor restarts roles the way systemd's
``Restart=on-failure``/``RestartSec=3`` does. :meth:`Federation.tick` supervises and follows the
coordinator's ``status.json``; everything seen goes into ``events`` with seconds since start.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crossdc.demo_args import add_demo_arguments, resolve_outer_rule_defaults
from crossdc.demo_roles import (
    DemoRun,
    link_profiles,
    make_kits,
    site_ids,
    write_coordinator_config,
    write_site_configs,
)
from crossdc.lab.wanem import LinkEmulator

RESTART_SEC = 3.0
"""systemd's ``RestartSec=`` in the shipped units' spirit: seconds before a restart."""
NO_RESTART_CODES = (2, 3)
"""Exit codes that mean a bad config or a model mismatch: restarting cannot help."""

# Small enough that a round of a few inner steps closes every few seconds on 2 cores.
CHAOS_MODEL = {"context_len": 64, "num_layers": 2, "d_model": 64, "num_heads": 2}


@dataclass(frozen=True)
class FedSpec:
    """The shape of one federation run."""

    sites: int = 3
    min_sites: int = 2
    inner_steps: int = 20
    overlap: bool = True
    max_rounds: int = 0
    site_timeout_s: float = 10.0
    round_deadline_s: float = 60.0
    model: dict[str, int] = field(default_factory=lambda: dict(CHAOS_MODEL))
    """The embedded byte GPT's shape (unused with ``job``)."""
    job: tuple[str, ...] = ()
    """Another job than the byte GPT, as the demo's arguments (``--job F --job-option K=V``)."""
    demo_flags: tuple[str, ...] = ()
    """More of the demo's arguments (``--secure-aggregation``)."""
    coordinator: dict[str, Any] = field(default_factory=dict)
    """Keys of the coordinator's ``[coordinator]`` table that replace what the run writes."""


@dataclass
class Role:
    """One supervised process: the coordinator or a site agent."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restart_at: float | None = None
    restart_wanted: bool = False
    """Set by a graceful stop that should be followed by a start (``systemctl restart``)."""
    paused: bool = False
    exit_expected: bool = False
    """Set when a fault (SIGKILL, SIGTERM) is what ends the current process."""
    unexpected_exits: list[int] = field(default_factory=list)
    """Exit codes of exits no fault caused (crashes)."""
    last_start: float = 0.0
    starts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    final_exit: int | None = None
    """The exit code after which the supervisor did not restart the role."""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def free_port() -> int:
    """A TCP port nothing listens on now (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_args(spec: FedSpec) -> argparse.Namespace:
    """The demo's arguments for this spec (the config writers read them)."""
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    argv = [f"--sites={spec.sites}", f"--inner-steps={spec.inner_steps}"]
    argv += ["--no-outer-final-mean", "--eval-every=1000000"]
    argv += [*([] if spec.overlap else ["--no-overlap"]), *spec.job, *spec.demo_flags]
    args = parser.parse_args(argv)
    resolve_outer_rule_defaults(args)
    return args


class Federation:
    """Start with :meth:`start`, drive with :meth:`tick`, always :meth:`close`."""

    def __init__(self, workdir: Path, spec: FedSpec) -> None:
        self.workdir = workdir
        self.spec = spec
        self.site_ids = site_ids(spec.sites)
        self.run = DemoRun(workdir)
        self.roles: dict[str, Role] = {}
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.closed_at: dict[int, float] = {}
        """Round id -> seconds since start when the coordinator's status first showed it."""
        self.merged: dict[int, list[str]] = {}
        self.link_down: dict[str, bool] = dict.fromkeys(self.site_ids, False)
        self.stopping = False
        self.status: dict[str, Any] = {}
        self.port = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, event: str, **fields: Any) -> None:
        self.events.append({"t": round(self.now(), 3), "event": event, **fields})

    @property
    def coord_dir(self) -> Path:
        return self.workdir / "coordinator"

    def site_config(self, site_id: str) -> Path:
        return self.workdir / f"site-{site_id}.toml"

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        logging.getLogger("crossdc.lab").setLevel(logging.WARNING)
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = demo_args(self.spec)
        if not (self.workdir / "kit").exists():
            make_kits(self.workdir, self.site_ids)
        self.port = free_port()
        overrides = {
            "bind": f"tcp://127.0.0.1:{self.port}",
            "max_rounds": self.spec.max_rounds,
            "min_sites": self.spec.min_sites,
            "site_timeout_s": self.spec.site_timeout_s,
            "round_deadline_s": self.spec.round_deadline_s,
            "metrics_port": 0,
            **self.spec.coordinator,
        }
        coord_cfg = write_coordinator_config(
            args, self.workdir, overrides=overrides, model=self.spec.model
        )
        endpoints = {}
        for site_id, profile in link_profiles(args, self.site_ids).items():
            link = LinkEmulator("127.0.0.1", self.port, profile=profile, name=f"link-{site_id}")
            self.run.links[site_id] = link
            link.start()
            endpoints[site_id] = f"tcp://127.0.0.1:{link.port}"
        python = [sys.executable, "-m", "crossdc"]
        self.roles["coordinator"] = Role(
            "coordinator", [*python, "coordinator", "--config", str(coord_cfg)]
        )
        for site_id, path in write_site_configs(
            args, self.workdir, endpoints, model=self.spec.model
        ):
            self.roles[site_id] = Role(site_id, [*python, "agent", "--config", str(path)])
        for role in self.roles.values():
            self._spawn(role)

    def _spawn(self, role: Role) -> None:
        log_name = role.name if role.name == "coordinator" else f"site-{role.name}"
        self.run.spawn(log_name, role.argv, self.env, append=role.starts > 0)
        role.proc = self.run.procs[log_name]
        role.starts += 1
        role.paused = False
        role.exit_expected = False
        role.restart_at = None
        role.last_start = self.now()
        self.event("start", role=role.name, pid=role.proc.pid, incarnation=role.starts)

    def close(self) -> None:
        """Stop every process (paused ones are continued first) and every emulator."""
        self.stopping = True
        for role in self.roles.values():
            if role.alive and role.paused:
                self.signal(role, signal.SIGCONT)
        self.run.close()

    # ---- supervision and observation -------------------------------------------------------

    def signal(self, role: Role, sig: signal.Signals) -> bool:
        """Send ``sig`` to the role's process; False when it is not running."""
        if not role.alive:
            return False
        assert role.proc is not None
        role.proc.send_signal(sig)
        if sig is signal.SIGSTOP:
            role.paused = True
        elif sig is signal.SIGCONT:
            role.paused = False
        return True

    def tick(self) -> None:
        """Restart what died (like systemd) and record rounds the coordinator closed."""
        for role in self.roles.values():
            self._supervise(role)
        self._observe()

    def _supervise(self, role: Role) -> None:
        now = self.now()
        if role.proc is None:
            if role.restart_at is not None and now >= role.restart_at and not self.stopping:
                self._spawn(role)
            return
        rc = role.proc.poll()
        if rc is None:
            return
        role.proc = None
        role.paused = False
        role.exit_codes.append(rc)
        if not role.exit_expected and not self.stopping:
            role.unexpected_exits.append(rc)
        role.exit_expected = False
        restart = role.restart_wanted or (rc != 0 and rc not in NO_RESTART_CODES)
        role.restart_wanted = False
        self.event("exit", role=role.name, rc=rc, restart=restart and not self.stopping)
        if restart and not self.stopping:
            role.restart_at = now + RESTART_SEC
        else:
            role.final_exit = rc

    def _observe(self) -> None:
        try:
            status = json.loads((self.coord_dir / "status.json").read_text())
        except (OSError, ValueError):
            return
        self.status = status
        now = self.now()
        for h in status.get("history", []):
            rid = int(h["round_id"])
            if rid not in self.closed_at:
                self.closed_at[rid] = now
                self.merged[rid] = list(h.get("merged", []))
                self.event("closed", round_id=rid, merged=self.merged[rid])

    def rounds_closed_since(self, t: float) -> int:
        return sum(1 for seen in self.closed_at.values() if seen > t)

    def running_sites(self) -> list[str]:
        """Sites whose process runs, is not paused, and whose link is up."""
        return [
            s
            for s in self.site_ids
            if self.roles[s].alive and not self.roles[s].paused and not self.link_down[s]
        ]

    def eligible(self) -> bool:
        """The coordinator runs and enough sites to open a round run and reach it."""
        return self.roles["coordinator"].alive and len(self.running_sites()) >= self.spec.min_sites

    def all_up(self) -> bool:
        return all(r.alive and not r.paused for r in self.roles.values()) and not any(
            self.link_down.values()
        )
