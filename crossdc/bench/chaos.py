"""``crossdc bench chaos``: a chaos soak of a federation on the operator path.

A fresh key kit, one ``crossdc coordinator`` and ``--sites`` ``crossdc agent`` processes from TOML
configs, each site behind the userspace WAN emulator, and a supervisor that restarts what dies
(``Restart=on-failure``, ``RestartSec=3``). Every ``--period`` seconds for ``--minutes`` a fault
drawn by a seeded RNG hits it: SIGKILL or SIGTERM of a site or the coordinator, a site's link cut
for a few seconds, a partition longer than the coordinator's site timeout, a site paused
(SIGSTOP/SIGCONT). Then the faults stop; once every role runs again and three more rounds
closed (the last merging every site) the coordinator and the sites are stopped and the
figures are read from the logs, the durable state and the run's own observations. A second,
fault-free run with the same shape and as many rounds gives the validation loss to compare with.
``docs/reliability.md`` defines every field.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from coordinator import shard_commit
from crossdc.bench import chaos_analysis as an
from crossdc.bench import print_report
from crossdc.bench.chaos_faults import Injector
from crossdc.bench.chaos_fed import Federation, FedSpec
from crossdc.bench.chaos_shards import shard_figures
from crossdc.demo_args import add_job_arguments
from crossdc.demo_roles import job_options
from crossdc.progress import (
    SILENT,
    Progress,
    add_progress_argument,
    open_progress,
    pop_no_progress,
)

TICK_S = 0.25
START_TIMEOUT_S = 300.0
DRAIN_ROUNDS = 3
SAVE_KILL = "fault injection: SIGKILL after save"
"""What a shard's log says when its armed crash point (kill_shard_at_save) fired."""


def _ticker(fed: Federation, injector: Injector | None, samples: list[tuple[float, bool]]) -> None:
    if injector is not None:
        injector.tick()
    fed.tick()
    samples.append((fed.now(), fed.eligible()))
    time.sleep(TICK_S)


def wait_first_round(fed: Federation, samples: list[tuple[float, bool]]) -> None:
    deadline = fed.now() + START_TIMEOUT_S
    while not fed.closed_at:
        if fed.now() > deadline:
            raise RuntimeError(f"no round closed within {START_TIMEOUT_S:.0f}s; see {fed.workdir}")
        if any(r.final_exit is not None for r in fed.roles.values()):
            raise RuntimeError(f"a role exited for good before the first round; see {fed.workdir}")
        _ticker(fed, None, samples)


def soak(
    fed: Federation,
    injector: Injector,
    minutes: float,
    period: float,
    samples: list[Any],
    progress: Progress = SILENT,
) -> None:
    """Inject a fault every ``period`` seconds for ``minutes``."""
    end = fed.now() + minutes * 60.0
    next_fault = fed.now() + period
    planned = math.ceil(minutes * 60.0 / period) - 1
    while fed.now() < end:
        if fed.now() >= next_fault:
            injector.inject_next()
            next_fault += period
            progress.count(len(injector.applied) + len(injector.skipped), planned, "faults")
        _ticker(fed, injector, samples)


def drain(fed: Federation, injector: Injector, timeout_s: float, samples: list[Any]) -> bool:
    """Undo timed faults, then wait until every role runs and ``DRAIN_ROUNDS`` rounds closed
    after that, the last one merging every site. False on timeout or a role gone for good."""
    injector.settle()
    deadline = fed.now() + timeout_s
    up_since: float | None = None
    while fed.now() < deadline:
        _ticker(fed, injector, samples)
        if any(r.final_exit is not None for r in fed.roles.values()):
            return False
        if not fed.all_up():
            up_since = None
            continue
        up_since = fed.now() if up_since is None else up_since
        after = sorted((t, r) for r, t in fed.closed_at.items() if t > up_since)
        if len(after) >= DRAIN_ROUNDS and set(fed.merged[after[-1][1]]) == set(fed.site_ids):
            return True
    return False


