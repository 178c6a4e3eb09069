"""``crossdc bench wan``: crossdc against synchronous data parallelism over the demo's WAN.

Four measurements, each on real processes and real sockets:

1. ``goodput_ratio``: payload goodput of a 64 MiB flow-controlled transfer over a veth shaped to
   100 Mbit/s with tc HTB between two network namespaces, divided by the link rate
   (``crossdc.bench.wan_goodput``; raw TCP reaches about 0.95 there).
2. crossdc: the demo federation (3 sites behind the eu/us/ap WAN emulator profiles, overlapped
   sync, the scheduler) for ``rounds`` rounds of ``inner_steps``: its compute utilization
   (each site's inner steps per second over its training period divided by its own rate while
   none of its syncs was in flight, both measured in the run; mean over sites), its WAN
   bytes per inner step and its final validation loss.
3. The synchronous data-parallel baseline over the same emulated links for a few steps: its
   compute utilization (compute seconds over wall seconds: it never computes while its
   all-reduce is in flight, so this is the same ratio of rates), WAN bytes per step and wall
   seconds per step.
4. The baseline on loopback for as many steps as crossdc's inner steps (equal tokens: every step
   uses every site's batch; with arrival alignment a site may train extra steps in a round, so
   the count is the sites' merged tokens over one step's, at least rounds x inner steps), for its
   validation loss curve; its math does not depend on links, so its time to a loss on the WAN is
   *estimated* as that step count times the measured WAN step time (the fields say so).

Derived: ``bytes_ratio_vs_ddp`` (baseline / crossdc WAN bytes per inner step, both counting every
byte on the coordinator's socket: joins, the initial model, control, heartbeats, every update and
broadcast; ``sync_bytes_ratio_vs_ddp`` compares crossdc's updates and broadcasts only),
``val_loss_gap`` ((crossdc − baseline) / baseline at equal tokens) and
``time_to_target_ratio_estimate`` (the baseline's estimated WAN time / crossdc's measured time to
reach the worse of the two final losses); the last two, and the target and times they use, are
null when either run's final validation loss never arrived.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from coordinator import strategies
from coordinator.history_log import read_history
from crossdc.bench import print_report
from crossdc.bench.ddp import run_ddp
from crossdc.bench.wan_goodput import run as run_goodput
from crossdc.demo_args import outer_strategy_problem
from crossdc.demo_roles import site_ids
from crossdc.progress import (
    SILENT,
    Progress,
    add_progress_argument,
    open_progress,
    pop_no_progress,
)


def run_crossdc(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "crossdc",
        "demo",
        "--json",
        f"--sites={args.sites}",
        f"--rounds={args.rounds}",
        f"--inner-steps={args.inner_steps}",
        f"--uplink-codec={args.uplink_codec or args.codec}",
        f"--downlink-codec={args.codec}",
        f"--eval-every={args.rounds}",
        f"--workdir={workdir}",
        f"--timeout={args.timeout}",
        f"--outer-strategy={args.outer_strategy}",
        f"--broadcast={args.broadcast}",
        f"--error-feedback-decay={args.error_feedback_decay}",
        *([f"--outer-lr={args.outer_lr}"] if args.outer_lr is not None else []),
        *(["--no-overlap"] if args.no_overlap else []),
        *(["--no-align-arrivals"] if args.no_align_arrivals else []),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"crossdc demo failed: {proc.stderr.strip()[-2000:]}")
    report: dict[str, Any] = json.loads(proc.stdout)
    history = read_history(workdir / "coordinator").history  # status.json has the last rounds
    if not history:
        raise RuntimeError(f"crossdc demo completed no round; see {workdir}")
    started = history[0]["finished_unix"] - history[0]["duration_s"]
    report["train_seconds"] = history[-1]["finished_unix"] - started
    # Sync traffic: every update and every broadcast, not the one-time model download at join.
    report["sync_bytes"] = sum(h["update_bytes"] + h["broadcast_bytes"] for h in history)
    report["tokens_merged"] = sum(int(h["tokens"]) for h in history)
    used = {c for h in history for c in h.get("uplink_codecs", {}).values()}
    report["codecs_used"] = sorted(
        used | {h["downlink_codec"] for h in history if "downlink_codec" in h}
    )
    return report


def run(args: argparse.Namespace, progress: Progress = SILENT) -> dict[str, Any]:
    """The four measurements (module docstring) and what derives from them."""
    out: dict[str, Any] = {"config": vars(args).copy()}
    out.update(_goodput(args, progress))
    progress.phase(f"crossdc: {args.sites} sites x {args.rounds} rounds over the WAN", 2, 4)
    with tempfile.TemporaryDirectory(prefix="crossdc-wan-") as tmp:
        demo_dir = Path(tmp) / "crossdc"
        sites = {s: demo_dir / f"site-{s}" for s in site_ids(args.sites)}
        with progress.follow(demo_dir / "coordinator", total=args.rounds, site_dirs=sites):
            ours = run_crossdc(args, demo_dir)
    # Kept on stderr as soon as measured: a baseline run that fails later loses nothing of it.
    progress.log(json.dumps({"crossdc": ours}, default=str))
    inner_steps = _equal_token_steps(args, ours)
    progress.phase(f"synchronous baseline over the WAN, {args.ddp_wan_steps} steps", 3, 4)
    ddp_wan = run_ddp(
        sites=args.sites, steps=args.ddp_wan_steps, eval_every=0, wan=True, timeout_s=args.timeout
    )
    progress.phase(f"synchronous baseline on loopback, {inner_steps} steps", 4, 4)
    ddp_eq = run_ddp(
        sites=args.sites,
        steps=inner_steps,
        eval_every=args.ddp_eval_every,
        wan=False,
        timeout_s=args.timeout,
    )
    out.update(_comparison(ours, ddp_wan, ddp_eq, inner_steps))
    return out


def _goodput(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """Measurement 1, unless ``--skip-goodput``: the goodput ratios (None when skipped, with
    why where the measurement itself could not run)."""
    if not args.skip_goodput:
        progress.phase("goodput of a 64 MiB transfer over a shaped 100 Mbit/s veth", 1, 4)
    goodput = run_goodput(size_mib=64, rate_mbit=100) if not args.skip_goodput else {}
    fields = {
        "goodput_ratio": goodput.get("goodput_ratio"),
        "tcp_goodput_ratio": goodput.get("tcp_goodput_ratio"),
    }
    if goodput.get("skipped"):
        fields["goodput_skipped"] = goodput["skipped"]
    return fields


def _equal_token_steps(args: argparse.Namespace, ours: dict[str, Any]) -> int:
    """The baseline's steps at equal tokens: sites that landed early trained extra steps
    (arrival alignment), so as many steps as the sites' merged tokens fill, never fewer than
    the plan's."""
    site_step_tokens = ours["batch_size"] * ours["context_len"]
    steps: int = max(
        args.rounds * args.inner_steps,
        math.ceil(ours["tokens_merged"] / (args.sites * site_step_tokens)),
    )
    return steps


