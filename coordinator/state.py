"""Durable coordinator state: the global model, outer-optimizer state and round counter.

``FileStateStore`` writes each global version to its own ``.npz`` (temp file, fsync, rename,
fsync of the directory), appends completed rounds to ``history.jsonl`` and new validation losses
to ``val_losses.jsonl`` (one JSON line each, fsynced), then points ``meta.json`` at all of it the
same way as the ``.npz``; a crash at any instant leaves the previous complete version readable.
``meta.json`` holds counters, how many lines of each log it vouches for and the latest round
(which the coordinator still amends with its broadcast figures after saving it; it moves to
``history.jsonl`` when the next round is saved), so a save writes the same few bytes however
long the run. Log lines beyond those counts (a torn last line, a line appended just before a
crash) are ignored on load and cut off by the next save. The round counter is persisted before a round is announced, so a
restarted coordinator never reuses a round id. ``MemoryStateStore`` is the in-process
implementation of the same seam for tests; ``StateWriter`` runs either on a background thread.

``read_history`` reads a state directory's full round history and validation losses (the
``status.json`` a ``StatusBoard`` writes carries only the last rounds).
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from comm.keys import AuthError, sign_blob, verify_blob
from coordinator.strategy import Arrays

_META = "meta.json"
HISTORY_FILE = "history.jsonl"
"""One JSON line per completed round, in order."""
VAL_LOSSES_FILE = "val_losses.jsonl"
"""One JSON line per validation loss: ``{"global_version": v, "val_loss": x}`` (x null: removed)."""
_FORMAT = 2
"""``meta.json`` layout: 2 keeps history and validation losses in the logs above; without a
``format`` key (the first layout) they sit inside ``meta.json`` and are migrated on load."""
STATUS_HISTORY_TAIL = 20
"""Rounds a ``StatusBoard`` keeps in its status (the rest: ``read_history``)."""


@dataclass(frozen=True)
class GlobalState:
    """Everything a coordinator must not lose."""

    params: Arrays
    """The authoritative global parameters: exactly what in-sync sites hold."""
    momentum: Arrays
    """Outer Nesterov buffer."""
    residual: Arrays
    """Downlink error feedback: exact outer result minus ``params``."""
    global_version: int
    """Id of the round that produced ``params`` (0: initial parameters)."""
    round_counter: int
    """Highest round id ever issued; the next round gets ``round_counter + 1``."""
    model_fingerprint: str
    history: tuple[dict[str, Any], ...] = field(default=())
    """One summary per completed round (JSON-able)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss reported by a site, per global version."""


class StateStore(Protocol):
    def load(self) -> GlobalState | None: ...

    def save(self, state: GlobalState) -> None:
        """Durably store a new global version (and everything else in ``state``).

        ``state.history`` must extend the stored history: the same rounds first, then new
        ones; only the last stored round may have changed (the coordinator amends a round with
        its broadcast figures after saving it). Otherwise ``ValueError`` and nothing is stored.
        """
        ...

    def save_counter(self, state: GlobalState) -> None:
        """Durably store ``round_counter``, ``history`` and ``val_losses`` only (the stored
        global version and its parameters stay)."""
        ...


def _check_extends(stored: Sequence[Any], history: Sequence[Any]) -> None:
    """``history`` extends ``stored`` (checked by the round before the last stored one: O(1))."""
    n = len(stored)
    if len(history) < n or (n >= 2 and history[n - 2] != stored[n - 2]):
        raise ValueError(f"history of {len(history)} rounds does not extend the stored {n} rounds")


class MemoryStateStore:
    """In-process state store (tests)."""

    def __init__(self) -> None:
        self.state: GlobalState | None = None
        self.saves = 0

    def load(self) -> GlobalState | None:
        return copy.deepcopy(self.state)

    def save(self, state: GlobalState) -> None:
        if self.state is not None:
            _check_extends(self.state.history, state.history)
        self.state = copy.deepcopy(state)
        self.saves += 1

    def save_counter(self, state: GlobalState) -> None:
        assert self.state is not None, "save_counter before any save"
        _check_extends(self.state.history, state.history)
        self.state = replace(
            self.state,
            round_counter=state.round_counter,
            history=state.history,
            val_losses=dict(state.val_losses),
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write via ``write(fileobj)`` to a temp file in the same directory, fsync, rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_line(record: Any) -> bytes:
    """One compact JSON line (``json.dumps`` escapes newlines inside strings)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def _read_lines(path: Path, count: int) -> tuple[list[Any], int]:
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