def stop(fed: Federation, wait_s: float = 30.0) -> None:
    """Stop the coordinator (every shard), let the sites apply what it sent last, then stop
    everything."""
    fed.stopping = True
    coords = [fed.roles[name] for name in fed.coordinators]
    for coord in coords:
        fed.signal(coord, signal.SIGTERM)
    for coord in coords:
        if coord.proc is None:
            continue
        try:
            coord.proc.wait(wait_s)
        except subprocess.TimeoutExpired:  # a coordinator that hangs is killed by close()
            fed.event("coordinator_stop_timeout", role=coord.name)
    version = final_version(fed)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        versions = [an.site_checkpoint(fed.workdir / f"site-{s}")[0] for s in fed.site_ids]
        if all(v == version for v in versions):
            break
        time.sleep(1.0)
    fed.close()


def final_version(fed: Federation) -> int:
    """The version the coordinator ended at: its state's, or with several shards shard 0's
    commit record's."""
    if fed.spec.shards == 1:
        return an.final_coordinator(fed.coord_dir)[0]
    record = shard_commit.read(fed.lead_dir)
    return 0 if record is None else record.global_version


def hash_agreement(fed: Federation) -> dict[str, Any]:
    version, digest, history = an.final_coordinator(fed.coord_dir)
    sites = {s: an.site_checkpoint(fed.workdir / f"site-{s}") for s in fed.site_ids}
    return {
        "agree": version >= 0 and all(v == (version, digest) for v in sites.values()),
        "versions": {"coordinator": version, **{s: v[0] for s, v in sites.items()}},
        "history": history,
    }


def _site_dirs(fed: Federation) -> dict[str, Path]:
    return {s: fed.workdir / f"site-{s}" for s in fed.site_ids}


def run_chaos(
    args: argparse.Namespace, spec: FedSpec, workdir: Path, progress: Progress = SILENT
) -> dict[str, Any]:
    fed = Federation(workdir / "chaos", spec)
    injector = Injector(fed, args.seed)
    samples: list[tuple[float, bool]] = []
    drained, soak_start = False, 0.0
    phases = 3 if args.skip_fault_free else 4
    try:
        with progress.follow(fed.lead_dir, site_dirs=_site_dirs(fed)):
            progress.phase("starting the federation, waiting for the first round", 1, phases)
            fed.start()
            wait_first_round(fed, samples)
            soak_start = fed.now()
            label = f"soak: a fault every {args.period:g}s for {args.minutes:g} min"
            progress.phase(label, 2, phases)
            soak(fed, injector, args.minutes, args.period, samples, progress)
            progress.phase(f"drain: every role up and {DRAIN_ROUNDS} more rounds", 3, phases)
            drained = drain(fed, injector, args.drain_timeout, samples)
            stop(fed)
    finally:
        fed.close()
        (fed.workdir / "events.json").write_text(json.dumps(fed.events, indent=1))
    return _chaos_figures(fed, injector, samples, soak_start, drained)


