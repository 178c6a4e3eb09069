"""``FileStateStore``: coordinator state in a directory, durable across crashes.

It writes each global version to its own ``.npz`` (temp file, fsync, rename, fsync of the
directory), appends completed rounds and new validation losses to the logs of
``coordinator.history_log``, then points ``meta.json`` at all of it the same way as the ``.npz``;
a crash at any instant leaves the previous complete version readable. ``meta.json`` holds
counters, how many lines of each log it vouches for and the latest round, so a save writes the
same few bytes however long the run.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from comm.durable import atomic_write
from comm.security.common import AuthError
from comm.security.signing import sign_digest, verify_digest
from coordinator.history_log import (
    HISTORY_FILE,
    META_FILE,
    META_FORMAT,
    VAL_LOSSES_FILE,
    JsonLog,
    fold_val_losses,
    fold_val_metrics,
    json_line,
    same_loss,
    split_history,
)
from coordinator.state import GlobalState
from coordinator.strategies.base import Arrays


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
        self._history = JsonLog(self.dir / HISTORY_FILE)
        """All rounds but the latest."""
        self._last_round: dict[str, Any] | None = None
        """The latest round, kept in ``meta.json`` (None: no rounds yet)."""
        self._vals = JsonLog(self.dir / VAL_LOSSES_FILE)
        self._saved_vals: dict[int, float] = {}
        self._saved_metrics: dict[int, dict[str, float]] = {}
        """The validation losses the log holds (to append only what changed)."""
        self._base: _Base | None = None
        self._opened = False

    def _npz_name(self, version: int) -> str:
        return f"global-v{version:08d}.npz"

    def _open(self) -> tuple[dict[str, Any], tuple[dict[str, Any], ...]] | None:
        """Read ``meta.json`` and the logs it vouches for (migrating the first layout)."""
        meta_path = self.dir / META_FILE
        if not meta_path.exists():
            self._history.read(0)
            self._vals.read(0)
            self._saved_vals, self._base, self._last_round, self._opened = {}, None, None, True
            self._saved_metrics = {}
            return None
        meta: dict[str, Any] = json.loads(meta_path.read_text())
        self._base = _Base(
            str(meta["file"]), int(meta["global_version"]), str(meta["model_fingerprint"])
        )
        if "format" not in meta:  # the first layout: history and val_losses inside meta.json
            history = tuple(meta["history"])
            self._saved_vals = {int(k): float(v) for k, v in meta.get("val_losses", {}).items()}
            self._history.rewrite([json_line(h) for h in history[:-1]])
            self._last_round = history[-1] if history else None
            self._vals.rewrite(
                [
                    json_line({"global_version": k, "val_loss": v})
                    for k, v in sorted(self._saved_vals.items())
                ]
            )
            self._write_meta(int(meta["round_counter"]))
        else:
            logged, last = split_history(meta)
            history = tuple(self._history.read(logged) + last)
            self._last_round = last[0] if last else None
            records = self._vals.read(int(meta["val_loss_records"]))
            self._saved_vals = fold_val_losses(records)
            self._saved_metrics = fold_val_metrics(records)
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
                verify_digest(
                    self.signing_key.public_key(),
                    _file_digest(npz_path),
                    sig_path.read_bytes() if sig_path.exists() else b"",
                )
            except AuthError as exc:
                raise ValueError(
                    f"checkpoint {npz_path} failed its signature check: {exc}"
                ) from None
        with np.load(npz_path, allow_pickle=False) as npz:
            for key in npz.files:
                kind, name = key.split("/", 1)
                arrays[kind][name] = np.asarray(npz[key], dtype=np.float32)  # read once
        return GlobalState(
            params=arrays["p"],
            momentum=arrays["m"],
            residual=arrays["r"],
            global_version=int(meta["global_version"]),
            round_counter=int(meta["round_counter"]),
            model_fingerprint=str(meta["model_fingerprint"]),
            history=history,
            val_losses=dict(self._saved_vals),
            val_metrics=dict(self._saved_metrics),
        )

    def _check_history(self, state: GlobalState) -> None:
        """``state.history`` extends the stored rounds (compared by the last logged one: O(1))."""
        n = self._history.count
        stored = n + (self._last_round is not None)
        if len(state.history) < stored or (
            n and json_line(state.history[n - 1]) != self._history.last
        ):
            raise ValueError(
                f"history of {len(state.history)} rounds does not extend the stored {stored} rounds"
            )

    def _append_logs(self, state: GlobalState) -> None:
        """Log the rounds before the latest and the new validation losses (fsynced)."""
        n = self._history.count
        self._history.append([json_line(h) for h in state.history[n:-1]])
        self._last_round = state.history[-1] if state.history else None
        saved = self._saved_vals
        changed = {
            k: v
            for k, v in state.val_losses.items()
            if k not in saved or not same_loss(saved[k], v)
        }
        gone = [k for k in saved if k not in state.val_losses]
        records: list[dict[str, Any]] = [
            {"global_version": k, "val_loss": v}
            | ({"metrics": state.val_metrics[k]} if state.val_metrics.get(k) else {})
            for k, v in sorted(changed.items())
        ]
        records += [{"global_version": k, "val_loss": None} for k in sorted(gone)]
        self._vals.append([json_line(r) for r in records])
        saved.update(changed)
        for k in changed:
            if state.val_metrics.get(k):
                self._saved_metrics[k] = dict(state.val_metrics[k])
        for k in gone:
            del saved[k]
            self._saved_metrics.pop(k, None)

    def _write_meta(self, round_counter: int) -> None:
        assert self._base is not None
        meta = {
            "format": META_FORMAT,
            "file": self._base.file,
            "global_version": self._base.global_version,
            "round_counter": round_counter,
            "model_fingerprint": self._base.model_fingerprint,
            "history_rounds": self._history.count + (self._last_round is not None),
            "last_round": self._last_round,
            "val_loss_records": self._vals.count,
        }
        body = json.dumps(meta, indent=1, sort_keys=True).encode()
        atomic_write(self.dir / META_FILE, body)

    def save(self, state: GlobalState) -> None:
        with self._lock:
            if not self._opened:
                self._open()
            self._check_history(state)
            arrays: dict[str, Any] = {f"p/{k}": v for k, v in state.params.items()}
            arrays.update({f"m/{k}": v for k, v in state.momentum.items()})
            arrays.update({f"r/{k}": v for k, v in state.residual.items()})
            npz_path = self.dir / self._npz_name(state.global_version)
            # Room first: the checkpoints older than the newest keep - 1 go before the new one
            # is written (never the newest: meta.json names it until the new one is in place),
            # so the directory holds at most ``keep`` checkpoints, not keep + 1, at any time.
            self._prune(max(1, self.keep - 1))
            atomic_write(npz_path, lambda fh: np.savez(fh, **arrays))
            if self.signing_key is not None:
                signature = sign_digest(self.signing_key, _file_digest(npz_path))
                atomic_write(
                    npz_path.with_name(npz_path.name + ".sig"), lambda fh: fh.write(signature)
                )
            self._append_logs(state)
            self._base = _Base(npz_path.name, state.global_version, state.model_fingerprint)
            self._write_meta(state.round_counter)
            self._prune(self.keep)

    def _prune(self, keep: int) -> None:
        """Remove every checkpoint but the newest ``keep``."""
        kept = sorted(self.dir.glob("global-v*.npz"))
        for old in kept[: max(0, len(kept) - keep)]:
            old.unlink()
            old.with_name(old.name + ".sig").unlink(missing_ok=True)

    def roll_back(self, version: int) -> None:
        """Make ``version``, the checkpoint kept before the newest, the stored one again: the
        newest version and its round are dropped (a coordinator of several shards saved it and
        the round was never committed); the round counter stays (ids are never reused)."""
        with self._lock:
            opened = self._open()
            if opened is None:
                raise ValueError(f"{self.dir} holds no state to go back from")
            meta, history = opened
            newest = int(meta["global_version"])
            older = self.dir / self._npz_name(version)
            last = history[-1] if history else {}
            if newest <= version or int(last.get("global_version", -1)) != newest:
                raise ValueError(f"{self.dir} holds version {newest}: no round to go back from")
            if not older.exists():
                raise ValueError(f"{self.dir} keeps no checkpoint of version {version}")
            kept = list(history[:-1])
            # meta.json vouches for one logged line less: the next append cuts the rest off.
            self._history.read(max(0, len(kept) - 1))
            self._last_round = kept[-1] if kept else None
            self._base = _Base(older.name, version, str(meta["model_fingerprint"]))
            self._write_meta(int(meta["round_counter"]))
            dropped = self.dir / str(meta["file"])
            dropped.unlink(missing_ok=True)
            dropped.with_name(dropped.name + ".sig").unlink(missing_ok=True)

    def save_counter(self, state: GlobalState) -> None:
        with self._lock:
            if not self._opened:
                self._open()
            if self._base is None:
                raise RuntimeError("save_counter before any save")
            self._check_history(state)
            self._append_logs(state)
            self._write_meta(state.round_counter)


def _file_digest(path: Path) -> bytes:
    """The SHA-256 a checkpoint's signature signs (``comm.security.signing.blob_digest`` of its
    bytes), read piecewise: a save or a load never holds the checkpoint's bytes whole."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").digest()
