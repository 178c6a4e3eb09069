"""What ``crossdc demo`` prints and reports: the table of rounds on stdout (its header, then a
line per round once the round's validation loss is known), the run's JSON report (``build_report``
from the coordinator's status and history, ``full_report`` with what the sites and the links say)
and the summary that ends a run without ``--json``.

The coordinator's ``status.json`` carries its last rounds only; rounds older than those come from
its full history in the state directory (``coordinator.history_log``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.history_log import RoundLog, read_history
from crossdc.demo_roles import DEMO_MODEL, site_ids
from crossdc.progress_view import fmt_bytes, format_metrics, read_status

if TYPE_CHECKING:
    from crossdc.lab.profiles import LinkProfile


def print_header(args: argparse.Namespace, workdir: Path, profiles: dict[str, LinkProfile]) -> None:
    print(
        f"crossdc demo: {args.sites} sites x {args.rounds} rounds x {args.inner_steps} "
        f"inner steps; logs and state in {workdir}"
    )
    for site_id, prof in profiles.items():
        print(f"  link {site_id}: {prof.to_spec()}")
    print(f"{'round':>5} {'val_loss':>9} {'train_loss':>10} {'round_s':>8} {'wan_bytes':>12}")


def print_rounds(status: dict[str, Any], shown: int, state_dir: Path) -> int:
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
        loss = h["train_loss"]
        loss_s = f"{loss:10.4f}" if loss is not None else f"{'-':>10}"
        print(
            f"{h['round_id']:>5} {val_s} {loss_s} {h['duration_s']:8.1f} "
            f"{fmt_bytes(wan):>12}{others}"
        )
        shown += 1
    return shown


def full_report(
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


def print_summary(r: dict[str, Any]) -> None:
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
