"""The live progress display on a terminal, drawn with rich.

``LiveDisplay`` owns the rich ``Live`` on stderr: it redraws a ``Frame`` (``crossdc.progress_view``)
four times a second, prints lines above it, and while it runs sends what the program writes to
stderr (and to stdout where that is the same terminal) above it too, log handlers included.
``draw`` is one frame: the title and elapsed time, a bar per phase, count and rounds, the latest
validation loss and WAN bytes, and a row per site.

``crossdc.progress`` imports this module only when a display goes live (or to ask whether a
terminal takes one), so a command that parses its arguments or prints plain lines never loads rich.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import IO, Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from crossdc.progress_view import Frame, RoundsView, fmt_bytes, fmt_count, fmt_elapsed, fmt_val_loss


def is_live_terminal(stream: IO[str], environ: Mapping[str, str]) -> bool:
    """Whether rich takes ``stream`` (a tty) for a terminal it can redraw: not a dumb one
    (``TERM=dumb``)."""
    console = Console(file=stream, _environ=dict(environ))
    return console.is_terminal and not console.is_dumb_terminal


class LiveDisplay:
    """A live display of ``frame()`` on ``console`` (default: a console of its own on stderr,
    which also redirects the program's stderr, and stdout on the same terminal, above it)."""

    def __init__(self, frame: Callable[[], Frame], console: Console | None = None) -> None:
        own = console is None
        # Our own console (stderr): what the program prints to stderr, and to stdout where it is
        # the same terminal, goes above the display instead of through it. Never a stdout that
        # leads elsewhere (a file, a pipe): that stays exactly as written.
        self._live = Live(
            console=console or Console(stderr=True),
            get_renderable=lambda: draw(frame()),
            refresh_per_second=4,
            transient=False,
            redirect_stdout=own and _same_terminal(),
            redirect_stderr=own,
        )
        self._log_streams: list[tuple[logging.StreamHandler[Any], Any]] = []
        real_stderr = sys.stderr
        self._live.start()
        if own and sys.stderr is not real_stderr:
            # Log handlers that hold the real stderr write through the redirection too.
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is real_stderr:
                    self._log_streams.append((handler, handler.setStream(sys.stderr)))

    def print(self, line: str) -> None:
        """``line`` as written, above the display."""
        self._live.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        """Give the log handlers their stream back and stop; the last frame stays on screen."""
        for handler, stream in self._log_streams:
            handler.setStream(stream)
        self._log_streams.clear()
        self._live.stop()


def draw(frame: Frame) -> RenderableType:
    """One frame of the display."""
    head = Text.assemble(
        (frame.title, "bold"), "  ", (f"elapsed {fmt_elapsed(frame.elapsed_s)}", "cyan")
    )
    bars = Table.grid(padding=(0, 2))
    if frame.phase is not None:
        label, index, total = frame.phase
        if index is not None and total is not None:
            done = index if frame.phase_done else index - 1
            _bar(bars, f"{label} [{index}/{total}]", done, total, fmt_elapsed(frame.phase_s))
        else:
            _bar(bars, label, 0, None, fmt_elapsed(frame.phase_s))
    if frame.count is not None:
        done, of, unit = frame.count
        _bar(bars, f"{unit} {fmt_count(done, of)}", done, of)
    rows: list[RenderableType] = [head, bars]
    view = frame.view
    if view is not None:
        _bar(
            bars,
            f"rounds {fmt_count(view.done, view.total)}",
            view.done,
            view.total,
            _round_state(view),
        )
        rows.append(Text(f"  {fmt_val_loss(view)}   WAN {fmt_bytes(view.wan_bytes)} so far"))
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
        sent = "-" if s.rounds_sent is None else fmt_count(s.rounds_sent, view.total)
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
