"""The round-history log files of a coordinator state directory, and ``read_history``.

Completed rounds go to ``history.jsonl`` and new validation losses to ``val_losses.jsonl``
(one JSON line each, fsynced); ``meta.json`` (written by ``coordinator.file_store``) holds how
many lines of each log it vouches for and the latest round (which the coordinator still amends
with its broadcast figures after saving it; it moves to ``history.jsonl`` when the next round is
saved). Log lines beyond those counts (a torn last line, a line appended just before a crash)
are ignored on load and cut off by the next save.

``read_history`` reads a state directory's full round history and validation losses (the
``status.json`` a ``StatusBoard`` writes carries only the last rounds).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comm.durable import PRIVATE_MODE, atomic_write, fsync_dir

META_FILE = "meta.json"
HISTORY_FILE = "history.jsonl"
"""One JSON line per completed round, in order."""
VAL_LOSSES_FILE = "val_losses.jsonl"
"""One JSON line per validation loss: ``{"global_version": v, "val_loss": x}`` (x null: removed)."""
META_FORMAT = 2
"""``meta.json`` layout: 2 keeps history and validation losses in the logs above; without a
``format`` key (the first layout) they sit inside ``meta.json`` and are migrated on load."""


def json_line(record: Any) -> bytes:
    """One compact JSON line (``json.dumps`` escapes newlines inside strings)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def read_lines(path: Path, count: int) -> tuple[list[Any], int]:
    """The first ``count`` complete lines of ``path``, decoded, and the byte offset after them.

    Anything after them (a torn last line, lines a crash left ahead of ``meta.json``) is
    ignored; fewer than ``count`` complete lines means the directory is damaged.
    """
    if count == 0:
        return [], 0
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = b""
    records: list[Any] = []
    pos = 0
    for _ in range(count):
        nl = data.find(b"\n", pos)
        if nl < 0:
            raise ValueError(
                f"{path} has {len(records)} complete lines; meta.json vouches for {count}"
            )
        records.append(json.loads(data[pos:nl]))
        pos = nl + 1
    return records, pos


class JsonLog:
    """An append-only file of JSON lines, of which ``meta.json`` vouches for the first ``count``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0
        self.end = 0
        """Byte offset just past the ``count`` lines: where the next line goes."""
        self.last = b""
        """The last of the ``count`` lines."""

    def read(self, count: int) -> list[Any]:
        records, self.end = read_lines(self.path, count)
        self.count = count
        self.last = json_line(records[-1]) if records else b""
        return records

    def append(self, lines: Sequence[bytes]) -> None:
        """Append ``lines`` durably after the vouched-for ones, cutting off anything else."""
        if not lines:
            return
        body = b"".join(line + b"\n" for line in lines)
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, PRIVATE_MODE)
        try:
            st = os.fstat(fd)
            if st.st_mode & 0o777 != PRIVATE_MODE:
                # Private as the state files are, also when an older version created it 0644.
                os.fchmod(fd, PRIVATE_MODE)
            if st.st_size != self.end:
                os.ftruncate(fd, self.end)
            view = memoryview(body)
            offset = self.end
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            fsync_dir(self.path.parent)
        self.count += len(lines)
        self.end += len(body)
        self.last = lines[-1]

    def rewrite(self, lines: Sequence[bytes]) -> None:
        """Replace the whole file atomically (migration from the first layout)."""
        body = b"".join(line + b"\n" for line in lines)
        atomic_write(self.path, body)
        self.count, self.end = len(lines), len(body)
        self.last = lines[-1] if lines else b""


def fold_val_losses(records: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """The validation losses that log ``records`` leave (a null loss removes its version)."""
    vals: dict[int, float] = {}
    for rec in records:
        version, loss = int(rec["global_version"]), rec["val_loss"]
        if loss is None:
            vals.pop(version, None)
        else:
            vals[version] = float(loss)
    return vals


def fold_val_metrics(records: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """The other validation metrics that log ``records`` leave, by version (as the losses)."""
    out: dict[int, dict[str, float]] = {}
    for rec in records:
        version, metrics = int(rec["global_version"]), rec.get("metrics")
        if rec["val_loss"] is None or not metrics:
            out.pop(version, None)
        else:
            out[version] = {str(k): float(v) for k, v in metrics.items()}
    return out


def same_loss(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@dataclass(frozen=True)
class RoundLog:
    """A state directory's full round history and validation losses."""

    history: tuple[dict[str, Any], ...]
    val_losses: dict[int, float]
    val_metrics: dict[int, dict[str, float]] = field(default_factory=dict)


def split_history(meta: Mapping[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """Lines of ``history.jsonl`` that ``meta.json`` vouches for, and the round it holds."""
    rounds = int(meta["history_rounds"])
    return max(0, rounds - 1), [meta["last_round"]] if rounds else []


def read_history(state_dir: str | Path) -> RoundLog:
    """The full history of the coordinator state in ``state_dir`` (empty if there is none).

    Safe to call while a coordinator writes there: it reads only what ``meta.json`` vouches
    for. Reads the first ``meta.json`` layout (history inside) as well.
    """
    directory = Path(state_dir)
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except FileNotFoundError:
        return RoundLog((), {})
    if "format" not in meta:
        vals = {int(k): float(v) for k, v in meta.get("val_losses", {}).items()}
        return RoundLog(tuple(meta.get("history", ())), vals)
    logged, last = split_history(meta)
    history, _ = read_lines(directory / HISTORY_FILE, logged)
    val_records, _ = read_lines(directory / VAL_LOSSES_FILE, int(meta["val_loss_records"]))
    return RoundLog(
        tuple(history + last), fold_val_losses(val_records), fold_val_metrics(val_records)
    )
