"""``crossdc demo``: a coordinator and N site agents as separate processes on this machine.

Writes one config per role into a work directory, starts ``crossdc coordinator`` and ``crossdc
agent`` processes over tcp on loopback, follows the coordinator's ``status.json`` to print one
line per round, and ends with a summary (and a JSON report with ``--report``). On a terminal a live
display on stderr (``crossdc.progress``) shows the rounds, the sites, the latest validation loss,
the WAN bytes and the elapsed time while it runs.

This module runs a demo: it prepares the work directory, starts the roles, follows them to the end
and stops them. Its arguments are ``crossdc.demo_args``; the roles' configs, kits, links and
processes are built in ``crossdc.demo_roles``; what it prints and reports is
``crossdc.demo_report``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossdc.cli_common import EXIT_BAD_CONFIG
from crossdc.demo_args import argument_problem, resolve_outer_rule_defaults
from crossdc.demo_report import full_report, print_header, print_rounds, print_summary
from crossdc.demo_roles import (
    DemoRun,
    kit_problem,
    link_profiles,
    make_kits,
    site_ids,
    wait_endpoint,
    write_coordinator_config,
    write_site_configs,
)
from crossdc.lab.profiles import LinkProfile
from crossdc.lab.wanem import LinkEmulator
from crossdc.progress import Progress, open_progress
from crossdc.progress_view import read_status, rounds_view


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo ``args`` describe; 0 when the coordinator completed the run, 2 for bad
    arguments or an unusable work directory, 1 when a role failed or time ran out."""
    logging.getLogger("crossdc.lab").setLevel(logging.WARNING)
    # SIGTERM unwinds like Ctrl-C, so the roles this launcher started are stopped with it.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    resolve_outer_rule_defaults(args)
    try:
        workdir, profiles = _prepare_workdir(args)
    except ValueError as exc:
        print(f"crossdc demo: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    coord_cfg = write_coordinator_config(args, workdir)
    started = time.monotonic()
    if not args.json:
        print_header(args, workdir, profiles)
    outcome = _run_federation(args, workdir, coord_cfg, profiles, started)
    if outcome is None:
        return 1
    status, link_bytes = outcome
    wall = time.monotonic() - started
    report = full_report(args, status, wall, workdir, profiles, link_bytes)
    # The pictures go next to the report (or into the run's directory without one).
    figures_dir = Path(args.report).resolve().parent if args.report else workdir
    report["figures"] = [str(p) for p in _figures(workdir, figures_dir)]
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
    else:
        print_summary(report)
    return 0


def _prepare_workdir(args: argparse.Namespace) -> tuple[Path, dict[str, LinkProfile]]:
    """Check the arguments, make the work directory and, unless ``--insecure``, its kits; the
    work directory and each site's WAN link. ``ValueError`` says what is wrong, before any
    role starts."""
    problem = argument_problem(args)
    if problem is not None:
        raise ValueError(problem)
    workdir = Path(args.workdir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ids = site_ids(args.sites)
    profiles = {} if args.no_wan else link_profiles(args, ids)
    if not args.insecure and not (workdir / "kit").exists():
        make_kits(workdir, ids)
    elif not args.insecure and (problem := kit_problem(workdir, ids)) is not None:
        # A previous run's kits: its state (signed checkpoints) belongs to them, so they are
        # not replaced behind its back.
        raise ValueError(
            f"{workdir} holds a previous run whose kits cannot be used: {problem}. "
            "Use a new --workdir, or remove this one to start over."
        )
    return workdir, profiles


def _run_federation(
    args: argparse.Namespace,
    workdir: Path,
    coord_cfg: Path,
    profiles: dict[str, LinkProfile],
    started: float,
) -> tuple[dict[str, Any], dict[str, int]] | None:
    """Start the roles, follow them until the run ends and stop them all. The coordinator's last
    status and the bytes each WAN link carried; None (said on stderr) when the run failed."""
    run = DemoRun(workdir)
    # Plain lines per round on stderr only with --json: otherwise the table on stdout has them.
    reporter = open_progress("crossdc demo", no_progress=args.no_progress, round_lines=args.json)
    progress = _Progress(
        workdir / "coordinator" / "status.json",
        quiet=args.json,
        reporter=reporter,
        total=args.rounds,
        site_dirs={s: workdir / f"site-{s}" for s in site_ids(args.sites)},
    )
    try:
        with reporter:
            _start_roles(args, run, coord_cfg, profiles)
            if _follow(args, run, progress, started) != 0:
                return None
        link_bytes = {s: link.bytes_up + link.bytes_down for s, link in run.links.items()}
    finally:
        run.close()
    coord = run.procs["coordinator"]
    if coord.returncode != 0 or progress.status is None:
        print(
            f"crossdc demo: coordinator failed (exit {coord.returncode}); see {workdir}",
            file=sys.stderr,
        )
        return None
    return progress.status, link_bytes


def _start_roles(
    args: argparse.Namespace, run: DemoRun, coord_cfg: Path, profiles: dict[str, LinkProfile]
) -> None:
    """Start the coordinator, a WAN link per profiled site and the site agents."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    python = [sys.executable, "-m", "crossdc"]
    workdir = run.workdir
    run.spawn("coordinator", [*python, "coordinator", "--config", str(coord_cfg)], env)
    endpoint = wait_endpoint(
        workdir / "coordinator" / "endpoint.json", run.procs["coordinator"], 120
    )
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    endpoints = {s: endpoint for s in site_ids(args.sites)}
    for site_id, prof in profiles.items():
        link = LinkEmulator(host, int(port), profile=prof, name=f"link-{site_id}")
        link.start()
        run.links[site_id] = link
        endpoints[site_id] = f"tcp://127.0.0.1:{link.port}"
    sites = write_site_configs(args, workdir, endpoints)
    for site_id, path in sites:
        run.spawn(f"site-{site_id}", [*python, "agent", "--config", str(path)], env)


@dataclass
class _Progress:
    """The coordinator's latest ``status.json`` and how many of its rounds are printed; each
    update goes to ``reporter`` too, with the sites' ``status.json`` (``site_dirs``)."""

    path: Path
    quiet: bool
    reporter: Progress
    total: int
    site_dirs: dict[str, Path]
    status: dict[str, Any] | None = None
    shown: int = 0

    def update(self) -> None:
        """Read the status again (keeping the last one if unreadable); print new rounds."""
        self.status = read_status(self.path) or self.status
        if self.status is None:
            return
        if not self.quiet:
            self.shown = print_rounds(self.status, self.shown, self.path.parent)
        sites = {s: read_status(d / "status.json") for s, d in self.site_dirs.items()}
        self.reporter.rounds(rounds_view(self.status, total=self.total, sites=sites))


def _follow(args: argparse.Namespace, run: DemoRun, progress: _Progress, started: float) -> int:
    """Follow the run until the coordinator exits (0), a role fails or time runs out (1)."""
    coord = run.procs["coordinator"]
    while True:
        progress.update()
        if coord.poll() is not None:
            break
        dead = [n for n, p in run.procs.items() if p.poll() not in (None, 0)]
        if dead:
            for name in dead:
                progress.reporter.log(f"crossdc demo: {run.failure(name)}")
            return 1
        if time.monotonic() - started > args.timeout:
            progress.reporter.log(f"crossdc demo: timed out after {args.timeout:.0f}s")
            return 1
        time.sleep(0.25)
    for name, proc in run.procs.items():
        if name != "coordinator":
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                progress.reporter.log(f"crossdc demo: {name} did not stop on shutdown")
    progress.update()
    return 0


def _figures(workdir: Path, out_dir: Path) -> list[Path]:
    from crossdc.plot import PlotUnavailable, plot_run

    try:
        return plot_run(workdir, out_dir)
    except (ValueError, OSError, PlotUnavailable) as exc:  # no round, or no matplotlib
        print(f"crossdc demo: no figures: {exc}", file=sys.stderr)
        return []
