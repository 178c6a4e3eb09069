"""What the progress outputs show, as plain data: a federation's progress read from the status
files its roles publish (``RoundsView``, one ``SiteView`` a site), a reporter's state at one
instant (``Frame``), and the text formats every output shares (bytes, elapsed time, validation
metrics).

A role publishes its progress as a JSON file in its state directory: the coordinator's
``status.json`` (rounds completed, the rounds open, validation losses, WAN bytes) and each site's
``status.json`` (rounds sent, inner steps). ``read_status`` reads one; ``rounds_view`` condenses
them. Nothing here draws or prints, and only the standard library is imported, so the commands
that show progress (``crossdc status``, the demo, the benchmarks) share it at no import cost.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def read_status(path: Path) -> dict[str, Any] | None:
    """The JSON object a role published at ``path``; None while it is missing or half-written
    (a reader polls again)."""
    try:
        status: dict[str, Any] = json.loads(path.read_text())
        return status
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class SiteView:
    """One site's published progress."""

    site_id: str
    rounds_sent: int | None = None
    inner_steps: int | None = None


@dataclass(frozen=True)
class RoundsView:
    """A federation's progress as its coordinator (and its sites) last published it."""

    done: int
    total: int | None = None
    open_rounds: tuple[int, ...] = ()
    val_loss: float | None = None
    val_version: int | None = None
    wan_bytes: int = 0
    finished: bool = False
    sites: tuple[SiteView, ...] = ()


def rounds_view(
    status: Mapping[str, Any],
    *,
    total: int | None = None,
    sites: Mapping[str, Mapping[str, Any] | None] | None = None,
) -> RoundsView:
    """The view of a coordinator's ``status.json`` (and the sites' ``status.json`` by site)."""
    vals = {int(k): float(v) for k, v in status.get("val_losses", {}).items() if v is not None}
    version = max(vals) if vals else None
    opened = status.get("open_rounds")
    if opened is None:
        opened = [] if status.get("open_round") is None else [status["open_round"]]
    site_views = tuple(
        SiteView(
            site_id,
            None if st is None else st.get("rounds_sent"),
            None if st is None else st.get("inner_steps"),
        )
        for site_id, st in (sites or {}).items()
    )
    return RoundsView(
        done=int(status.get("rounds_completed", 0)),
        total=total,
        open_rounds=tuple(int(r) for r in opened),
        val_loss=vals[version] if version is not None else None,
        val_version=version,
        wan_bytes=int(status.get("wire_bytes_in", 0)) + int(status.get("wire_bytes_out", 0)),
        finished=bool(status.get("finished", False)),
        sites=site_views,
    )


def read_rounds_view(
    state_dir: Path, *, total: int | None = None, site_dirs: Mapping[str, Path] | None = None
) -> RoundsView | None:
    """``rounds_view`` of the status files in a coordinator's ``state_dir`` and the sites'
    state directories; None while the coordinator has published nothing."""
    status = read_status(state_dir / "status.json")
    if status is None:
        return None
    sites = {s: read_status(d / "status.json") for s, d in (site_dirs or {}).items()}
    return rounds_view(status, total=total, sites=sites)


Phase = tuple[str, int | None, int | None]
"""A reporter's current phase: its label, and its index of how many (from 1) when known."""

Count = tuple[int, int | None, str]
"""Work done in a phase: done, of how many (None: unknown), the unit (``steps``, say)."""


@dataclass(frozen=True)
class Frame:
    """What a live display shows at one instant: the reporter's title, its elapsed seconds, the
    phase and since when, the count of work in it and the federation's progress."""

    title: str
    elapsed_s: float
    phase: Phase | None = None
    phase_s: float = 0.0
    phase_done: bool = False
    """The reporter is closing: the last phase counts as done."""
    count: Count | None = None
    view: RoundsView | None = None


def format_metrics(metrics: dict[str, float]) -> str:
    """A job's other validation metrics as `` name=value`` columns (empty when none)."""
    return "".join(f" {name}={value:.4f}" for name, value in sorted(metrics.items()))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_elapsed(seconds: float) -> str:
    """``H:MM:SS``."""
    s = max(0, int(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def fmt_count(done: int, total: int | None) -> str:
    """``done/total``, or ``done`` alone when the total is unknown."""
    return f"{done}/{total}" if total is not None else str(done)


def fmt_val_loss(view: RoundsView) -> str:
    """The latest validation loss and the model version it is of."""
    if view.val_loss is None:
        return "val_loss n/a"
    return f"val_loss {view.val_loss:.4f} (model v{view.val_version})"
