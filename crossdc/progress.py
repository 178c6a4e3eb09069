"""Progress of ``crossdc demo`` and the long benchmarks, on stderr.

On a terminal a live display (rich) shows the phase or run of how many, the elapsed time and,
for a federation being followed, the rounds merged of the total, the round in progress, the
latest validation loss, the WAN bytes so far and each site's rounds sent and inner steps. Where
stderr is not a terminal (CI, pipes, a ``--json`` consumer), with ``--no-progress`` or with
``CROSSDC_PROGRESS=0`` the same events are plain lines, one each, flushed as written. Nothing
here writes to stdout: reports stay there alone.

A federation's progress is read from what its roles publish in their state directories: the
coordinator's ``status.json`` and each site's ``status.json`` (``follow``; the views and formats
are ``crossdc.progress_view``). The live display itself is ``crossdc.progress_live``, imported
only when one starts: choosing a mode, the ``--no-progress`` option and plain lines need no rich.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

from crossdc.progress_view import (
    Count,
    Frame,
    Phase,
    RoundsView,
    fmt_bytes,
    fmt_count,
    fmt_val_loss,
    read_rounds_view,
)

if TYPE_CHECKING:
    from rich.console import Console

    from crossdc.progress_live import LiveDisplay

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
    from crossdc.progress_live import is_live_terminal

    return is_live_terminal(stream, env)


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
        self._phase: Phase | None = None
        self._phase_started = self._started
        self._view: RoundsView | None = None
        self._shown_rounds = 0
        self._count: Count | None = None
        self._live: LiveDisplay | None = None
        self._closing = False
        if mode == "live":
            from crossdc.progress_live import LiveDisplay

            self._live = LiveDisplay(self._frame, console)

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the live display (its last frame stays on the terminal)."""
        live, self._live = self._live, None
        if live is None:
            return
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
                f"{self.title}: round {fmt_count(view.done, view.total)} merged, "
                f"{fmt_val_loss(view)}, WAN {fmt_bytes(view.wan_bytes)} "
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
            live.print(line)
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

    def _frame(self) -> Frame:
        """What the live display shows now."""
        with self._lock:
            now = self._clock()
            return Frame(
                title=self.title,
                elapsed_s=now - self._started,
                phase=self._phase,
                phase_s=now - self._phase_started,
                phase_done=self._closing,
                count=self._count,
                view=self._view,
            )


def open_progress(title: str, *, no_progress: bool = False, round_lines: bool = True) -> Progress:
    """A live display on a terminal's stderr, plain lines otherwise (``live_wanted``)."""
    mode: Mode = "live" if live_wanted(no_progress=no_progress) else "plain"
    return Progress(title, mode=mode, round_lines=round_lines)


SILENT = Progress("", mode="off")
"""No progress at all: the default of library functions the benchmarks' mains call."""
