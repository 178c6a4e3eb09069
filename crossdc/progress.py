"""Progress of ``crossdc demo`` and the long benchmarks, on stderr.

On a terminal a live display (rich) shows the phase or run of how many, the elapsed time and,
for a federation being followed, the rounds merged of the total, the round in progress, the
latest validation loss, the WAN bytes so far and each site's rounds sent and inner steps. Where
stderr is not a terminal (CI, pipes, a ``--json`` consumer), with ``--no-progress`` or with
``CROSSDC_PROGRESS=0`` the same events are plain lines, one each, flushed as written. Nothing
here writes to stdout: reports stay there alone.

A federation's progress is read from what its roles publish in their state directories: the
coordinator's ``status.json`` and each site's ``status.json`` (``rounds_view``, ``follow``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from crossdc.demo_roles import _read_status

ENV_VAR = "CROSSDC_PROGRESS"
"""``CROSSDC_PROGRESS=0`` (or ``off``, ``false``, ``no``) forces plain lines."""

_OFF_VALUES = ("0", "off", "false", "no")

Mode = Literal["live", "plain", "off"]


def add_progress_argument(p: argparse.ArgumentParser) -> None:
    """``--no-progress``: plain lines on stderr even on a terminal."""
    p.add_argument(
        "--no-progress",
        action="store_true",
        help=f"plain progress lines on stderr, no live display (also {ENV_VAR}=0)",
    )


def pop_no_progress(args: argparse.Namespace) -> bool:
    """``--no-progress`` taken out of ``args`` (reports that copy their arguments stay as
    they were)."""
    return bool(vars(args).pop("no_progress", False))


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


def live_wanted(
    *,
    no_progress: bool = False,
    stream: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Whether a live display goes on ``stream`` (default stderr): not with ``no_progress`` or
    ``CROSSDC_PROGRESS=0``, only on a real terminal, and not on one rich calls dumb
    (``TERM=dumb``)."""
    env = os.environ if environ is None else environ
    if no_progress or env.get(ENV_VAR, "").strip().lower() in _OFF_VALUES:
        return False
    stream = sys.stderr if stream is None else stream
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False
    console = Console(file=stream, _environ=dict(env))
    return console.is_terminal and not console.is_dumb_terminal


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
    status = _read_status(state_dir / "status.json")
    if status is None:
        return None
    sites = {s: _read_status(d / "status.json") for s, d in (site_dirs or {}).items()}
    return rounds_view(status, total=total, sites=sites)


def _fmt_count(done: int, total: int | None) -> str:
    return f"{done}/{total}" if total is not None else str(done)


def _fmt_loss(view: RoundsView) -> str:
    if view.val_loss is None:
        return "val_loss n/a"
    return f"val_loss {view.val_loss:.4f} (model v{view.val_version})"


