"""``crossdc demo``: a coordinator and N site agents as separate processes on this machine.

Writes one config per role into a work directory, starts ``crossdc coordinator`` and ``crossdc
agent`` processes over tcp on loopback, follows the coordinator's ``status.json`` to print one
line per round, and ends with a summary (and a JSON report with ``--report``).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comm.configio import dump_toml
from comm.wanem import PRESETS, LinkEmulator, LinkProfile, parse_profile
from coordinator.config import CoordinatorConfig
from coordinator.history_log import RoundLog, read_history

SITE_NAMES = ("eu", "us", "ap", "sa", "af", "me", "oc", "na")

# The embedded default: a small byte-level GPT that learns visibly within two minutes on 2 cores.
DEMO_MODEL = {"context_len": 128, "num_layers": 4, "d_model": 128, "num_heads": 4}


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
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many s")


def link_profiles(args: argparse.Namespace, site_ids: list[str]) -> dict[str, LinkProfile]:
    """Each site's emulated WAN link: presets by site name, overridden by ``--link``."""
    profiles = {s: PRESETS.get(s, PRESETS["lan"]) for s in site_ids}
    for item in args.link:
        site, sep, spec = item.partition("=")
        if not sep or site not in profiles:
            raise ValueError(f"--link {item!r}: expected SITE=PROFILE with SITE in {site_ids}")
        profiles[site] = parse_profile(spec)
    return profiles


@dataclass
class DemoRun:
    workdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: list[Any] = field(default_factory=list)
    links: dict[str, LinkEmulator] = field(default_factory=dict)

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str], *, append: bool = False
    ) -> None:
        """Start ``argv`` as ``name``; ``append`` keeps the log of an earlier run (a restart)."""
        log = open(self.workdir / f"{name}.log", "ab" if append else "wb")  # noqa: SIM115
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def close(self, grace_s: float = 10.0) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        for link in self.links.values():
            link.close()


def _security(args: argparse.Namespace, workdir: Path, site_id: str | None) -> dict[str, Any]:
    if args.insecure:
        return {"insecure": True}
    return {"kit_dir": str(workdir / ("kit" if site_id is None else f"kit-{site_id}"))}


def _secagg(args: argparse.Namespace) -> dict[str, Any]:
    if not getattr(args, "secure_aggregation", False):
        return {}
    return {"secure_aggregation": {"clip_bound": 64.0}}


def _privacy(args: argparse.Namespace) -> dict[str, Any]:
    noise = getattr(args, "dp_noise", 0.0)
    if not noise:
        return {}
    return {"privacy": {"clip_norm": args.dp_clip, "noise_multiplier": noise}}


def make_kits(workdir: Path, sites: list[str]) -> None:
    """A fresh federation kit for the demo: a CA, coordinator keys, one startup kit per site."""
    from comm.security.kits import init_kit, issue_site

    init_kit(workdir / "kit")
    for site_id in sites:
        issue_site(workdir / "kit", site_id, days=1, out_dir=workdir / f"kit-{site_id}")


def site_ids(num_sites: int) -> list[str]:
    return [SITE_NAMES[i] if i < len(SITE_NAMES) else f"site{i}" for i in range(num_sites)]


def write_coordinator_config(
    args: argparse.Namespace, workdir: Path, *, overrides: dict[str, Any] | None = None
) -> Path:
    """The coordinator's config; ``overrides`` replaces keys of its ``[coordinator]`` table."""
    coord_dir = workdir / "coordinator"
    coordinator = {
        "coordinator": {
            "bind": "tcp://127.0.0.1:0",
            "state_dir": str(coord_dir),
            "metrics_port": args.metrics_port,
            "min_sites": args.sites,
            "num_inner_steps": args.inner_steps,
            "max_rounds": args.rounds,
            "uplink_codec": args.uplink_codec,
            "downlink_codec": args.downlink_codec,
            "num_fragments": args.fragments,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "outer_warmup_steps": args.outer_warmup_steps,
            "outer_final_mean": args.outer_final_mean,
            "overlap": not args.no_overlap,
            "eval_every_rounds": args.eval_every,
            "round_deadline_s": 600.0,
            "site_timeout_s": 60.0,
            "security": _security(args, workdir, None),
            **_secagg(args),
        }
    }
    coordinator["coordinator"].update(overrides or {})
    coord_cfg = workdir / "coordinator.toml"
    coord_cfg.write_text(dump_toml(coordinator))
    return coord_cfg