def _comparison(
    ours: dict[str, Any], ddp_wan: dict[str, Any], ddp_eq: dict[str, Any], inner_steps: int
) -> dict[str, Any]:
    """crossdc against the baseline: utilization, bytes per inner step, losses at equal tokens
    and the time to the worse final loss (null where either final loss never arrived)."""
    ours_bytes_per_step = ours["wan_bytes_total"] / inner_steps
    ours_sync_bytes_per_step = ours["sync_bytes"] / inner_steps
    ddp_losses = {int(k): v for k, v in ddp_eq["val_loss_by_step"].items()}
    ddp_final = ddp_losses.get(inner_steps)
    ours_final = ours["val_loss_final"]
    # Without both final losses (one never arrived) there is no gap and no target: null.
    both = ours_final is not None and ddp_final is not None
    target = max(ours_final, ddp_final) if both else None
    ddp_steps_to_target = (
        min(s for s, v in ddp_losses.items() if v <= target) if target is not None else None
    )
    ddp_step_s = ddp_wan["run_seconds"] / ddp_wan["steps"]
    ddp_s_to_target = ddp_steps_to_target * ddp_step_s if ddp_steps_to_target is not None else None
    return {
        "compute_utilization": ours["compute_utilization"],
        "site_compute_utilization": ours["site_compute_utilization"],
        "ddp_compute_utilization": ddp_wan["compute_utilization"],
        "crossdc_wan_bytes_per_inner_step": ours_bytes_per_step,
        "crossdc_wan_bytes_total": ours["wan_bytes_total"],
        "crossdc_sync_bytes_per_inner_step": ours_sync_bytes_per_step,
        "ddp_wan_bytes_per_inner_step": ddp_wan["wan_bytes_per_inner_step"],
        "bytes_ratio_vs_ddp": ddp_wan["wan_bytes_per_inner_step"] / ours_bytes_per_step,
        "sync_bytes_ratio_vs_ddp": ddp_wan["wan_bytes_per_inner_step"] / ours_sync_bytes_per_step,
        "inner_steps": inner_steps,
        "val_loss_crossdc": ours_final,
        "val_loss_ddp_equal_tokens": ddp_final,
        "val_loss_gap": (ours_final - ddp_final) / ddp_final if both else None,
        "target_val_loss": target,
        "crossdc_seconds_to_target": ours["train_seconds"] if both else None,
        "ddp_step_seconds_wan": ddp_step_s,
        "ddp_steps_to_target": ddp_steps_to_target,
        "ddp_seconds_to_target_estimate": ddp_s_to_target,
        "time_to_target_ratio_estimate": (
            ddp_s_to_target / ours["train_seconds"] if ddp_s_to_target is not None else None
        ),
        "links": ours.get("links"),
        "codecs_used": ours.get("codecs_used"),
    }


def argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, checked before any measurement; None: nothing."""
    from comm.codecs.registry import get_codec

    if args.sites < 1 or args.rounds < 1 or args.inner_steps < 1:
        return "--sites, --rounds and --inner-steps must be >= 1"
    for flag, spec in (("--codec", args.codec), ("--uplink-codec", args.uplink_codec)):
        if spec and spec != "auto":
            try:
                get_codec(spec)
            except ValueError as exc:
                return f"{flag}: {exc}"
    problem = outer_strategy_problem(args)
    if problem is not None:
        return problem
    if not 0.0 <= args.error_feedback_decay <= 1.0:
        return f"--error-feedback-decay must be in [0, 1], got {args.error_feedback_decay}"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="crossdc bench wan", description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=150)
    p.add_argument(
        "--codec",
        default="auto",
        help="crossdc's codec, both directions (default auto: the scheduler's, bytes first)",
    )
    p.add_argument("--uplink-codec", default="", help="the sites' codec (default: --codec)")
    p.add_argument(
        "--outer-strategy",
        choices=strategies.names(),
        default="diloco",
        help=strategies.help_text(),
    )
    p.add_argument(
        "--broadcast",
        choices=strategies.BROADCASTS,
        default="dense",
        help="sparse (" + ", ".join(strategies.supporting(broadcast="sparse")) + "): the round's "
        "updates forwarded in place of a delta",
    )
    p.add_argument("--error-feedback-decay", type=float, default=1.0, help="the sites' decay")
    p.add_argument("--outer-lr", type=float, default=None, help="default: the demo's")
    p.add_argument("--no-overlap", action="store_true", help="block each site on every sync")
    p.add_argument(
        "--no-align-arrivals", action="store_true", help="no extra steps for early sites"
    )
    p.add_argument("--ddp-wan-steps", type=int, default=20)
    p.add_argument("--ddp-eval-every", type=int, default=50)
    p.add_argument("--skip-goodput", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", action="store_true")
    add_progress_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = argument_problem(args)
    if problem is not None:
        print(f"crossdc bench wan: {problem}", file=sys.stderr)
        return 2
    with open_progress("crossdc bench wan", no_progress=pop_no_progress(args)) as progress:
        out = run(args, progress)
    print_report(out, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