class _JsonLog:
    """An append-only file of JSON lines, of which ``meta.json`` vouches for the first ``count``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0
        self.end = 0
        """Byte offset just past the ``count`` lines: where the next line goes."""
        self.last = b""
        """The last of the ``count`` lines."""

    def read(self, count: int) -> list[Any]:
        records, self.end = _read_lines(self.path, count)
        self.count = count
        self.last = _json_line(records[-1]) if records else b""
        return records

    def append(self, lines: Sequence[bytes]) -> None:
        """Append ``lines`` durably after the vouched-for ones, cutting off anything else."""
        if not lines:
            return
        body = b"".join(line + b"\n" for line in lines)
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != self.end:
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
            _fsync_dir(self.path.parent)
        self.count += len(lines)
        self.end += len(body)
        self.last = lines[-1]

    def rewrite(self, lines: Sequence[bytes]) -> None:
        """Replace the whole file atomically (migration from the first layout)."""
        body = b"".join(line + b"\n" for line in lines)
        atomic_write(self.path, lambda fh: fh.write(body))
        self.count, self.end = len(lines), len(body)
        self.last = lines[-1] if lines else b""


def _val_records(records: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    vals: dict[int, float] = {}
    for rec in records:
        version, loss = int(rec["global_version"]), rec["val_loss"]
        if loss is None:
            vals.pop(version, None)
        else:
            vals[version] = float(loss)
    return vals


def _same_loss(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@dataclass(frozen=True)
class RoundLog:
    """A state directory's full round history and validation losses."""

    history: tuple[dict[str, Any], ...]
    val_losses: dict[int, float]


def _split_history(meta: Mapping[str, Any]) -> tuple[int, list[dict[str, Any]]]:
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
        meta = json.loads((directory / _META).read_text())
    except FileNotFoundError:
        return RoundLog((), {})
    if "format" not in meta:
        vals = {int(k): float(v) for k, v in meta.get("val_losses", {}).items()}
        return RoundLog(tuple(meta.get("history", ())), vals)
    logged, last = _split_history(meta)
    history, _ = _read_lines(directory / HISTORY_FILE, logged)
    val_records, _ = _read_lines(directory / VAL_LOSSES_FILE, int(meta["val_loss_records"]))
    return RoundLog(tuple(history + last), _val_records(val_records))


@dataclass(frozen=True)
class _Base:
    """What ``meta.json`` says about the stored global version."""

    file: str
    global_version: int
    model_fingerprint: str