class Progress:
    """Progress events on stderr: a live display (``mode="live"``), plain lines (``"plain"``)
    or none (``"off"``, for library callers; ``log`` lines are written in every mode). Use as
    a context manager; safe to update from several threads.

    ``round_lines``: in plain mode, a line per merged round (off where something else prints
    the rounds already, as the demo's table on stdout does).
    """

    def __init__(
        self,
        title: str,
        *,
        mode: Mode,
        console: Console | None = None,
        round_lines: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.title = title
        self.mode: Mode = mode
        self.round_lines = round_lines
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._phase: tuple[str, int | None, int | None] | None = None
        self._phase_started = self._started
        self._view: RoundsView | None = None
        self._shown_rounds = 0
        self._count: tuple[int, int | None, str] | None = None
        self._live: Live | None = None
        self._closing = False
        self._console = console
        self._log_streams: list[tuple[logging.StreamHandler[Any], Any]] = []
        if mode == "live":
            self._start_live()

    # ---- lifecycle -------------------------------------------------------------------------

    def _start_live(self) -> None:
        own = self._console is None
        console = self._console or Console(stderr=True)
        # Our own console (stderr): what the program prints to stderr, and to stdout where it is
        # the same terminal, goes above the display instead of through it. Never a stdout that
        # leads elsewhere (a file, a pipe): that stays exactly as written.
        self._live = Live(
            console=console,
            get_renderable=self._render,
            refresh_per_second=4,
            transient=False,
            redirect_stdout=own and _same_terminal(),
            redirect_stderr=own,
        )
        real_stderr = sys.stderr
        self._live.start()
        if own and sys.stderr is not real_stderr:
            # Log handlers that hold the real stderr write through the redirection too.
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is real_stderr:
                    self._log_streams.append((handler, handler.setStream(sys.stderr)))

    def close(self) -> None:
        """Stop the live display (its last frame stays on the terminal)."""
        live, self._live = self._live, None
        if live is None:
            return
        for handler, stream in self._log_streams:
            handler.setStream(stream)
        self._log_streams.clear()
        with self._lock:
            self._closing = True  # the last frame shows the last phase done
        live.stop()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def live(self) -> bool:
        return self._live is not None

    # ---- events ----------------------------------------------------------------------------

    def elapsed(self) -> float:
        return self._clock() - self._started

    def phase(self, label: str, index: int | None = None, total: int | None = None) -> None:
        """A new phase (``index`` of ``total``, from 1): a run, a case, a stage of a bench."""
        if self.mode == "off":
            return
        with self._lock:
            self._phase = (label, index, total)
            self._phase_started = self._clock()
            self._view, self._shown_rounds, self._count = None, 0, None
        if self.mode == "plain":
            where = f"[{index}/{total}] " if index is not None and total is not None else ""
            self.log(f"{self.title}: {where}{label} ({self.elapsed():.0f}s elapsed)")

    def rounds(self, view: RoundsView) -> None:
        """A federation's latest published progress; in plain mode a line per merged round."""
        if self.mode == "off":
            return
        with self._lock:
            self._view = view
            new = view.done > self._shown_rounds
            self._shown_rounds = max(self._shown_rounds, view.done)
        if new and self.mode == "plain" and self.round_lines:
            self.log(
                f"{self.title}: round {_fmt_count(view.done, view.total)} merged, "
                f"{_fmt_loss(view)}, WAN {fmt_bytes(view.wan_bytes)} "
                f"({self.elapsed():.0f}s elapsed)"
            )

    def count(self, done: int, total: int | None, unit: str) -> None:
        """Work done in the current phase (steps, say); shown live only."""
        if self.mode != "live":
            return
        with self._lock:
            self._count = (done, total, unit)

    def log(self, line: str) -> None:
        """A plain line on stderr (above the live display when there is one), in every mode."""
        live = self._live
        if live is not None:
            live.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, file=sys.stderr, flush=True)

    @contextmanager
    def follow(
        self,
        state_dir: Path,
        *,
        total: int | None = None,
        site_dirs: Mapping[str, Path] | None = None,
        every_s: float = 0.5,
    ) -> Iterator[None]:
        """Read a federation's status files every ``every_s`` in a thread while the body runs
        (a coordinator's ``state_dir``; the sites' state directories by site id)."""
        if self.mode == "off":
            yield
            return
        stop = threading.Event()

        def poll() -> None:
            view = read_rounds_view(state_dir, total=total, site_dirs=site_dirs)
            if view is not None:
                self.rounds(view)

        def loop() -> None:
            poll()
            while not stop.wait(every_s):
                poll()

        thread = threading.Thread(target=loop, name="crossdc-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            poll()

    # ---- the live display ------------------------------------------------------------------

    def _render(self) -> RenderableType:
        with self._lock:
            phase, view, count = self._phase, self._view, self._count
            closing = self._closing
            now = self._clock()
            phase_s = now - self._phase_started
        head = Text.assemble(
            (self.title, "bold"), "  ", (f"elapsed {fmt_elapsed(now - self._started)}", "cyan")
        )
        bars = Table.grid(padding=(0, 2))
        if phase is not None:
            label, index, total = phase
            if index is not None and total is not None:
                done = index if closing else index - 1
                _bar(bars, f"{label} [{index}/{total}]", done, total, fmt_elapsed(phase_s))
            else:
                _bar(bars, label, 0, None, fmt_elapsed(phase_s))
        if count is not None:
            done, of, unit = count
            _bar(bars, f"{unit} {_fmt_count(done, of)}", done, of)
        rows: list[RenderableType] = [head, bars]
        if view is not None:
            _bar(
                bars,
                f"rounds {_fmt_count(view.done, view.total)}",
                view.done,
                view.total,
                _round_state(view),
            )
            rows.append(Text(f"  {_fmt_loss(view)}   WAN {fmt_bytes(view.wan_bytes)} so far"))
            if view.sites:
                rows.append(_sites_table(view))
        return Group(*rows)


def _bar(table: Table, label: str, done: float, total: float | None, extra: str = "") -> None:
    """A row: label, a bar of ``done`` of ``total`` (none without a total), and ``extra``."""
    bar: RenderableType = (
        ProgressBar(total=total, completed=min(done, total), width=24) if total else Text("")
    )
    table.add_row(Text(f"  {label}"), bar, Text(extra, no_wrap=True, overflow="ellipsis"))


def _round_state(view: RoundsView) -> str:
    if view.finished:
        return "finished"
    if view.open_rounds:
        return "merging round " + ", ".join(str(r) for r in view.open_rounds)
    if view.total is not None and view.done >= view.total:
        return "finishing"
    return "waiting for sites"


def _sites_table(view: RoundsView) -> Table:
    sites = Table.grid(padding=(0, 2))
    for s in view.sites:
        sent = "-" if s.rounds_sent is None else _fmt_count(s.rounds_sent, view.total)
        steps = "-" if s.inner_steps is None else str(s.inner_steps)
        sites.add_row(
            Text(f"    {s.site_id}"), Text(f"rounds sent {sent}"), Text(f"inner steps {steps}")
        )
    return sites


def _same_terminal() -> bool:
    """Whether stdout and stderr are one and the same terminal."""
    try:
        if not (sys.stdout.isatty() and sys.stderr.isatty()):
            return False
        return os.path.samestat(os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno()))
    except (AttributeError, OSError, ValueError):
        return False


def open_progress(title: str, *, no_progress: bool = False, round_lines: bool = True) -> Progress:
    """A live display on a terminal's stderr, plain lines otherwise (``live_wanted``)."""
    mode: Mode = "live" if live_wanted(no_progress=no_progress) else "plain"
    return Progress(title, mode=mode, round_lines=round_lines)


SILENT = Progress("", mode="off")
"""No progress at all: the default of library functions the benchmarks' mains call."""
