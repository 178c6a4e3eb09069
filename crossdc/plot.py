"""``crossdc plot RUN_DIR``: pictures of a run, as PNG files.

A run directory is what ``crossdc demo`` (or a deployment) leaves: the coordinator's state dir
``coordinator/`` (its round history and validation losses) and one ``site-<id>/`` per site with
that site's ``status.json``. Four figures:

- ``val_loss_vs_time.png``: validation loss of each global version against the wall seconds
  since the first round opened;
- ``val_loss_vs_wan_bytes.png``: the same losses against the WAN bytes on the coordinator's
  socket up to that version (every byte: joins, control, heartbeats, updates, broadcasts);
- ``bytes_per_round.png``: per round, each site's update bytes and the broadcast;
- ``val_<metric>_vs_time.png``: one per other validation metric the job reports (accuracy, say);
- ``compute_utilization.png``: per site, inner steps per second over the training period
  against its own rate with no sync in flight.

``crossdc plot --frontier FILE...`` draws, instead, what ``crossdc bench equal_tokens`` wrote: a
sweep's ``frontier.json`` or a single run's ``--json`` report, as many as given: every setting's
bytes ratio against data parallelism over its validation-loss gap, one marker per seed, and the
frontier (the best ratio reached at each gap or better) into ``frontier.png``; ``--table`` also
prints the points as a Markdown table.

matplotlib is the optional ``plot`` extra (``pip install 'crossdc[plot]'``), imported only when a
figure is drawn: a figure asked for without it raises :class:`PlotUnavailable`, which names the
extra.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordinator.history_log import read_history

PLOT_EXTRA = "pip install 'crossdc[plot]'"
"""How to get matplotlib, which only the figures need."""


class PlotUnavailable(ImportError):
    """A figure was asked for without matplotlib installed; the message names the extra."""


def _pyplot() -> Any:
    """matplotlib's pyplot on the headless Agg backend (files only, never a display)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(
            f"figures need matplotlib, the optional 'plot' extra: {PLOT_EXTRA} ({exc})"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


FIGURES = (
    "val_loss_vs_time.png",
    "val_loss_vs_wan_bytes.png",
    "bytes_per_round.png",
    "compute_utilization.png",
)