class FileStateStore:
    """State in a directory: ``global-vNNNNNNNN.npz`` files, the two logs and ``meta.json``.

    Per save it writes the ``.npz``, the new log lines and a ``meta.json`` of constant size:
    nothing it writes grows with the length of the run. Thread-safe (one save at a time).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 2,
        signing_key: Ed25519PrivateKey | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.keep = keep
        self.signing_key = signing_key
        """With a key, every checkpoint is signed and verified before it is loaded."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._history = _JsonLog(self.dir / HISTORY_FILE)
        """All rounds but the latest."""
        self._last_round: dict[str, Any] | None = None
        """The latest round, kept in ``meta.json`` (None: no rounds yet)."""
        self._vals = _JsonLog(self.dir / VAL_LOSSES_FILE)
        self._saved_vals: dict[int, float] = {}
        """The validation losses the log holds (to append only what changed)."""
        self._base: _Base | None = None
        self._opened = False

    def _npz_name(self, version: int) -> str:
        return f"global-v{version:08d}.npz"

    def _open(self) -> tuple[dict[str, Any], tuple[dict[str, Any], ...]] | None:
        """Read ``meta.json`` and the logs it vouches for (migrating the first layout)."""
        meta_path = self.dir / _META
        if not meta_path.exists():
            self._history.read(0)
            self._vals.read(0)
            self._saved_vals, self._base, self._last_round, self._opened = {}, None, None, True
            return None
        meta: dict[str, Any] = json.loads(meta_path.read_text())
        self._base = _Base(
            str(meta["file"]), int(meta["global_version"]), str(meta["model_fingerprint"])
        )
        if "format" not in meta:  # the first layout: history and val_losses inside meta.json
            history = tuple(meta["history"])
            self._saved_vals = {int(k): float(v) for k, v in meta.get("val_losses", {}).items()}
            self._history.rewrite([_json_line(h) for h in history[:-1]])
            self._last_round = history[-1] if history else None
            self._vals.rewrite(
                [
                    _json_line({"global_version": k, "val_loss": v})
                    for k, v in sorted(self._saved_vals.items())
                ]
            )
            self._write_meta(int(meta["round_counter"]))
        else:
            logged, last = _split_history(meta)
            history = tuple(self._history.read(logged) + last)
            self._last_round = last[0] if last else None
            self._saved_vals = _val_records(self._vals.read(int(meta["val_loss_records"])))
        self._opened = True
        return meta, history

    def load(self) -> GlobalState | None:
        with self._lock:
            opened = self._open()
        if opened is None:
            return None
        meta, history = opened
        arrays: dict[str, Arrays] = {"p": {}, "m": {}, "r": {}}
        npz_path = self.dir / meta["file"]
        if self.signing_key is not None:
            sig_path = npz_path.with_name(npz_path.name + ".sig")
            try:
                verify_blob(
                    self.signing_key.public_key(),
                    npz_path.read_bytes(),
                    sig_path.read_bytes() if sig_path.exists() else b"",
                )
            except AuthError as exc:
                raise ValueError(
                    f"checkpoint {npz_path} failed its signature check: {exc}"
                ) from None
        with np.load(npz_path, allow_pickle=False) as npz:
            for key in npz.files:
                kind, name = key.split("/", 1)
                arrays[kind][name] = np.array(npz[key], dtype=np.float32)
        return GlobalState(
            params=arrays["p"],
            momentum=arrays["m"],
            residual=arrays["r"],
            global_version=int(meta["global_version"]),
            round_counter=int(meta["round_counter"]),
            model_fingerprint=str(meta["model_fingerprint"]),
            history=history,
            val_losses=dict(self._saved_vals),
        )

    def _check_history(self, state: GlobalState) -> None:
        """``state.history`` extends the stored rounds (compared by the last logged one: O(1))."""
        n = self._history.count
        stored = n + (self._last_round is not None)
        if len(state.history) < stored or (
            n and _json_line(state.history[n - 1]) != self._history.last
        ):
            raise ValueError(
                f"history of {len(state.history)} rounds does not extend the stored {stored} rounds"
            )

    def _append_logs(self, state: GlobalState) -> None:
        """Log the rounds before the latest and the new validation losses (fsynced)."""
        n = self._history.count
        self._history.append([_json_line(h) for h in state.history[n:-1]])
        self._last_round = state.history[-1] if state.history else None
        saved = self._saved_vals
        changed = {
            k: v
            for k, v in state.val_losses.items()
            if k not in saved or not _same_loss(saved[k], v)
        }
        gone = [k for k in saved if k not in state.val_losses]
        records: list[dict[str, Any]] = [
            {"global_version": k, "val_loss": v} for k, v in sorted(changed.items())
        ]
        records += [{"global_version": k, "val_loss": None} for k in sorted(gone)]
        self._vals.append([_json_line(r) for r in records])
        saved.update(changed)
        for k in gone:
            del saved[k]

    def _write_meta(self, round_counter: int) -> None:
        assert self._base is not None
        meta = {
            "format": _FORMAT,
            "file": self._base.file,
            "global_version": self._base.global_version,
            "round_counter": round_counter,
            "model_fingerprint": self._base.model_fingerprint,
            "history_rounds": self._history.count + (self._last_round is not None),
            "last_round": self._last_round,
            "val_loss_records": self._vals.count,
        }
        body = json.dumps(meta, indent=1, sort_keys=True).encode()
        atomic_write(self.dir / _META, lambda fh: fh.write(body))

    def save(self, state: GlobalState) -> None:
        with self._lock:
            if not self._opened:
                self._open()
            self._check_history(state)
            arrays: dict[str, Any] = {f"p/{k}": v for k, v in state.params.items()}
            arrays.update({f"m/{k}": v for k, v in state.momentum.items()})
            arrays.update({f"r/{k}": v for k, v in state.residual.items()})
            npz_path = self.dir / self._npz_name(state.global_version)
            atomic_write(npz_path, lambda fh: np.savez(fh, **arrays))
            if self.signing_key is not None:
                signature = sign_blob(self.signing_key, npz_path.read_bytes())
                atomic_write(
                    npz_path.with_name(npz_path.name + ".sig"), lambda fh: fh.write(signature)
                )
            self._append_logs(state)
            self._base = _Base(npz_path.name, state.global_version, state.model_fingerprint)
            self._write_meta(state.round_counter)
            kept = sorted(self.dir.glob("global-v*.npz"))
            for old in kept[: max(0, len(kept) - self.keep)]:
                old.unlink()
                old.with_name(old.name + ".sig").unlink(missing_ok=True)

    def save_counter(self, state: GlobalState) -> None:
        with self._lock:
            if not self._opened:
                self._open()
            if self._base is None:
                raise RuntimeError("save_counter before any save")
            self._check_history(state)
            self._append_logs(state)
            self._write_meta(state.round_counter)