def _chaos_figures(
    fed: Federation,
    injector: Injector,
    samples: list[tuple[float, bool]],
    soak_start: float,
    drained: bool,
) -> dict[str, Any]:
    logs = _logs(fed)
    ids = an.coordinator_log_ids(logs[0])  # shard 0 opens and aborts every round
    sharded: dict[str, Any] = {}
    if fed.spec.shards == 1:
        final = hash_agreement(fed)
        observed = set(fed.closed_at) | set(ids["closed"])
        lost = sorted(observed - set(final["history"]))
        params = an.final_params(fed.coord_dir)
    else:
        final = shard_figures(fed.shard_dirs, logs, _site_dirs(fed))
        final["history"] = final["shards"][0]["history"]
        params = final.pop("params")
        observed = set(fed.closed_at).union(*(an.coordinator_log_ids(t)["closed"] for t in logs))
        lost = sorted(set().union(*(observed - set(sh["history"]) for sh in final["shards"])))
        sharded = _shard_report(final, observed, logs)
    closes = sorted(fed.closed_at.values())
    soak_samples = [s for s in samples if s[0] >= soak_start]
    stall, stall_span = an.stall_figures(soak_samples, closes)
    recoveries = an.coordinator_recoveries(fed.events, closes)
    rejoins = an.site_rejoins(fed.events, fed.closed_at, fed.merged)
    restarts = [r for r in rejoins if r["after"] == "start"]
    config = fed.site_config(fed.site_ids[0])
    return {
        "faults": len(injector.applied),
        "faults_skipped": len(injector.skipped),
        "fault_kinds": injector.kind_counts(),
        "rounds_completed": len(final["history"]),
        "rounds_aborted": len(set(ids["aborted"])),
        "round_ids_reused": len(an.reused_ids(ids["open"])),
        "round_ids_reused_list": an.reused_ids(ids["open"]),
        "rounds_lost": len(lost),
        "rounds_lost_list": lost,
        "max_stall_seconds": stall,
        "max_stall_span": stall_span,
        "coordinator_recovery_seconds_max": max(recoveries, default=None),
        "coordinator_recovery_seconds": recoveries,
        "site_rejoin_rounds_max": _max_rounds(restarts),
        "site_rejoin_after_partition_rounds_max": _max_rounds(
            [r for r in rejoins if r["after"] == "link_up"]
        ),
        "site_rejoins": rejoins,
        "drain_completed": drained,
        "sites_final_hash_agree": final["agree"],
        "final_versions": final["versions"],
        "restarts": {n: r.starts - 1 for n, r in fed.roles.items()},
        "exit_codes": {n: r.exit_codes for n, r in fed.roles.items()},
        "unexpected_exits": {n: r.unexpected_exits for n, r in fed.roles.items()},
        "val_loss_initial": an.evaluate(config, None),
        "val_loss_final": an.evaluate(config, params) if params is not None else None,
        "fault_log": injector.applied,
        "faults_skipped_log": injector.skipped,
        **sharded,
    }


def _logs(fed: Federation) -> list[str]:
    """Every coordinator process's log (all its incarnations), shard 0's first."""
    return [(fed.workdir / f"{name}.log").read_text(errors="replace") for name in fed.coordinators]


def _shard_report(final: dict[str, Any], observed: set[int], logs: list[str]) -> dict[str, Any]:
    """The per-shard fields of a run on several shards (``docs/reliability.md``)."""
    shards = []
    for sh in final["shards"]:
        lost = sorted(set(sh["rounds_lost_list"]) | (observed - set(sh["history"])))
        shards.append(
            {
                "shard": sh["shard"],
                "final_version": sh["version"],
                "rounds_completed": sh["rounds"],
                "rounds_lost": len(lost),
                "rounds_lost_list": lost,
                "state_hash": sh["state_hash"],
                "sites_hold_its_part": sh["sites_agree"],
            }
        )
    return {
        "shards": shards,
        "committed_version": final["committed"],
        "combined_hash": final["combined_hash"],
        "combined_hash_is_committed": final["committed_hash"] in ("", final["combined_hash"]),
        "kills_between_save_and_commit": sum(text.count(SAVE_KILL) for text in logs),
    }


def _max_rounds(rejoins: list[dict[str, Any]]) -> float | int | None:
    """The most rounds a rejoin took; ``inf`` (JSON: a string) when a site never rejoined."""
    if not rejoins:
        return None
    if any(r["rounds"] is None for r in rejoins):
        return math.inf
    return max(int(r["rounds"]) for r in rejoins)


