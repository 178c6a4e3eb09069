"""``crossdc bench hostile``: a training federation under authenticated attackers.

The federation is ``crossdc bench chaos``'s (``crossdc.bench.chaos_fed``): the operator path of
``crossdc demo``, a fresh key kit (CA, CURVE keys, certificates, the coordinator's ZAP handler),
a real ``crossdc coordinator`` process and ``--sites`` real ``crossdc agent`` processes training
the byte GPT behind the userspace WAN emulator, with secure aggregation on (masked rounds)
unless ``--no-secure-aggregation``. It is chosen over ``crossdc bench fuzz --live``'s
simulated sites because its sites really train, mask and apply what the coordinator sends.

First ``--seconds`` without attackers, then up to ``--attack-seconds`` while every attack of
``crossdc.bench.hostile_attacks`` runs at once, each from a certified site of its own (issued
from the federation's CA) connected straight to the coordinator's socket. The report:

- ``rss_growth_bytes``: the coordinator's peak resident memory (``VmHWM``) at the end of the
  attack phase minus its peak at the end of the attack-free phase;
- ``longest_round_gap_s`` / ``attack_free_round_gap_s``: the longest time between two
  consecutive rounds closing in each phase (the round's ``finished_unix`` in the coordinator's
  status), the phase's end counting as a close when the last round closed before it;
- ``attacks``: per attack its name, the class of attack it belongs to, ``refused`` (measured:
  an Error back, a refusal the coordinator logged naming the attacker, a connection cut, a
  transfer dropped) and ``cause``, the coordinator's own words;
- ``checks``: each target of the bench as measured: growth within ``bound_bytes`` and within
  256 MiB, the longest gap under attack within twice the attack-free one, every attack refused.
- ``bound_bytes``: docs/security.md's bound of what the coordinator's channel holds for its
  peers, at this run's model and membership.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from comm.security.kits import issue_site
from crossdc.bench import print_report
from crossdc.bench.chaos_fed import Federation, FedSpec, free_port
from crossdc.bench.hostile_attacks import (
    ATTACKER_SITES,
    ATTACKS,
    JOINING_SITES,
    AttackEnv,
    Outcome,
    outcome_of_failure,
)
from crossdc.demo_roles import make_kits, site_ids

TICK_S = 0.25
START_TIMEOUT_S = 300.0
BENCH_MODEL = {"context_len": 64, "num_layers": 2, "d_model": 128, "num_heads": 2}
"""About 0.43M parameters: the full model (1.7 MB) is larger than the coordinator's initial
credit (1 MiB), so a peer that grants no credit holds a transfer back; small enough that a
round closes every few seconds on 2 cores."""
CREDIT_WAIT_S = 20.0
"""The coordinator's ``channel.credit_wait_timeout_s`` here (600 s by default), so that the
send-queue attack's outcome shows within the run."""
PRE_JOIN_BYTES = 64 << 10
MEMBER_SLACK_BYTES = 4 << 20
CHUNK_BYTES = 256 << 10
STAGGER_S = 1.0
"""Attack ``i`` starts ``i x STAGGER_S`` after the attack phase begins."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="crossdc bench hostile", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--sites", type=int, default=3, help="honest sites that train")
    p.add_argument("--seconds", type=float, default=40.0, help="the attack-free phase")
    p.add_argument(
        "--attack-seconds",
        type=float,
        default=140.0,
        help="the attack phase (the trickle attack needs over 120 s to see its transfer dropped)",
    )
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--no-secure-aggregation", action="store_true")
    p.add_argument("--workdir", type=Path, default=None, help="keep the run here (default: temp)")
    args = p.parse_args(argv)
    if args.sites < 2:
        p.error("--sites must be >= 2")
    return args


# --------------------------------------------------------------------------------------------
# What is observed of the coordinator


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` in bytes (empty when it is gone)."""
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def scrape_rejected(port: int) -> dict[str, float]:
    """``crossdc_rejected_total`` by reason from the coordinator's /metrics (empty if none)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("crossdc_rejected_total{"):
            labels, _, value = line.partition("} ")
            reason = labels.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(value)
    return out


def longest_gap(closes: list[float], start: float, end: float) -> float:
    """The longest time between consecutive round closes in ``[start, end]``, counting the
    last close before ``start`` (else ``start``) and ``end`` as closes."""
    before = [t for t in closes if t < start]
    inside = sorted(t for t in closes if start <= t <= end)
    points = [before[-1] if before else start, *inside, end]
    return max(b - a for a, b in zip(points, points[1:], strict=False))


class Watch:
    """The federation ticked, the coordinator's memory sampled, rounds' close times kept."""

    def __init__(self, fed: Federation) -> None:
        self.fed = fed
        self.closed_unix: dict[int, float] = {}
        self.rss_peak = 0

    @property
    def pid(self) -> int:
        proc = self.fed.roles["coordinator"].proc
        return proc.pid if proc is not None else -1

    def tick(self) -> None:
        self.fed.tick()
        for h in self.fed.status.get("history", []):
            self.closed_unix.setdefault(int(h["round_id"]), float(h["finished_unix"]))
        self.rss_peak = max(self.rss_peak, proc_status(self.pid).get("VmRSS", 0))
        time.sleep(TICK_S)

    def open_round(self) -> int:
        return int(self.fed.status.get("open_round") or 0)

    def run_for(self, seconds: float, until: Callable[[], bool] = lambda: False) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not until():
            self.tick()
            if not self.fed.roles["coordinator"].alive:
                return


# --------------------------------------------------------------------------------------------
# The run


def _issue_attackers(workdir: Path) -> None:
    for site in ATTACKER_SITES:
        issue_site(workdir / "kit", site, days=1, out_dir=workdir / f"kit-{site}")


def _fingerprint(model: dict[str, int]) -> str:
    from site_agent.jobs.bytegpt.model import ModelConfig, model_fingerprint

    return model_fingerprint(ModelConfig(**model))


def _run_attacks(env: AttackEnv, watch: Watch) -> list[Outcome]:
    results: dict[int, list[Outcome]] = {}

    def one(i: int, attack: Callable[[AttackEnv], list[Outcome]]) -> None:
        time.sleep(i * STAGGER_S)  # so that each attack's effect on memory shows on its own
        try:
            results[i] = attack(env)
        except Exception as exc:  # reported as the attack's outcome, never raised in a thread
            results[i] = [outcome_of_failure(attack, exc)]

    threads = [
        threading.Thread(target=one, args=(i, a), name=a.__name__, daemon=True)
        for i, a in enumerate(ATTACKS)
    ]
    for t in threads:
        t.start()
    watch.run_for(
        env.deadline - time.monotonic() + 30.0, until=lambda: not any(t.is_alive() for t in threads)
    )
    for t in threads:
        t.join(timeout=5.0)
    out: list[Outcome] = []
    for i, attack in enumerate(ATTACKS):
        out += results.get(i, [outcome_of_failure(attack, TimeoutError("did not finish"))])
    return out


def bound_bytes(num_parameters: int, members: int, not_joined: int, held_updates: int = 3) -> int:
    """docs/security.md: ``2 x (members x ((2 + held) x 4 P + 4 MiB) + sites connected without
    joining x 64 KiB)`` plus one message sent whole being read (``chunk_bytes + 64 KiB``), where
    ``held`` (``held_updates``) is the updates of a member its rounds may hold: rounds open at
    once plus fragments (3 with the bench's coordinator: sync overlaps compute, one fragment)."""
    member = (2 + held_updates) * 4 * num_parameters + MEMBER_SLACK_BYTES
    return 2 * (members * member + not_joined * PRE_JOIN_BYTES) + CHUNK_BYTES + (64 << 10)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    secagg = not args.no_secure_aggregation
    metrics_port = free_port()
    spec = FedSpec(
        sites=args.sites,
        min_sites=args.sites,
        inner_steps=args.inner_steps,
        site_timeout_s=10.0,
        round_deadline_s=60.0,
        model=dict(BENCH_MODEL),
        demo_flags=("--secure-aggregation",) if secagg else (),
        coordinator={
            "metrics_port": metrics_port,
            "channel": {"credit_wait_timeout_s": CREDIT_WAIT_S},
        },
    )
    honest = site_ids(args.sites)
    workdir.mkdir(parents=True, exist_ok=True)
    make_kits(workdir, honest)
    _issue_attackers(workdir)
    fed = Federation(workdir, spec)
    watch = Watch(fed)
    report: dict[str, Any] = {
        "config": {
            "sites": args.sites,
            "seconds": args.seconds,
            "attack_seconds": args.attack_seconds,
            "inner_steps": args.inner_steps,
            "secure_aggregation": secagg,
            "model": BENCH_MODEL,
            "coordinator_overrides": {"channel.credit_wait_timeout_s": CREDIT_WAIT_S},
            "workdir": str(workdir),
        }
    }
    try:
        fed.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not watch.closed_unix:
            if time.monotonic() > deadline or not fed.roles["coordinator"].alive:
                raise RuntimeError(f"no round closed within {START_TIMEOUT_S:.0f}s; see {workdir}")
            watch.tick()
        free_start = time.time()
        watch.run_for(args.seconds)
        free_end = time.time()
        free_hwm = proc_status(watch.pid).get("VmHWM", 0)
        free_rss_peak = watch.rss_peak
        rejected_before = scrape_rejected(metrics_port)
        env = AttackEnv(
            endpoint=f"tcp://127.0.0.1:{fed.port}",
            workdir=workdir,
            coordinator_log=workdir / "coordinator.log",
            fingerprint=_fingerprint(BENCH_MODEL),
            secure_aggregation=secagg,
            open_round=watch.open_round,
            deadline=time.monotonic() + args.attack_seconds,
            peak_rss=lambda: proc_status(watch.pid).get("VmHWM", 0),
        )
        attack_start = time.time()
        watch.rss_peak = 0
        outcomes = _run_attacks(env, watch)
        attack_end = time.time()
        attack_hwm = proc_status(watch.pid).get("VmHWM", 0)
        rejected_after = scrape_rejected(metrics_port)
        coordinator_alive = fed.roles["coordinator"].alive
        status = dict(fed.status)
    finally:
        fed.close()
    closes = sorted(watch.closed_unix.values())
    num_parameters = int(status.get("num_parameters", 0))
    not_joined = len(ATTACKER_SITES) - len(JOINING_SITES)
    log_text = (workdir / "coordinator.log").read_text(errors="replace")
    report.update(
        {
            "rss_growth_bytes": max(0, attack_hwm - free_hwm) if attack_hwm else None,
            "attack_free_peak_rss_bytes": free_hwm,
            "attack_peak_rss_bytes": attack_hwm,
            "attack_free_sampled_peak_rss_bytes": free_rss_peak,
            "attack_sampled_peak_rss_bytes": watch.rss_peak,
            "bound_bytes": bound_bytes(num_parameters, args.sites + len(JOINING_SITES), not_joined),
            "bound_formula": "2 x (members x (8 P + 4 MiB) + sites not joined x 64 KiB) "
            "+ chunk_bytes + 64 KiB",
            "num_parameters": num_parameters,
            "longest_round_gap_s": round(longest_gap(closes, attack_start, attack_end), 3),
            "attack_free_round_gap_s": round(longest_gap(closes, free_start, free_end), 3),
            "rounds_closed_attack_free": sum(free_start <= t <= free_end for t in closes),
            "rounds_closed_under_attack": sum(attack_start <= t <= attack_end for t in closes),
            "attack_phase_s": round(attack_end - attack_start, 1),
            "coordinator_alive": coordinator_alive,
            "coordinator_tracebacks": log_text.count("Traceback"),
            "rejected_during_attacks": {
                k: v - rejected_before.get(k, 0.0)
                for k, v in sorted(rejected_after.items())
                if v - rejected_before.get(k, 0.0)
            },
            "rounds_planned_with_attackers": {
                site: sum(
                    1 for ln in log_text.splitlines() if "] open: " in ln and f" {site}: " in ln
                )
                for site in JOINING_SITES
            },
            "attacks_refused": sum(o.refused for o in outcomes),
            "attacks_not_refused": [o.name for o in outcomes if not o.refused],
            "attacks": [o.to_json() for o in outcomes],
        }
    )
    report["checks"] = checks(report)
    return report


def checks(report: dict[str, Any]) -> dict[str, bool | None]:
    """The bench's targets, each measured against the figures above (None: not measured)."""
    growth, bound = report["rss_growth_bytes"], report["bound_bytes"]
    gap, free_gap = report["longest_round_gap_s"], report["attack_free_round_gap_s"]
    return {
        "rss_growth_within_bound": None if growth is None else growth <= bound,
        "rss_growth_within_256_mib": None if growth is None else growth <= 256 << 20,
        "round_gap_within_2x": None if not free_gap else gap <= 2 * free_gap,
        "every_attack_refused": not report["attacks_not_refused"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    try:
        if args.workdir is not None:
            report = run(args, args.workdir)
        else:
            with tempfile.TemporaryDirectory(prefix="crossdc-hostile-") as tmp:
                report = run(args, Path(tmp))
    except (ValueError, RuntimeError) as exc:
        print(f"crossdc bench hostile: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report, as_json=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