def write_site_configs(
    args: argparse.Namespace,
    workdir: Path,
    endpoints: dict[str, str],
    *,
    model: dict[str, int] | None = None,
) -> list[tuple[str, Path]]:
    """One config per site; ``endpoints`` is where each reaches the coordinator; ``model``
    replaces the default DEMO_MODEL."""
    sites = []
    for i, site_id in enumerate(site_ids(args.sites)):
        doc = {
            "site": {
                "site_id": site_id,
                "coordinator": endpoints[site_id],
                "state_dir": str(workdir / f"site-{site_id}"),
                "num_threads": 1,
                "device": "cpu",
                "stages": args.stages,
                "eval_batches": 8,
                "eval_batch_size": 16,
                "data": {"source": "stdlib", "shard_index": i, "num_shards": args.sites},
                "model": model or DEMO_MODEL,
                "optim": {"batch_size": args.batch_size},
                "security": _security(args, workdir, site_id),
                **_privacy(args),
                **_secagg(args),
            }
        }
        path = workdir / f"site-{site_id}.toml"
        path.write_text(dump_toml(doc))
        sites.append((site_id, path))
    return sites


def _wait_endpoint(path: Path, coord: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if coord.poll() is not None:
            raise RuntimeError(f"coordinator exited with {coord.returncode} before listening")
        status = _read_status(path)
        if status is not None:
            return str(status["endpoint"])
        time.sleep(0.05)
    raise RuntimeError(f"coordinator did not write {path} within {timeout_s:.0f}s")


def _read_status(path: Path) -> dict[str, Any] | None:
    try:
        status: dict[str, Any] = json.loads(path.read_text())
        return status
    except (OSError, ValueError):
        return None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def run_demo(args: argparse.Namespace) -> int:
    logging.getLogger("comm.wanem").setLevel(logging.WARNING)
    # SIGTERM unwinds like Ctrl-C, so the roles this launcher started are stopped with it.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    if args.sites < 1 or args.rounds < 1 or args.inner_steps < 1:
        print("crossdc demo: --sites, --rounds and --inner-steps must be >= 1", file=sys.stderr)
        return 2
    if args.outer_warmup_steps < 0:
        print("crossdc demo: --outer-warmup-steps must be >= 0", file=sys.stderr)
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
    coord_cfg = write_coordinator_config(args, workdir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    python = [sys.executable, "-m", "crossdc"]
    run = DemoRun(workdir)
    started = time.monotonic()
    status_path = workdir / "coordinator" / "status.json"
    quiet = args.json
    if not quiet:
        print(
            f"crossdc demo: {args.sites} sites x {args.rounds} rounds x {args.inner_steps} "
            f"inner steps; logs and state in {workdir}"
        )
        for site_id, prof in profiles.items():
            print(f"  link {site_id}: {prof.to_spec()}")
        print(f"{'round':>5} {'val_loss':>9} {'train_loss':>10} {'round_s':>8} {'wan_bytes':>12}")
    status: dict[str, Any] | None = None
    try:
        run.spawn("coordinator", [*python, "coordinator", "--config", str(coord_cfg)], env)
        endpoint = _wait_endpoint(
            workdir / "coordinator" / "endpoint.json", run.procs["coordinator"], 120
        )
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        endpoints = {s: endpoint for s in ids}
        for site_id, prof in profiles.items():
            link = LinkEmulator(host, int(port), profile=prof, name=f"link-{site_id}")
            link.start()
            run.links[site_id] = link
            endpoints[site_id] = f"tcp://127.0.0.1:{link.port}"
        sites = write_site_configs(args, workdir, endpoints)
        for site_id, path in sites:
            run.spawn(f"site-{site_id}", [*python, "agent", "--config", str(path)], env)
        shown = 0
        coord = run.procs["coordinator"]
        while True:
            status = _read_status(status_path) or status
            if status is not None and not quiet:
                shown = _print_rounds(status, shown, status_path.parent)
            if coord.poll() is not None:
                break
            dead = [n for n, p in run.procs.items() if p.poll() not in (None, 0)]
            if dead:
                print(f"crossdc demo: {dead} exited with an error; see {workdir}", file=sys.stderr)
                return 1
            if time.monotonic() - started > args.timeout:
                print(f"crossdc demo: timed out after {args.timeout:.0f}s", file=sys.stderr)
                return 1
            time.sleep(0.25)
        for name, proc in run.procs.items():
            if name != "coordinator":
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    print(f"crossdc demo: {name} did not stop on shutdown", file=sys.stderr)
        status = _read_status(status_path) or status
        if status is not None and not quiet:
            _print_rounds(status, shown, status_path.parent)
        link_bytes = {s: link.bytes_up + link.bytes_down for s, link in run.links.items()}
    finally:
        run.close()
    wall = time.monotonic() - started
    if coord.returncode != 0 or status is None:
        print(
            f"crossdc demo: coordinator failed (exit {coord.returncode}); see {workdir}",
            file=sys.stderr,
        )
        return 1
    report = build_report(args, status, wall, read_history(status_path.parent))
    sites_status = {s: _read_status(workdir / f"site-{s}" / "status.json") or {} for s in ids}
    report["dp_epsilon"] = {s: st.get("dp_epsilon") for s, st in sites_status.items()}
    report["site_compute_utilization"] = {
        s: st.get("compute_utilization", 0.0) for s, st in sites_status.items()
    }
    report["compute_utilization"] = sum(report["site_compute_utilization"].values()) / len(ids)
    report["links"] = {s: p.to_spec() for s, p in profiles.items()}
    report["link_bytes"] = link_bytes
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    if quiet:
        print(json.dumps(report, indent=1, sort_keys=True))
    else:
        _print_summary(report)
    return 0


def _print_rounds(status: dict[str, Any], shown: int, state_dir: Path) -> int:
    """Print rounds ``shown`` onwards; return how many rounds are printed now.

    ``status`` carries only the last rounds (and ``history_count``); a round older than those
    comes from the full history in ``state_dir``.
    """
    history = status.get("history", [])
    offset = int(status.get("history_count", len(history))) - len(history)
    vals = status.get("val_losses", {})
    if shown < offset:
        log = read_history(state_dir)
        history, offset = list(log.history[: offset + len(history)]), 0
        vals = {**vals, **{str(k): v for k, v in log.val_losses.items()}}
    end = offset + len(history)
    # Print a round once its model's validation loss is known (or a later round completed).
    while shown < end:
        h = history[shown - offset]
        val = vals.get(str(h["global_version"]))
        if val is None and shown == end - 1 and not status.get("finished"):
            break
        wan = h.get("wire_bytes_in", 0) + h.get("wire_bytes_out", 0)
        val_s = f"{val:9.4f}" if val is not None else f"{'-':>9}"
        print(
            f"{h['round_id']:>5} {val_s} {h['train_loss']:10.4f} {h['duration_s']:8.1f} {_fmt_bytes(wan):>12}"
        )
        shown += 1
    return shown


def build_report(
    args: argparse.Namespace, status: dict[str, Any], wall: float, log: RoundLog
) -> dict[str, Any]:
    """The run's report from the coordinator's last status and its full history ``log``."""
    vals = {int(k): v for k, v in status.get("val_losses", {}).items()}
    vals.update(log.val_losses)
    history = log.history or status.get("history", [])
    final_version = status.get("global_version")
    return {
        "sites": args.sites,
        "rounds_completed": status.get("rounds_completed", 0),
        "inner_steps_per_round": args.inner_steps,
        "batch_size": args.batch_size,
        "context_len": DEMO_MODEL["context_len"],
        "num_parameters": status.get("num_parameters", 0),
        "uplink_codec": args.uplink_codec,
        "downlink_codec": args.downlink_codec,
        "stages": args.stages,
        "val_loss_initial": vals.get(0),
        "val_loss_final": vals.get(final_version) if final_version is not None else None,
        "val_loss_by_version": {str(k): v for k, v in sorted(vals.items())},
        "wan_bytes_total": status.get("wire_bytes_in", 0) + status.get("wire_bytes_out", 0),
        "wan_bytes_in": status.get("wire_bytes_in", 0),
        "wan_bytes_out": status.get("wire_bytes_out", 0),
        "round_seconds": [h["duration_s"] for h in history],
        "wall_seconds": wall,
    }


def _fmt_loss(v: float | None) -> str:
    """A validation loss, or ``n/a`` where it never arrived."""
    return "n/a" if v is None else f"{v:.4f}"


def _print_summary(r: dict[str, Any]) -> None:
    v0, v1 = r["val_loss_initial"], r["val_loss_final"]
    drop = f"{(1 - v1 / v0) * 100:.1f}% lower" if v0 and v1 is not None else "n/a"
    print(
        f"\ndone: {r['rounds_completed']} rounds, {r['sites']} sites, "
        f"{r['num_parameters']:,} parameters\n"
        f"  validation loss {_fmt_loss(v0)} -> {_fmt_loss(v1)} ({drop})\n"
        f"  WAN bytes {_fmt_bytes(r['wan_bytes_total'])} in {r['wall_seconds']:.1f}s wall\n"
        f"  compute utilization {r['compute_utilization'] * 100:.1f}% (mean over sites)"
    )