def run_fault_free(
    spec: FedSpec, rounds: int, workdir: Path, timeout_s: float, progress: Progress = SILENT
) -> dict[str, Any]:
    """The same federation for ``rounds`` rounds without faults; its final validation loss."""
    fed = Federation(workdir / "fault-free", replace(spec, max_rounds=rounds))
    samples: list[tuple[float, bool]] = []
    try:
        with progress.follow(fed.lead_dir, total=rounds, site_dirs=_site_dirs(fed)):
            fed.start()
            deadline = fed.now() + timeout_s
            coords = [fed.roles[name] for name in fed.coordinators]
            while any(c.final_exit is None for c in coords) and fed.now() < deadline:
                _ticker(fed, None, samples)
            for _ in range(int(30 / TICK_S)):  # sites stop on the coordinator's Shutdown
                if all(r.final_exit is not None for r in fed.roles.values()):
                    break
                _ticker(fed, None, samples)
    finally:
        fed.close()
        (fed.workdir / "events.json").write_text(json.dumps(fed.events, indent=1))
    if spec.shards == 1:
        _, _, history = an.final_coordinator(fed.coord_dir)
        params = an.final_params(fed.coord_dir)
    else:
        final = shard_figures(fed.shard_dirs, _logs(fed), _site_dirs(fed))
        history, params = final["shards"][0]["history"], final["params"]
    config = fed.site_config(fed.site_ids[0])
    return {
        "rounds": len(history),
        "val_loss": an.evaluate(config, params) if len(history) == rounds and params else None,
    }


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def job_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """``--job`` and its options as the demo's arguments, checked before anything starts: the
    factory must import and be callable and its options must parse."""
    if (args.job_path or args.job_option) and not args.job:
        raise ValueError("--job-path and --job-option need --job")
    if not args.job:
        return ()
    from site_agent.jobs.contract import load_factory  # torch: only for a job

    for index in range(args.sites):
        job_options(args, index)
    load_factory(args.job, [str(Path(p).resolve()) for p in args.job_path])
    out = ["--job", args.job]
    for path in args.job_path:
        out += ["--job-path", str(Path(path).resolve())]
    for option in args.job_option:
        out += ["--job-option", option]
    return tuple(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="crossdc bench chaos", description=__doc__)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected")
    p.add_argument("--period", type=float, default=20.0, help="seconds between faults")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault RNG")
    p.add_argument("--sites", type=int, default=3, help="number of site agents")
    p.add_argument("--shards", type=int, default=1, help="coordinator processes (shards)")
    p.add_argument("--min-sites", type=int, default=0, help="sites to open a round (0: sites-1)")
    p.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per round")
    p.add_argument("--no-overlap", action="store_true", help="block each site on every sync")
    p.add_argument("--site-timeout", type=float, default=10.0, help="coordinator site_timeout_s")
    p.add_argument("--round-deadline", type=float, default=60.0, help="round_deadline_s")
    p.add_argument("--drain-timeout", type=float, default=300.0, help="seconds to recover")
    p.add_argument("--skip-fault-free", action="store_true", help="no fault-free comparison run")
    p.add_argument("--workdir", default="", help="where configs, state and logs go")
    add_job_arguments(p)
    add_progress_argument(p)
    return p.parse_args(argv)


def run(args: argparse.Namespace, progress: Progress = SILENT) -> dict[str, Any]:
    if args.sites < 2 or args.minutes < 0 or args.period <= 0 or args.shards < 1:
        raise ValueError("--sites must be >= 2, --shards >= 1, --minutes >= 0 and --period > 0")
    job = job_argv(args)
    spec = FedSpec(
        sites=args.sites,
        min_sites=args.min_sites or max(1, args.sites - 1),
        inner_steps=args.inner_steps,
        overlap=not args.no_overlap,
        site_timeout_s=args.site_timeout,
        round_deadline_s=args.round_deadline,
        job=job,
        shards=args.shards,
    )
    workdir = Path(args.workdir or f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    started = time.monotonic()
    report = run_chaos(args, spec, workdir, progress)
    fault_free: dict[str, Any] = {"rounds": None, "val_loss": None}
    if not args.skip_fault_free and report["rounds_completed"] > 0:
        # As long as the chaos run took, twice over (rounds without overlap are long, and a
        # busy machine makes them longer), and at least ten minutes.
        timeout = max(600.0, 2.0 * (time.monotonic() - started))
        rounds = report["rounds_completed"]
        progress.phase(f"fault-free run of {rounds} rounds", 4, 4)
        fault_free = run_fault_free(spec, rounds, workdir, timeout, progress)
    report["val_loss_fault_free"] = fault_free["val_loss"]
    report["fault_free_rounds"] = fault_free["rounds"]
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    report["config"] = {
        **{k: v for k, v in vars(spec).items()},
        "minutes": args.minutes,
        "period_s": args.period,
        "seed": args.seed,
        "workdir": str(workdir),
    }
    report = dict(_json_safe(report))
    (workdir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    no_progress = pop_no_progress(args)
    previous = signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    try:
        with open_progress("crossdc bench chaos", no_progress=no_progress) as progress:
            report = run(args, progress)
    except (ValueError, RuntimeError) as exc:
        print(f"crossdc bench chaos: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_report(report, as_json=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