def _site_status(run_dir: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(run_dir.glob("site-*/status.json")):
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[str(status.get("site_id") or path.parent.name.removeprefix("site-"))] = status
    return out


def _loss_points(
    history: Sequence[dict[str, Any]], val_losses: dict[int, float]
) -> tuple[list[float], list[float], list[float]]:
    """(seconds since the start, WAN bytes so far, loss) per version with a loss; version 0 at
    the start with the bytes of nothing."""
    start = history[0]["finished_unix"] - history[0]["duration_s"]
    seconds, wan_bytes, losses = [], [], []
    if 0 in val_losses:
        seconds.append(0.0)
        wan_bytes.append(0.0)
        losses.append(val_losses[0])
    total = 0.0
    for h in history:
        total += h.get("wire_bytes_in", 0) + h.get("wire_bytes_out", 0)
        version = int(h["global_version"])
        if version in val_losses:
            seconds.append(h["finished_unix"] - start)
            wan_bytes.append(total)
            losses.append(val_losses[version])
    return seconds, wan_bytes, losses


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the figures of the run in ``run_dir`` into ``out_dir`` (default: the run
    directory); return their paths. Raises ``ValueError`` when the run completed no round."""
    plt = _pyplot()

    run = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run
    log = read_history(run / "coordinator")
    history = list(log.history)
    if not history:
        raise ValueError(f"{run / 'coordinator'} holds no completed round")
    out.mkdir(parents=True, exist_ok=True)
    seconds, wan_bytes, losses = _loss_points(history, log.val_losses)
    paths = [out / name for name in FIGURES]
    _line_figure(
        plt,
        paths[0],
        seconds,
        losses,
        "wall seconds since the first round",
        "validation loss",
        title="Validation loss against time",
    )
    _line_figure(
        plt,
        paths[1],
        [b / 1e6 for b in wan_bytes],
        losses,
        "WAN MB on the coordinator's socket (every byte)",
        "validation loss",
        title="Validation loss against WAN bytes",
    )
    _bytes_per_round_figure(plt, paths[2], history)
    _utilization_figure(plt, paths[3], _site_status(run))
    return paths + _metric_figures(plt, history, log.val_metrics, out)


def _line_figure(
    plt: Any,
    path: Path,
    xs: Sequence[float],
    ys: Sequence[float],
    xlabel: str,
    ylabel: str,
    *,
    title: str,
) -> None:
    """One line with markers on a grid."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _bytes_per_round_figure(plt: Any, path: Path, history: Sequence[dict[str, Any]]) -> None:
    """Per round: each site's update MB (or all sites' together, for a history from before
    per-site counts) and the broadcast's, side by side."""
    rounds = [int(h["round_id"]) for h in history]
    by_site = [h.get("update_bytes_by_site") for h in history]
    series: dict[str, list[float]] = {}
    if all(b is not None for b in by_site):
        for site in sorted({s for b in by_site if b for s in b}):
            series[f"{site} update"] = [(b or {}).get(site, 0) / 1e6 for b in by_site]
    else:  # a history from before per-site counts: the sites' updates together
        series["updates (all sites)"] = [h.get("update_bytes", 0) / 1e6 for h in history]
    width = 0.8 / (len(series) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([r + i * width for r in rounds], values, width, label=label)
    broadcast = [h.get("broadcast_bytes", 0) / 1e6 for h in history]
    ax.bar([r + len(series) * width for r in rounds], broadcast, width, label="broadcast (all)")
    ax.set(xlabel="round", ylabel="MB")
    ax.set_title("Bytes per round")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _utilization_figure(plt: Any, path: Path, sites: dict[str, dict[str, Any]]) -> None:
    """Per site that measured it: its compute utilization in percent; the title names the
    sites that did not."""
    fig, ax = plt.subplots(figsize=(6, 4))
    util = {s: st.get("compute_utilization") for s, st in sites.items()}
    measured = {s: u for s, u in util.items() if u is not None}
    ax.bar(list(measured), [100 * u for u in measured.values()])
    ax.axhline(100, color="grey", linewidth=0.8)
    ax.set(ylabel="% of the sync-free step rate", xlabel="site")
    unmeasured = sorted(set(util) - set(measured))
    title = "Compute utilization" + (f" (not measured: {', '.join(unmeasured)})" * bool(unmeasured))
    ax.set_title(title)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _metric_figures(
    plt: Any, history: Sequence[dict[str, Any]], val_metrics: dict[int, dict[str, float]], out: Path
) -> list[Path]:
    """One ``val_<metric>_vs_time.png`` per other validation metric the job reports."""
    paths = []
    for name in sorted({m for metrics in val_metrics.values() for m in metrics}):
        values = {v: m[name] for v, m in val_metrics.items() if name in m}
        seconds, _bytes, points = _loss_points(history, values)
        path = out / f"val_{name}_vs_time.png"
        _line_figure(
            plt,
            path,
            seconds,
            points,
            "wall seconds since the first round",
            f"validation {name}",
            title=f"Validation {name} against time",
        )
        paths.append(path)
    return paths


def frontier_point(report: dict[str, Any]) -> dict[str, Any]:
    """A frontier point from one ``crossdc bench equal_tokens --json`` report (a run or a sweep's
    setting): the setting, the seed and the figures the frontier compares."""
    return {**_setting(report["config"]), **{key: report[key] for key in _POINT_FIGURES}}


def _setting(cfg: dict[str, Any]) -> dict[str, Any]:
    sparse_down = cfg.get("broadcast") == "sparse"
    return {
        "inner_steps": cfg["inner_steps"],
        "codec": cfg.get("uplink_codec") or cfg["codec"],
        "downlink": "sparse" if sparse_down else cfg.get("downlink_codec") or cfg["codec"],
        "strategy": cfg.get("strategy", "diloco"),
        "seed": cfg["seed"],
        "steps": cfg["steps"],
        "outer_lr": cfg.get("outer_lr"),
    }


_POINT_FIGURES = (
    "bytes_ratio_vs_ddp",
    "val_loss_gap",
    "val_loss_diloco",
    "val_loss_ddp",
    "diloco_val_loss_by_step",
)


def read_frontier_points(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The points of every file: a sweep's ``frontier.json`` (its ``points``) or a single
    ``crossdc bench equal_tokens --json`` report (one point)."""
    points: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict) and isinstance(data.get("points"), list):
            # What a sweep's points leave out (older sweeps: strategy, lr) is its config's.
            common = _setting(data["config"]) if isinstance(data.get("config"), dict) else {}
            points += [{**common, **point} for point in data["points"]]
        elif isinstance(data, dict) and "val_loss_gap" in data and "config" in data:
            points.append(frontier_point(data))
        else:
            raise ValueError(
                f"{path}: neither a sweep's frontier.json nor a bench equal_tokens --json report"
            )
    if not points:
        raise ValueError("no frontier points in " + ", ".join(map(str, paths)))
    return points


def frontier_points(points: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(gap, ratio) of the points no other point beats on both (a lower gap and a higher ratio),
    by increasing gap."""
    best: list[tuple[float, float]] = []
    for p in sorted(points, key=lambda q: (q["val_loss_gap"], -q["bytes_ratio_vs_ddp"])):
        if not best or p["bytes_ratio_vs_ddp"] > best[-1][1]:
            best.append((p["val_loss_gap"], p["bytes_ratio_vs_ddp"]))
    return best


def setting_label(point: dict[str, Any]) -> str:
    """``H=30 chunktopk:k=64, down sparse, sparseloco``: what a point ran (older sweep points
    name only H and the uplink codec)."""
    label = f"H={point['inner_steps']} {point['codec']}"
    if "strategy" in point:
        label += f", down {point['downlink']}, {point['strategy']}"
    if point.get("outer_lr") is not None:
        label += f" lr {point['outer_lr']:g}"
    return label


def frontier_table(points: Sequence[dict[str, Any]]) -> str:
    """The points as a Markdown table, by setting then seed; ``*`` marks the frontier's."""
    front = set(frontier_points(points))
    rows = [
        "| setting | seed | val loss (DiLoCo / DP) | loss gap | bytes ratio vs DP |",
        "|---|---|---|---|---|",
    ]
    for p in sorted(points, key=lambda q: (setting_label(q), q["seed"])):
        gap, ratio = p["val_loss_gap"], p["bytes_ratio_vs_ddp"]
        mark = " *" if (gap, ratio) in front else ""
        rows.append(
            f"| {setting_label(p)} | {p['seed']} | {p['val_loss_diloco']:.3f} / "
            f"{p['val_loss_ddp']:.3f} | {100 * gap:+.1f}%{mark} | {ratio:,.0f}x |"
        )
    return "\n".join(rows)


def plot_frontier(sources: str | Path | Sequence[str | Path], png_path: str | Path) -> Path:
    """The frontier picture of every point in ``sources`` (see :func:`read_frontier_points`):
    bytes ratio (log) over loss gap (%), a marker per seed."""
    plt = _pyplot()

    paths = [sources] if isinstance(sources, (str, Path)) else list(sources)
    points = read_frontier_points(paths)
    fig, ax = plt.subplots(figsize=(8, 5))
    labelled: set[str] = set()
    for seed, marker in zip(sorted({p["seed"] for p in points}), "os^vD", strict=False):
        mine = [p for p in points if p["seed"] == seed]
        ax.scatter(
            [100 * p["val_loss_gap"] for p in mine],
            [p["bytes_ratio_vs_ddp"] for p in mine],
            marker=marker,
            label=f"seed {seed}",
        )
        for p in mine:
            if setting_label(p) in labelled:
                continue  # one label a setting: its seeds sit side by side
            labelled.add(setting_label(p))
            ax.annotate(
                setting_label(p),
                (100 * p["val_loss_gap"], p["bytes_ratio_vs_ddp"]),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
    front = frontier_points(points)
    ax.step([100 * g for g, _ in front], [r for _, r in front], where="post", color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("validation-loss gap to data parallelism (%)")
    ax.set_ylabel("WAN bytes ratio vs data parallelism")
    ax.set_title("Bytes against loss at equal tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out = Path(png_path)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crossdc plot", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?")
    p.add_argument("--out", default=None, help="where the PNGs go (default: RUN_DIR)")
    p.add_argument(
        "--frontier",
        nargs="+",
        default=None,
        metavar="FILE",
        help="draw these sweep frontier.json files and bench equal_tokens --json reports instead",
    )
    p.add_argument("--table", action="store_true", help="with --frontier: print a Markdown table")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if (args.run_dir is None) == (args.frontier is None):
        print("crossdc plot: give RUN_DIR or --frontier FILE", file=sys.stderr)
        return 2
    try:
        if args.frontier is not None:
            first = Path(args.frontier[0])
            paths = [plot_frontier(args.frontier, Path(args.out or first.parent) / "frontier.png")]
            if args.table:
                print(frontier_table(read_frontier_points(args.frontier)))
        else:
            paths = plot_run(args.run_dir, args.out)
    except (ValueError, OSError, PlotUnavailable) as exc:
        print(f"crossdc plot: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"figures": [str(x) for x in paths]}, indent=1))
    else:
        for path in paths:
            print(path)
    return 0
