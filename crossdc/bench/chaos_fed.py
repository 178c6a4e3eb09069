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
import math
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comm.ops.configio import dump_toml
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
    shards: int = 1
    """Coordinator processes (``[coordinator] shards``): one ``crossdc coordinator --shard i``
    each, from the one TOML; every site opens one channel per shard, each behind its own
    emulated link."""


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
    armed_argv: list[str] | None = None
    """The command line of the next start only (a drill's crash point armed), then ``argv``."""
    armed: bool = False
    """The current process runs with a crash point armed: its SIGKILL is no crash."""
    starts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    final_exit: int | None = None
    """The exit code after which the supervisor did not restart the role."""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def free_port(span: int = 1) -> int:
    """A TCP port nothing listens on now (bound to port 0, then closed), and with ``span`` > 1
    the ``span - 1`` ports after it free too (shards on one host bind consecutive ports)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + span - 1 <= 65535 and all(_bindable(port + i) for i in range(1, span)):
            return port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def link_name(site_id: str, shard: int, shards: int) -> str:
    """The emulated link from site ``site_id`` to coordinator shard ``shard``: the site's id
    with one shard, ``site@shard`` with several."""
    return site_id if shards == 1 else f"{site_id}@{shard}"


def coordinator_roles(shards: int) -> list[str]:
    """The coordinator's roles: ``coordinator``, or ``coordinator-<i>`` for each shard."""
    return ["coordinator"] if shards == 1 else [f"coordinator-{i}" for i in range(shards)]


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
        self.coordinators = coordinator_roles(spec.shards)
        self.links_of = {
            s: [link_name(s, i, spec.shards) for i in range(spec.shards)] for s in self.site_ids
        }
        """Each site's emulated links, one per shard (shard 0's first)."""
        self.link_down: dict[str, bool] = {
            name: False for names in self.links_of.values() for name in names
        }
        self.stopping = False
        self.status: dict[str, Any] = {}
        self.port = 0
        self.coord_config = workdir / "coordinator.toml"

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, event: str, **fields: Any) -> None:
        self.events.append({"t": round(self.now(), 3), "event": event, **fields})

    @property
    def coord_dir(self) -> Path:
        """The coordinator's ``state_dir`` (with several shards, shard i's is ``shard-<i>``
        in it)."""
        return self.workdir / "coordinator"

    @property
    def shard_dirs(self) -> list[Path]:
        """Every coordinator process's own state directory, shard 0's first."""
        if self.spec.shards == 1:
            return [self.coord_dir]
        return [self.coord_dir / f"shard-{i}" for i in range(self.spec.shards)]

    @property
    def lead_dir(self) -> Path:
        """The state directory of the process that decides (shard 0): its ``status.json``
        says which rounds closed."""
        return self.shard_dirs[0]

    def is_coordinator(self, role: str) -> bool:
        return role in self.coordinators

    def site_config(self, site_id: str) -> Path:
        return self.workdir / f"site-{site_id}.toml"

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        logging.getLogger("crossdc.lab").setLevel(logging.WARNING)
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = demo_args(self.spec)
        if not (self.workdir / "kit").exists():
            make_kits(self.workdir, self.site_ids)
        shards = self.spec.shards
        self.port = free_port(shards)
        overrides = {
            "bind": f"tcp://127.0.0.1:{self.port}",
            "max_rounds": self.spec.max_rounds,
            "min_sites": self.spec.min_sites,
            "site_timeout_s": self.spec.site_timeout_s,
            "round_deadline_s": self.spec.round_deadline_s,
            "metrics_port": 0,
            **self._shard_keys(),
            **self.spec.coordinator,
        }
        self.coord_config = write_coordinator_config(
            args, self.workdir, overrides=overrides, model=self.spec.model
        )
        endpoints: dict[str, list[str]] = {}
        profiles = link_profiles(args, self.site_ids)
        for site_id, names in self.links_of.items():
            for shard, name in enumerate(names):
                link = LinkEmulator(
                    "127.0.0.1", self.port + shard, profile=profiles[site_id], name=f"link-{name}"
                )
                self.run.links[name] = link
                link.start()
                endpoints.setdefault(site_id, []).append(f"tcp://127.0.0.1:{link.port}")
        python = [sys.executable, "-m", "crossdc"]
        for shard, name in enumerate(self.coordinators):
            argv = [*python, "coordinator", "--config", str(self.coord_config)]
            self.roles[name] = Role(name, argv + (["--shard", str(shard)] if shards > 1 else []))
        first = {s: e[0] for s, e in endpoints.items()}
        for site_id, path in write_site_configs(args, self.workdir, first, model=self.spec.model):
            if shards > 1:
                _add_shard_endpoints(path, endpoints[site_id])
            self.roles[site_id] = Role(site_id, [*python, "agent", "--config", str(path)])
        for role in self.roles.values():
            self._spawn(role)

    def _shard_keys(self) -> dict[str, Any]:
        """The ``[coordinator]`` keys of several shards on this host: consecutive ports from
        ``bind``'s and a free port for shard 0's control plane."""
        if self.spec.shards == 1:
            return {}
        return {
            "shards": self.spec.shards,
            "shard_ports": "offset",
            "shard_control_bind": f"tcp://127.0.0.1:{free_port()}",
        }

    def arm(self, role: Role, faults: dict[str, int]) -> None:
        """Start ``role``'s next incarnation with ``[coordinator.faults]`` set (a drill's crash
        point, from a copy of the coordinator's config); later starts run the plain config."""
        doc = tomllib.loads(self.coord_config.read_text())
        doc["coordinator"]["faults"] = dict(faults)
        path = self.workdir / f"{role.name}-armed.toml"
        path.write_text(dump_toml(doc))
        argv = list(role.argv)
        argv[argv.index(str(self.coord_config))] = str(path)
        role.armed_argv = argv

    def _spawn(self, role: Role) -> None:
        log_name = role.name if self.is_coordinator(role.name) else f"site-{role.name}"
        argv, role.armed_argv = role.armed_argv or role.argv, None
        self.run.spawn(log_name, argv, self.env, append=role.starts > 0)
        role.proc = self.run.procs[log_name]
        role.starts += 1
        role.paused = False
        role.exit_expected = False
        role.restart_at = None
        role.last_start = self.now()
        role.armed = argv is not role.argv
        armed = {"armed": True} if role.armed else {}
        self.event("start", role=role.name, pid=role.proc.pid, incarnation=role.starts, **armed)

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
        killed_itself = role.armed and rc == -signal.SIGKILL
        if not role.exit_expected and not killed_itself and not self.stopping:
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
            status = json.loads((self.lead_dir / "status.json").read_text())
        except (OSError, ValueError):
            return
        self.status = status
        committed = self._committed()
        now = self.now()
        for h in status.get("history", []):
            rid = int(h["round_id"])
            if rid not in self.closed_at and rid <= committed:
                self.closed_at[rid] = now
                self.merged[rid] = list(h.get("merged", []))
                self.event("closed", round_id=rid, merged=self.merged[rid])

    def _committed(self) -> float:
        """The newest version the sites may hear of: any one coordinator's; with several
        shards, shard 0's commit record's (a version saved and not committed may be undone)."""
        if self.spec.shards == 1:
            return math.inf
        try:
            return int(json.loads((self.lead_dir / "committed.json").read_text())["global_version"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    def rounds_closed_since(self, t: float) -> int:
        return sum(1 for seen in self.closed_at.values() if seen > t)

    def reachable(self, site_id: str) -> bool:
        """Every one of the site's links is up."""
        return not any(self.link_down[name] for name in self.links_of[site_id])

    def running_sites(self) -> list[str]:
        """Sites whose process runs, is not paused, and whose links are up."""
        return [
            s
            for s in self.site_ids
            if self.roles[s].alive and not self.roles[s].paused and self.reachable(s)
        ]

    def eligible(self) -> bool:
        """Every coordinator process runs and enough sites to open a round run and reach it."""
        coordinators = all(self.roles[c].alive for c in self.coordinators)
        return coordinators and len(self.running_sites()) >= self.spec.min_sites

    def all_up(self) -> bool:
        return all(r.alive and not r.paused for r in self.roles.values()) and not any(
            self.link_down.values()
        )


def _add_shard_endpoints(path: Path, endpoints: list[str]) -> None:
    """A site's config gains every shard's endpoint (``coordinator_shards``, shard 0's first)."""
    doc = tomllib.loads(path.read_text())
    doc["site"]["coordinator_shards"] = list(endpoints)
    path.write_text(dump_toml(doc))