class StateWriteError(RuntimeError):
    """A background save failed: its state and everything submitted after it are not durable."""

    def __init__(self, ticket: int, cause: BaseException) -> None:
        super().__init__(f"state save #{ticket} failed: {cause!r}")
        self.ticket = ticket


def _snapshot(state: GlobalState) -> GlobalState:
    """What a background save may read while the caller goes on: the latest round's entry and
    ``val_losses`` copied (the coordinator amends the one and rebuilds the other); the arrays
    and older rounds are shared, so the caller must never change them in place."""
    history = state.history
    if history:
        history = (*history[:-1], dict(history[-1]))
    return replace(state, history=history, val_losses=dict(state.val_losses))


class StateWriter:
    """Runs a ``StateStore``'s saves on a background thread, in the order they were submitted.

    ``submit(state)`` queues ``store.save(state)`` and ``submit_counter(state)`` queues
    ``store.save_counter(state)``; each returns a ticket (1, 2, 3, ...). ``durable(ticket)``
    says, without blocking, whether that save (and so every earlier one) has returned from the
    store; ``wait(ticket)`` blocks until it has. A failed save stops the writer: ``durable``,
    ``wait``, ``submit`` and ``close`` then raise ``StateWriteError`` for it and everything
    after it, which is never attempted. ``close()`` writes everything submitted, then stops.

    A state is snapshotted at submit (``_snapshot``); its arrays are not copied, so they must
    not be changed in place afterwards. A coordinator announces a global version once
    ``durable`` says its save's ticket is, and keeps every save on one writer, since a direct
    store call could overtake the queue.
    """

    def __init__(self, store: StateStore, *, name: str = "state-writer") -> None:
        self.store = store
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, Literal["save", "counter"], GlobalState]] = deque()
        self._submitted = 0
        self._durable = 0
        self._error: StateWriteError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- the caller's side -----------------------------------------------------------------

    def submit(self, state: GlobalState) -> int:
        """Queue ``store.save(state)``; returns its ticket."""
        return self._submit("save", state)

    def submit_counter(self, state: GlobalState) -> int:
        """Queue ``store.save_counter(state)``; returns its ticket."""
        return self._submit("counter", state)

    def _submit(self, kind: Literal["save", "counter"], state: GlobalState) -> int:
        snapshot = _snapshot(state)
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise RuntimeError("StateWriter is closed")
            self._submitted += 1
            self._queue.append((self._submitted, kind, snapshot))
            self._cond.notify_all()
            return self._submitted

    def _check(self, ticket: int) -> bool:
        """Whether ``ticket`` is durable (the lock held); raises if it never will be."""
        if not 0 <= ticket <= self._submitted:
            raise ValueError(f"no such ticket: {ticket} (submitted {self._submitted})")
        if ticket <= self._durable:
            return True
        if self._error is not None:
            raise self._error
        return False

    def durable(self, ticket: int) -> bool:
        """Whether the save with ``ticket`` has returned from the store (ticket 0: always)."""
        with self._cond:
            return self._check(ticket)

    def wait(self, ticket: int, timeout: float | None = None) -> bool:
        """Block until ``ticket`` is durable (True) or ``timeout`` seconds pass (False)."""
        with self._cond:
            self._check(ticket)  # a ticket never issued would never come
            self._cond.wait_for(lambda: self._durable >= ticket or self._error is not None, timeout)
            return self._check(ticket)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until everything submitted so far is durable (True) or ``timeout`` passes."""
        with self._cond:
            last = self._submitted
        return self.wait(last, timeout)

    @property
    def durable_ticket(self) -> int:
        """The highest ticket that is durable (0: none yet)."""
        with self._cond:
            return self._durable

    @property
    def pending(self) -> int:
        """Saves submitted and not yet durable."""
        with self._cond:
            return self._submitted - self._durable

    def close(self, timeout: float | None = None) -> None:
        """Write everything submitted, then stop the thread; raises ``StateWriteError`` if a
        save failed. Further submits raise ``RuntimeError``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._thread.is_alive():
                raise TimeoutError(f"{self.pending} state saves still pending after {timeout}s")

    def __enter__(self) -> StateWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- the writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return  # closed and drained
                ticket, kind, state = self._queue[0]
            try:
                if kind == "save":
                    self.store.save(state)
                else:
                    self.store.save_counter(state)
            except BaseException as exc:  # reported to every waiter and submitter
                error = StateWriteError(ticket, exc)
                error.__cause__ = exc
                with self._cond:
                    self._error = error
                    self._queue.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._queue.popleft()
                self._durable = ticket
                self._cond.notify_all()


