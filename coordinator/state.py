"""Durable coordinator state: the global model, outer-optimizer state and round counter.

``FileStateStore`` writes each global version to its own ``.npz`` (temp file, fsync, rename,
fsync of the directory), then points ``meta.json`` at it the same way; a crash at any instant
leaves the previous complete version readable. The round counter is persisted before a round is
announced, so a restarted coordinator never reuses a round id. ``MemoryStateStore`` is the
in-process implementation of the same seam for tests.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from comm.keys import AuthError, sign_blob, verify_blob
from coordinator.strategy import Arrays

_META = "meta.json"


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
        """Durably store a new global version (and everything else in ``state``)."""
        ...

    def save_counter(self, state: GlobalState) -> None:
        """Durably store ``round_counter`` and ``history`` only (parameters unchanged)."""
        ...


class MemoryStateStore:
    """In-process state store (tests)."""

    def __init__(self) -> None:
        self.state: GlobalState | None = None
        self.saves = 0

    def load(self) -> GlobalState | None:
        return copy.deepcopy(self.state)

    def save(self, state: GlobalState) -> None:
        self.state = copy.deepcopy(state)
        self.saves += 1

    def save_counter(self, state: GlobalState) -> None:
        assert self.state is not None, "save_counter before any save"
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


class FileStateStore:
    """State in a directory: ``global-vNNNNNNNN.npz`` files plus ``meta.json``."""

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

    def _npz_name(self, version: int) -> str:
        return f"global-v{version:08d}.npz"

    def load(self) -> GlobalState | None:
        meta_path = self.dir / _META
        if not meta_path.exists():
            return None
        meta = json.loads(meta_path.read_text())
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
            history=tuple(meta["history"]),
            val_losses={int(k): float(v) for k, v in meta.get("val_losses", {}).items()},
        )

    def _write_meta(self, state: GlobalState) -> None:
        meta = {
            "file": self._npz_name(state.global_version),
            "global_version": state.global_version,
            "round_counter": state.round_counter,
            "model_fingerprint": state.model_fingerprint,
            "history": list(state.history),
            "val_losses": {str(k): v for k, v in sorted(state.val_losses.items())},
        }
        body = json.dumps(meta, indent=1, sort_keys=True).encode()
        atomic_write(self.dir / _META, lambda fh: fh.write(body))

    def save(self, state: GlobalState) -> None:
        arrays: dict[str, Any] = {f"p/{k}": v for k, v in state.params.items()}
        arrays.update({f"m/{k}": v for k, v in state.momentum.items()})
        arrays.update({f"r/{k}": v for k, v in state.residual.items()})
        npz_path = self.dir / self._npz_name(state.global_version)
        atomic_write(npz_path, lambda fh: np.savez(fh, **arrays))
        if self.signing_key is not None:
            signature = sign_blob(self.signing_key, npz_path.read_bytes())
            atomic_write(npz_path.with_name(npz_path.name + ".sig"), lambda fh: fh.write(signature))
        self._write_meta(state)
        kept = sorted(self.dir.glob("global-v*.npz"))
        for old in kept[: max(0, len(kept) - self.keep)]:
            old.unlink()
            old.with_name(old.name + ".sig").unlink(missing_ok=True)

    def save_counter(self, state: GlobalState) -> None:
        self._write_meta(state)


def write_endpoint(state_dir: Path, endpoint: str, session_id: str) -> None:
    """``endpoint.json``: where a local coordinator listens, for launchers and sites to read."""
    state_dir.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"endpoint": endpoint, "session_id": session_id}).encode()
    atomic_write(state_dir / "endpoint.json", lambda fh: fh.write(body))


class StatusBoard:
    """A role's latest status: read from other threads (HTTP /status), mirrored to a file.

    ``publish`` replaces the status and, with a path, writes it atomically as JSON, so a local
    launcher can follow a role without a port.
    """

    def __init__(self, path: Path | None, clock: Callable[[], float]) -> None:
        self.path = path
        self.clock = clock
        self.published_at = float("-inf")
        self._lock = threading.Lock()
        self._status: dict[str, Any] = {}

    def publish(self, status: dict[str, Any]) -> None:
        with self._lock:
            self._status = status
        self.published_at = self.clock()
        if self.path is not None:
            body = json.dumps(status, indent=1, sort_keys=True).encode()
            atomic_write(self.path, lambda fh: fh.write(body))

    def get(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._status)
