"""``crossdc demo``: a coordinator and N site agents as separate processes on this machine.

Writes one config per role into a work directory, starts ``crossdc coordinator`` and ``crossdc
agent`` processes over tcp on loopback, follows the coordinator's ``status.json`` to print one
line per round, and ends with a summary (and a JSON report with ``--report``). On a terminal a live
display on stderr (``crossdc.progress``) shows the rounds, the sites, the latest validation loss,
the WAN bytes and the elapsed time while it runs. The roles'
configs, kits, links and processes are built in ``crossdc.demo_roles``.
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

from coordinator.config import CoordinatorConfig
from coordinator.history_log import RoundLog, read_history
from crossdc.demo_roles import (
    DEMO_MODEL,
    DEMO_SEED,
    DemoRun,
    job_options,
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
from crossdc.progress import Progress, add_progress_argument, open_progress
from crossdc.progress_view import fmt_bytes, format_metrics, read_status, rounds_view


def add_outer_rule_arguments(p: argparse.ArgumentParser) -> None:
    """--outer-warmup-steps and --outer-final-mean, defaulting to the coordinator's."""
    p.add_argument(
        "--outer-warmup-steps",
        type=int,
        default=CoordinatorConfig.outer_warmup_steps,
        help="rounds ending at or before this many inner steps merge by a plain mean",
    )
    p.add_argument(
        "--outer-final-mean",
        action=argparse.BooleanOptionalAction,
        default=CoordinatorConfig.outer_final_mean,
        help="the last round merges by a plain mean (the kept model is the sites' average)",
    )


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sites", type=int, default=3, help="number of site agents (default 3)")
    p.add_argument("--rounds", type=int, default=8, help="outer rounds to train (default 8)")
    p.add_argument("--inner-steps", type=int, default=50, help="H: inner steps per round")
    p.add_argument("--batch-size", type=int, default=8, help="inner batch size per site")
    p.add_argument(
        "--seed",
        type=int,
        default=DEMO_SEED,
        help=f"seed of θ0 and of the sites' sampling (default {DEMO_SEED})",
    )
    p.add_argument(
        "--uplink-codec", default="auto", help="codec for site updates (auto: the scheduler's)"
    )
    p.add_argument(
        "--downlink-codec",
        default="auto",
        help="codec for the global delta (auto: the scheduler's)",
    )
    p.add_argument("--fragments", type=int, default=1, help="streaming sync fragments")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum")
    add_outer_rule_arguments(p)
    p.add_argument(
        "--no-overlap", action="store_true", help="block each site on every sync (no overlap)"
    )
    p.add_argument(
        "--no-align-arrivals",
        action="store_true",
        help="every site trains exactly the planned steps (no extra steps for early sites)",
    )
    p.add_argument(
        "--eval-every", type=int, default=1, help="validation loss every N rounds (and the last)"
    )
    p.add_argument("--stages", type=int, default=1, help="pipeline stages per site")
    p.add_argument("--workdir", default="", help="where configs, state and logs go")
    p.add_argument("--report", default="", help="write a JSON report here")
    p.add_argument("--metrics-port", type=int, default=0, help="coordinator /metrics port")
    p.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="SITE=PROFILE",
        help="WAN link of a site, e.g. ap=20mbit,150ms (default: eu/us/ap presets, others lan)",
    )
    p.add_argument("--no-wan", action="store_true", help="connect sites directly, no WAN emulator")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="no CURVE and no certificates (default: a fresh federation kit in the work dir)",
    )
    p.add_argument(
        "--dp-noise",
        type=float,
        default=0.0,
        help="differential privacy: Gaussian noise multiplier z on site updates (0: off)",
    )
    p.add_argument("--dp-clip", type=float, default=1.0, help="differential privacy: clip norm C")
    p.add_argument(
        "--secure-aggregation",
        action="store_true",
        help="pairwise-masked updates: the coordinator learns only their sum",
    )
    p.add_argument(
        "--job",
        default="",
        metavar="FACTORY",
        help="train this job (package.module:callable) instead of the embedded byte GPT",
    )
    p.add_argument(
        "--job-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory put on sys.path before the job's factory is imported (repeatable)",
    )
    p.add_argument(
        "--job-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the job (a TOML value; dotted keys make tables; {site_index} and "
        "{num_sites} are replaced per site), e.g. site_index={site_index} (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many s")
    add_progress_argument(p)


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the counts on the command line (None: nothing)."""
    if args.sites < 1 or args.rounds < 1 or args.inner_steps < 1:
        return "--sites, --rounds and --inner-steps must be >= 1"
    if args.outer_warmup_steps < 0:
        return "--outer-warmup-steps must be >= 0"
    if args.job and args.stages > 1:
        return "--stages > 1 pipelines the embedded byte GPT only, not --job"
    if (args.job_path or args.job_option) and not args.job:
        return "--job-path and --job-option need --job"
    try:
        job_options(args, 0)
    except ValueError as exc:
        return str(exc)
    return None


def _print_header(
    args: argparse.Namespace, workdir: Path, profiles: dict[str, LinkProfile]
) -> None:
    print(
        f"crossdc demo: {args.sites} sites x {args.rounds} rounds x {args.inner_steps} "
        f"inner steps; logs and state in {workdir}"
    )
    for site_id, prof in profiles.items():
        print(f"  link {site_id}: {prof.to_spec()}")
    print(f"{'round':>5} {'val_loss':>9} {'train_loss':>10} {'round_s':>8} {'wan_bytes':>12}")


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
            self.shown = _print_rounds(self.status, self.shown, self.path.parent)
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
            progress.reporter.log(f"crossdc demo: {dead} exited with an error; see {run.workdir}")
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


def _full_report(
    args: argparse.Namespace,
    status: dict[str, Any],
    wall: float,
    workdir: Path,
    profiles: dict[str, LinkProfile],
    link_bytes: dict[str, int],
) -> dict[str, Any]:
    """``build_report`` plus what the sites and the links say."""
    ids = site_ids(args.sites)
    log = read_history(workdir / "coordinator")
    report = build_report(args, status, wall, log)
    report["tokens_merged"] = sum(float(h.get("tokens", 0.0)) for h in log.history)
    sites_status = {s: read_status(workdir / f"site-{s}" / "status.json") or {} for s in ids}
    report["dp_epsilon"] = {s: st.get("dp_epsilon") for s, st in sites_status.items()}
    # Per site: inner steps per second over its training period / its rate with no sync of its
    # in flight, both measured in this run (null where a site measured neither).
    util = {s: st.get("compute_utilization") for s, st in sites_status.items()}
    report["site_compute_utilization"] = util
    known = [u for u in util.values() if u is not None]
    report["compute_utilization"] = sum(known) / len(known) if known else None
    report["site_steps_per_second"] = {
        s: st.get("steps_per_second") for s, st in sites_status.items()
    }
    report["site_sync_free_steps_per_second"] = {
        s: st.get("sync_free_steps_per_second") for s, st in sites_status.items()
    }
    report["links"] = {s: p.to_spec() for s, p in profiles.items()}
    report["link_bytes"] = link_bytes
    return report


def run_demo(args: argparse.Namespace) -> int:
    logging.getLogger("crossdc.lab").setLevel(logging.WARNING)
    # SIGTERM unwinds like Ctrl-C, so the roles this launcher started are stopped with it.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    problem = _argument_problem(args)
    if problem is not None:
        print(f"crossdc demo: {problem}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ids = site_ids(args.sites)
    try:
        profiles = {} if args.no_wan else link_profiles(args, ids)
    except ValueError as exc:
        print(f"crossdc demo: {exc}", file=sys.stderr)
        return 2
    if not args.insecure and not (workdir / "kit").exists():
        make_kits(workdir, ids)
    elif not args.insecure and (problem := kit_problem(workdir, ids)) is not None:
        # A previous run's kits: its state (signed checkpoints) belongs to them, so they are
        # not replaced behind its back.
        print(
            f"crossdc demo: {workdir} holds a previous run whose kits cannot be used: {problem}. "
            "Use a new --workdir, or remove this one to start over.",
            file=sys.stderr,
        )
        return 2
    coord_cfg = write_coordinator_config(args, workdir)
    run = DemoRun(workdir)
    started = time.monotonic()
    if not args.json:
        _print_header(args, workdir, profiles)
    # Plain lines per round on stderr only with --json: otherwise the table on stdout has them.
    reporter = open_progress("crossdc demo", no_progress=args.no_progress, round_lines=args.json)
    progress = _Progress(
        workdir / "coordinator" / "status.json",
        quiet=args.json,
        reporter=reporter,
        total=args.rounds,
        site_dirs={s: workdir / f"site-{s}" for s in ids},
    )
    try:
        with reporter:
            _start_roles(args, run, coord_cfg, profiles)
            if _follow(args, run, progress, started) != 0:
                return 1
        link_bytes = {s: link.bytes_up + link.bytes_down for s, link in run.links.items()}
    finally:
        run.close()
    wall = time.monotonic() - started
    coord = run.procs["coordinator"]
    if coord.returncode != 0 or progress.status is None:
        print(
            f"crossdc demo: coordinator failed (exit {coord.returncode}); see {workdir}",
            file=sys.stderr,
        )
        return 1
    report = _full_report(args, progress.status, wall, workdir, profiles, link_bytes)
    # The pictures go next to the report (or into the run's directory without one).
    figures_dir = Path(args.report).resolve().parent if args.report else workdir
    report["figures"] = [str(p) for p in _figures(workdir, figures_dir)]
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
    else:
        _print_summary(report)
    return 0


def _figures(workdir: Path, out_dir: Path) -> list[Path]:
    from crossdc.plot import plot_run

    try:
        return plot_run(workdir, out_dir)
    except (ValueError, OSError) as exc:  # no completed round: nothing to draw
        print(f"crossdc demo: no figures: {exc}", file=sys.stderr)
        return []


def _print_rounds(status: dict[str, Any], shown: int, state_dir: Path) -> int:
    """Print rounds ``shown`` onwards; return how many rounds are printed now.

    ``status`` carries only the last rounds (and ``history_count``); a round older than those
    comes from the full history in ``state_dir``.
    """
    history = status.get("history", [])
    offset = int(status.get("history_count", len(history))) - len(history)
    vals = status.get("val_losses", {})
    metrics = status.get("val_metrics", {})
    if shown < offset:
        log = read_history(state_dir)
        history, offset = list(log.history[: offset + len(history)]), 0
        vals = {**vals, **{str(k): v for k, v in log.val_losses.items()}}
        metrics = {**metrics, **{str(k): v for k, v in log.val_metrics.items()}}
    end = offset + len(history)
    # Print a round once its model's validation loss is known (or a later round completed).
    while shown < end:
        h = history[shown - offset]
        val = vals.get(str(h["global_version"]))
        if val is None and shown == end - 1 and not status.get("finished"):
            break
        wan = h.get("wire_bytes_in", 0) + h.get("wire_bytes_out", 0)
        val_s = f"{val:9.4f}" if val is not None else f"{'-':>9}"
        others = format_metrics(metrics.get(str(h["global_version"]), {}))
        print(
            f"{h['round_id']:>5} {val_s} {h['train_loss']:10.4f} {h['duration_s']:8.1f} "
            f"{fmt_bytes(wan):>12}{others}"
        )
        shown += 1
    return shown


def build_report(
    args: argparse.Namespace, status: dict[str, Any], wall: float, log: RoundLog
) -> dict[str, Any]:
    """The run's report from the coordinator's last status and its full history ``log``."""
    vals = {int(k): v for k, v in status.get("val_losses", {}).items()}
    vals.update(log.val_losses)
    metrics = {int(k): v for k, v in status.get("val_metrics", {}).items()}
    metrics.update(log.val_metrics)
    history = log.history or status.get("history", [])
    final_version = status.get("global_version")
    return {
        "sites": args.sites,
        "rounds_completed": status.get("rounds_completed", 0),
        "inner_steps_per_round": args.inner_steps,
        "batch_size": args.batch_size,
        "context_len": None if args.job else DEMO_MODEL["context_len"],
        "num_parameters": status.get("num_parameters", 0),
        "uplink_codec": args.uplink_codec,
        "downlink_codec": args.downlink_codec,
        "stages": args.stages,
        "val_loss_initial": vals.get(0),
        "val_loss_final": vals.get(final_version) if final_version is not None else None,
        "val_loss_by_version": {str(k): v for k, v in sorted(vals.items())},
        # The job's other validation metrics (accuracy, say), by version like the losses.
        "job": args.job or None,
        "val_metrics_initial": metrics.get(0, {}),
        "val_metrics_final": metrics.get(final_version, {}) if final_version is not None else {},
        "val_metrics_by_version": {str(k): v for k, v in sorted(metrics.items())},
        "wan_bytes_total": status.get("wire_bytes_in", 0) + status.get("wire_bytes_out", 0),
        "wan_bytes_in": status.get("wire_bytes_in", 0),
        "wan_bytes_out": status.get("wire_bytes_out", 0),
        "round_seconds": [h["duration_s"] for h in history],
        "wall_seconds": wall,
    }


def _fmt_loss(v: float | None) -> str:
    """A validation loss, or ``n/a`` where it never arrived."""
    return "n/a" if v is None else f"{v:.4f}"


def _fmt_share(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 100:.1f}%"


def _print_summary(r: dict[str, Any]) -> None:
    v0, v1 = r["val_loss_initial"], r["val_loss_final"]
    drop = f"{(1 - v1 / v0) * 100:.1f}% lower" if v0 and v1 is not None else "n/a"
    print(
        f"\ndone: {r['rounds_completed']} rounds, {r['sites']} sites, "
        f"{r['num_parameters']:,} parameters\n"
        f"  validation loss {_fmt_loss(v0)} -> {_fmt_loss(v1)} ({drop})\n"
        f"  WAN bytes {fmt_bytes(r['wan_bytes_total'])} in {r['wall_seconds']:.1f}s wall\n"
        f"  compute utilization {_fmt_share(r['compute_utilization'])} (mean over sites: "
        "steps/s against each site's steps/s with no sync in flight)"
    )
