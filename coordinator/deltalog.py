"""The recent global deltas, as broadcast, so that a site behind catches up without the model.

A site that rejoins from its checkpoint at version v (a restart, a partition past the heartbeat
timeout) needs θ_v → θ_now. The coordinator keeps the compressed deltas it broadcast (the very
``Global`` messages, signed, with ``evaluate`` off) and the state hash of each version they lead
to; such a site gets the chain of deltas from v, which is smaller than the model as long as the
log holds at most a model's worth of bytes: the log drops its oldest deltas past that bound, and
a site further behind gets the whole model. The log lives in memory: after a coordinator restart
a site behind gets the model once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from comm.wire.schema import Global


class DeltaLog:
    """Broadcast deltas keyed by the version they apply to, at most ``max_bytes`` of payload."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._by_base: dict[int, Global] = {}
        self._order: deque[int] = deque()
        self._hashes: dict[int, str] = {}
        self.nbytes = 0

    @staticmethod
    def _size(msg: Global) -> int:
        return sum(enc.nbytes for enc in msg.payload)

    def start(self, version: int, digest: str) -> None:
        """The model the log's first delta will apply to (θ0, or a resumed state)."""
        self._by_base.clear()
        self._order.clear()
        self._hashes = {version: digest}
        self.nbytes = 0

    def record(self, msg: Global) -> None:
        """A delta just broadcast (from ``base_version`` to ``global_version``)."""
        assert not msg.is_full
        if msg.base_version not in self._hashes:
            # Not a successor of what the log holds (e.g. the first delta after a restart):
            # the chain starts again here; the base's hash is not known, so none starts at it.
            self.start(msg.base_version, "")
        self._by_base[msg.base_version] = replace(msg, evaluate=False)
        self._order.append(msg.base_version)
        self._hashes[msg.global_version] = msg.state_hash
        self.nbytes += self._size(msg)
        while self.nbytes > self.max_bytes and self._order:
            oldest = self._order.popleft()
            dropped = self._by_base.pop(oldest)
            self._hashes.pop(oldest, None)
            self.nbytes -= self._size(dropped)

    def chain(self, version: int, digest: str, target: int) -> list[Global] | None:
        """The deltas from ``version`` (whose state hash must be ``digest``) to ``target``, in
        order; None when the log cannot prove or bridge that gap (then send the model)."""
        if not digest or self._hashes.get(version) != digest or version >= target:
            return None
        out: list[Global] = []
        at = version
        while at != target:
            msg = self._by_base.get(at)
            if msg is None or msg.global_version > target:
                return None
            out.append(msg)
            at = msg.global_version
        return out
