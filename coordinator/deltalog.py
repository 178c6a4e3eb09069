r"""The recent global deltas, as broadcast, so that a site behind catches up without the model.

A site that rejoins from its checkpoint at version v (a restart, a partition past the heartbeat
timeout) needs θ_v → θ_now. The coordinator keeps the compressed deltas it broadcast (the very
``Global`` messages, signed, with ``evaluate`` off) and the state hash of each version they lead
to; such a site gets the chain of deltas from v, which is smaller than the model as long as the
log holds at most a model's worth of bytes: the log drops its oldest deltas past that bound, and
a site further behind gets the whole model.

With a directory the log is durable and lives on disk only: each delta is one file
(``d-<base>.msg``, its wire frames, written atomically), ``start.json`` names the version and
hash the chain starts from, and the log keeps in memory only each delta's versions, state hash
and size; a catch-up reads its chain back from the files (a file gone, unreadable or not the
delta recorded: no chain, the site gets the model). Without a directory (tests, a coordinator
with no state dir) the deltas are kept in memory. A restarted coordinator
:meth:`DeltaLog.resume`\ s the chain that ends at the version it resumed, so sites that missed
the last broadcasts still catch up by deltas; deltas past that version (a crash between the
broadcast and the checkpoint) are dropped, and a log that does not end at it, or does not
parse, is started again (a warning; those sites get the model once).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import msgpack

from comm.durable import atomic_write
from comm.wire.frames import WireError, from_wire, to_wire
from comm.wire.schema import Global

log = logging.getLogger(__name__)

_START = "start.json"


@dataclass(frozen=True)
class _Entry:
    """One delta as the log indexes it; ``msg`` only in a log without a directory."""

    global_version: int
    nbytes: int
    msg: Global | None = None


class DeltaLog:
    """Broadcast deltas keyed by the version they apply to, at most ``max_bytes`` of payload."""

    def __init__(self, max_bytes: int, directory: str | Path | None = None) -> None:
        self.max_bytes = max_bytes
        self.dir = Path(directory) if directory is not None else None
        self._by_base: dict[int, _Entry] = {}
        self._order: deque[int] = deque()
        self._hashes: dict[int, str] = {}
        self.nbytes = 0
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def _file(self, base: int) -> Path:
        assert self.dir is not None
        return self.dir / f"d-{base:08d}.msg"

    @staticmethod
    def _size(msg: Global) -> int:
        return sum(enc.nbytes for enc in msg.payload)

    def start(self, version: int, digest: str) -> None:
        """The model the log's first delta will apply to (θ0, or a resumed state)."""
        self._by_base.clear()
        self._order.clear()
        self._hashes = {version: digest}
        self.nbytes = 0
        if self.dir is not None:
            body = json.dumps({"version": version, "digest": digest}).encode()
            atomic_write(self.dir / _START, body)
            for path in self.dir.glob("d-*.msg"):
                path.unlink()

    def resume(self, version: int, digest: str) -> None:
        """After a restart at ``version`` (state hash ``digest``): the durable chain that ends
        there, or a new log starting there."""
        if self.dir is None:
            self.start(version, digest)
            return
        try:
            start = json.loads((self.dir / _START).read_bytes())
            if not isinstance(start, dict):
                raise ValueError(f"{_START} is not a JSON object")
            # Each file is read and checked, and only its index entry is kept.
            stored = {path: _Indexed.of(self._read(path)) for path in self.dir.glob("d-*.msg")}
        except FileNotFoundError:
            self.start(version, digest)
            return
        except (OSError, ValueError, WireError) as exc:
            log.warning(
                "[coordinator] delta log in %s unreadable, starting it again: %s", self.dir, exc
            )
            self.start(version, digest)
            return
        msgs = sorted(
            (m for m in stored.values() if m.global_version <= version),
            key=lambda m: m.base_version,
        )
        linked = all(
            a.global_version == b.base_version for a, b in zip(msgs, msgs[1:], strict=False)
        )
        ends = bool(msgs) and msgs[-1].global_version == version and msgs[-1].state_hash == digest
        if not (linked and ends):
            if msgs:
                log.warning(
                    "[coordinator] delta log in %s does not lead to the resumed version %d; "
                    "starting it again",
                    self.dir,
                    version,
                )
            self.start(version, digest)
            return
        for path, msg in stored.items():  # deltas past the resumed version
            if msg.global_version > version:
                path.unlink()
        self._by_base.clear()
        self._order.clear()
        first = msgs[0].base_version
        self._hashes = {first: start["digest"]} if start.get("version") == first else {}
        self.nbytes = 0
        for msg in msgs:
            self._by_base[msg.base_version] = _Entry(msg.global_version, msg.nbytes)
            self._order.append(msg.base_version)
            self._hashes[msg.global_version] = msg.state_hash
            self.nbytes += msg.nbytes
        log.info(
            "[coordinator] resumed the delta log: %d deltas from version %d to %d",
            len(msgs),
            first,
            version,
        )

    @staticmethod
    def _read(path: Path) -> Global:
        frames = msgpack.unpackb(path.read_bytes(), raw=False)
        if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
            raise ValueError(f"{path.name} is not a list of frames")
        msg = from_wire(frames)
        if not isinstance(msg, Global) or msg.is_full or int(path.stem[2:]) != msg.base_version:
            raise ValueError(f"{path.name} does not hold the delta from its version")
        return msg

    def hash_at(self, version: int) -> str:
        """The state hash of ``version`` when a chain can start there, else ``""``."""
        return self._hashes.get(version, "")

    def record(self, msg: Global) -> None:
        """A delta just broadcast (from ``base_version`` to ``global_version``)."""
        assert not msg.is_full
        if msg.base_version not in self._hashes:
            # Not a successor of what the log holds (e.g. the first delta after a restart):
            # the chain starts again here; the base's hash is not known, so none starts at it.
            self.start(msg.base_version, "")
        kept = replace(msg, evaluate=False)
        size = self._size(msg)
        if self.dir is not None:
            frames = [memoryview(f).cast("B") for f in to_wire(kept)]
            atomic_write(self._file(msg.base_version), lambda fh: _pack_frames(fh, frames))
            entry = _Entry(msg.global_version, size)  # on disk only
        else:
            entry = _Entry(msg.global_version, size, kept)
        self._by_base[msg.base_version] = entry
        self._order.append(msg.base_version)
        self._hashes[msg.global_version] = msg.state_hash
        self.nbytes += size
        while self.nbytes > self.max_bytes and self._order:
            oldest = self._order.popleft()
            dropped = self._by_base.pop(oldest)
            self._hashes.pop(oldest, None)
            self.nbytes -= dropped.nbytes
            if self.dir is not None:
                self._file(oldest).unlink(missing_ok=True)

    def chain(self, version: int, digest: str, target: int) -> list[Global] | None:
        """The deltas from ``version`` (whose state hash must be ``digest``) to ``target``, in
        order; None when the log cannot prove or bridge that gap (then send the model)."""
        if not digest or self._hashes.get(version) != digest or version >= target:
            return None
        bases: list[int] = []
        at = version
        while at != target:
            entry = self._by_base.get(at)
            if entry is None or entry.global_version > target:
                return None
            bases.append(at)
            at = entry.global_version
        return self._load(bases)

    def _load(self, bases: list[int]) -> list[Global] | None:
        """The deltas from each of ``bases``: kept ones, or read back from their files (None
        when one cannot be read, or is not the delta the log recorded)."""
        out: list[Global] = []
        for base in bases:
            entry = self._by_base[base]
            if entry.msg is not None:
                out.append(entry.msg)
                continue
            try:
                msg = self._read(self._file(base))
            except (OSError, ValueError, WireError) as exc:
                log.warning("[coordinator] delta from v%d unreadable, no chain: %s", base, exc)
                return None
            recorded = (entry.global_version, entry.nbytes, self._hashes.get(entry.global_version))
            if (msg.global_version, self._size(msg), msg.state_hash) != recorded:
                log.warning("[coordinator] delta from v%d on disk is not the one recorded", base)
                return None
            out.append(msg)
        return out


@dataclass(frozen=True)
class _Indexed:
    """What :meth:`DeltaLog.resume` keeps of a stored delta while it checks the chain."""

    base_version: int
    global_version: int
    state_hash: str
    nbytes: int

    @staticmethod
    def of(msg: Global) -> _Indexed:
        return _Indexed(msg.base_version, msg.global_version, msg.state_hash, DeltaLog._size(msg))


def _pack_frames(fh: IO[bytes], frames: list[memoryview]) -> None:
    """``msgpack.packb`` of the frames as a list of bytes, written piece by piece: the frames
    (the broadcast's encoded tensors among them) are written where they lie, not copied."""
    fh.write(msgpack.Packer().pack_array_header(len(frames)))
    for frame in frames:
        n = frame.nbytes
        if n < 1 << 8:
            fh.write(b"\xc4" + n.to_bytes(1, "big"))  # bin 8
        elif n < 1 << 16:
            fh.write(b"\xc5" + n.to_bytes(2, "big"))  # bin 16
        else:
            fh.write(b"\xc6" + n.to_bytes(4, "big"))  # bin 32
        fh.write(frame)