def write_endpoint(state_dir: Path, endpoint: str, session_id: str) -> None:
    """``endpoint.json``: where a local coordinator listens, for launchers and sites to read."""
    state_dir.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"endpoint": endpoint, "session_id": session_id}).encode()
    atomic_write(state_dir / "endpoint.json", lambda fh: fh.write(body))


class StatusBoard:
    """A role's latest status: read from other threads (HTTP /status), mirrored to a file.

    ``publish`` replaces the status and, with a path, writes it atomically as JSON, so a local
    launcher can follow a role without a port. A status's ``history`` list is cut to its last
    ``history_tail`` entries, with ``history_count`` its full length (the coordinator's full
    history is in its state directory: ``read_history``); with ``val_losses_tail``, the
    ``val_losses`` mapping (keyed by version or step) keeps its highest keys and gains
    ``val_losses_count``. A caller may pass only the last entries with the counts itself (the
    counts given are kept). So what is published and written stays the same size however long
    the run.
    """

    def __init__(
        self,
        path: Path | None,
        clock: Callable[[], float],
        *,
        history_tail: int | None = STATUS_HISTORY_TAIL,
        val_losses_tail: int | None = None,
    ) -> None:
        self.path = path
        self.clock = clock
        self.history_tail = history_tail
        self.val_losses_tail = val_losses_tail
        self.published_at = float("-inf")
        self._lock = threading.Lock()
        self._status: dict[str, Any] = {}

    def _bounded(self, status: dict[str, Any]) -> dict[str, Any]:
        history = status.get("history")
        if self.history_tail is not None and isinstance(history, list):
            tail = history[max(0, len(history) - self.history_tail) :]
            # A caller that passes only the last rounds says how many there are in all.
            count = status.get("history_count", len(history))
            status = {**status, "history": tail, "history_count": count}
        vals = status.get("val_losses")
        if self.val_losses_tail is not None and isinstance(vals, dict):
            keys = sorted(vals, key=int)
            kept = keys[max(0, len(keys) - self.val_losses_tail) :]
            status = {
                **status,
                "val_losses": {k: vals[k] for k in kept},
                "val_losses_count": status.get("val_losses_count", len(vals)),
            }
        return status

    def publish(self, status: dict[str, Any]) -> None:
        status = self._bounded(status)
        with self._lock:
            self._status = status
        self.published_at = self.clock()
        if self.path is not None:
            body = json.dumps(status, indent=1, sort_keys=True).encode()
            atomic_write(self.path, lambda fh: fh.write(body))

    def get(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._status)
