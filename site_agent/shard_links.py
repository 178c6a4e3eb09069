"""A site's connection to a coordinator of several shards, as one link.

With a coordinator of S shards (``[coordinator] shards = S``) a site holds one channel per shard
and sends each shard its part of every update: the shard that owns a tensor
(``comm.wire.partition.partition`` of the model's names and shapes, the cut every shard makes
too). :class:`ShardedLink` is that set of channels behind the one-link interface the site's
session uses (``site_agent.session.CoordinatorLink``), so the rest of the site is the same
whether its coordinator is one process or S:

- what the site sends: an ``Update`` or ``InitParams`` is cut by tensor, each shard getting its
  tensors (the same round, weight and figures); an ``Eval`` goes to shard 0, which keeps the
  federation's records; everything else (``Join``, ``Leave``, ``SyncRequest``, heartbeats) to
  every shard, each of which admits the site for its tensors;
- what it receives: shard 0's plans (``RoundStart``, ``RoundCancel``, ``Shutdown``) in their
  order with the results (held while a result is in part here: one coordinator sends a result
  before the plan that names its version, on one connection, and the site counts on that; not
  for good: a result whose other parts have not come when shard 0 sends its next round's plan,
  or within ``wait_s``, is dropped, and the site catches up as after any lost result),
  heartbeat echoes as they come, any shard's ``Error``; a ``Welcome`` once every shard has welcomed the
  join (shard 0's); a ``Global`` once every shard's result of that version has arrived, as one
  message: every shard's tensors, and shard 0's state hash (the combined hash over every shard,
  equal to the one-process hash) and signature. Shards that send one version in different
  forms (one a delta, another the whole model: their delta logs reach back differently) get a
  ``SyncRequest`` each, and the whole model from every shard is put together.

A site of one coordinator never builds this (``coordinator_shards`` empty): its link is the
channel itself.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from comm.codecs.base import EncodedTensor
from comm.transport.stats import ChannelStats
from comm.wire.partition import owner_of
from comm.wire.schema import (
    Error,
    Eval,
    Global,
    InitParams,
    Join,
    Message,
    RoundCancel,
    RoundStart,
    Shutdown,
    SyncRequest,
    Update,
    Welcome,
)


class ShardChannel(Protocol):
    """One shard's channel (a ``SiteLink``, or a test's script): what the session's link is."""

    @property
    def stats(self) -> ChannelStats: ...

    def send(self, msg: Message) -> None: ...

    def recv(self, timeout_s: float) -> Message | None: ...

    def close(self) -> None: ...


log = logging.getLogger("crossdc.site")

MAX_PENDING_RESULTS = 4
"""Versions whose results wait for their other shards' parts at once; an older one is dropped
(the site falls behind and catches up as after any lost result)."""

_FROM_LEADER = (RoundStart, RoundCancel, Shutdown)

_ResultKey = tuple[int, int, int, bool]


class ShardedLink:
    """One link per coordinator shard, shard 0 first, behind one interface (module doc)."""

    def __init__(
        self,
        links: Sequence[ShardChannel],
        parts: Sequence[Sequence[str]],
        *,
        wait_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``wait_s``: how long shard 0's plans wait behind a result in part here (``site.
        shard_result_wait_s``)."""
        if len(links) != len(parts) or len(links) < 2:
            raise ValueError(
                f"{len(links)} links for {len(parts)} shards: one link per shard, at least two"
            )
        self.links = tuple(links)
        self.owner = owner_of(parts)
        self._next = 0
        self._welcomed: dict[int, Welcome] = {}
        self._results: dict[_ResultKey, dict[int, Global]] = {}
        self._site_id = ""
        """The site's id, from the join this link forwarded (for a ``SyncRequest`` it sends)."""
        self._held: list[Message] = []
        """Shard 0's plans that came while a result was in part here, in order."""
        self._held_since = 0.0
        """When the first of them came."""
        self._wait_s = wait_s
        self._clock = clock
        self._due: deque[Message] = deque()
        """Messages for the site, in order, before anything received next."""

    @property
    def stats(self) -> ChannelStats:
        """Shard 0's channel's (its round trips and goodput stand for the coordinator's)."""
        return self.links[0].stats

    # ---- sending -------------------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        if isinstance(msg, Update | InitParams):
            for shard, part in enumerate(self._split(msg.payload)):
                self.links[shard].send(replace(msg, payload=part))
            return
        if isinstance(msg, Eval):
            self.links[0].send(msg)
            return
        if isinstance(msg, Join):
            self._welcomed.clear()
            self._site_id = msg.site_id
            # Joining again: every shard sends what the site lacks anew, a result in part here
            # may never complete (its shard restarted), and shard 0's plans wait for none.
            self._results.clear()
            self._release()
        for link in self.links:
            link.send(msg)

    def _split(self, payload: Sequence[EncodedTensor]) -> list[tuple[EncodedTensor, ...]]:
        """``payload`` cut by the shard owning each tensor (a slice of rows goes with its
        tensor); ValueError names a tensor no shard owns."""
        parts: list[list[EncodedTensor]] = [[] for _ in self.links]
        for enc in payload:
            shard = self.owner.get(enc.name)
            if shard is None:
                raise ValueError(f"tensor {enc.name!r} belongs to no shard of the coordinator")
            parts[shard].append(enc)
        return [tuple(p) for p in parts]

    # ---- receiving -----------------------------------------------------------------------------

    def recv(self, timeout_s: float) -> Message | None:
        """The next message for the site, waiting up to ``timeout_s`` over all the shards."""
        # Each shard in turn gets the wait, starting after the one that answered last, so a busy
        # shard does not starve the others.
        if self._held and self._clock() - self._held_since > self._wait_s:
            self._give_up(f"not complete after {self._wait_s:.0f}s")
        if self._due:
            return self._due.popleft()
        count = len(self.links)
        per = timeout_s / count
        for i in range(count):
            shard = (self._next + i) % count
            got = self.links[shard].recv(per)
            if got is None:
                continue
            self._next = (shard + 1) % count
            out = self._take(shard, got)
            if out is not None:
                return out
        return None

    def _take(self, shard: int, msg: Message) -> Message | None:
        if isinstance(msg, Error):
            return msg
        if isinstance(msg, Welcome):
            self._welcomed[shard] = msg
            if len(self._welcomed) < len(self.links):
                return None
            return self._welcomed[0]
        if isinstance(msg, Global):
            return self._result(shard, msg)
        if shard == 0:
            if isinstance(msg, _FROM_LEADER) and (self._held or self._waiting()):
                if not self._held:
                    self._held_since = self._clock()
                self._held.append(msg)  # after the result in part here
                if (
                    isinstance(msg, RoundStart)
                    and sum(isinstance(m, RoundStart) for m in self._held) > 1
                ):
                    # A round went by since the plan held first: the result it waits for has
                    # had its time (its other parts were lost: a shard's announcement given up).
                    self._give_up(f"shard 0 sent round {msg.round_id}'s plan", msg.global_version)
                return None
            return msg
        if not isinstance(msg, _FROM_LEADER):
            return None  # another shard's heartbeat echo: shard 0's measure the link
        log.warning("[site] shard %d sent %s, which only shard 0 sends", shard, type(msg).__name__)
        return None

    def _result(self, shard: int, msg: Global) -> Global | None:
        if msg.part_weights:
            log.warning("[site] shard %d sent a sparse broadcast, which shards never send", shard)
            return None
        key = (msg.round_id, msg.base_version, msg.global_version, msg.is_full)
        other = [k for k in self._results if k[2] == key[2] and k[3] != key[3]]
        if other and self._site_id:
            for k in other:
                del self._results[k]
            self._results.pop(key, None)
            log.warning(
                "[site] shards sent version %d as a delta and as the whole model: asking every "
                "shard for the whole model",
                key[2],
            )
            for link in self.links:
                link.send(SyncRequest(site_id=self._site_id, global_version=-1))
            self._release()
            return None
        parts = self._results.setdefault(key, {})
        parts[shard] = msg
        if len(parts) < len(self.links):
            while len(self._results) > MAX_PENDING_RESULTS:
                oldest = min(self._results, key=lambda k: k[2])
                log.warning("[site] result of version %d never completed: dropped", oldest[2])
                del self._results[oldest]
            self._release()
            return None
        del self._results[key]
        lead = parts[0]
        payload = tuple(enc for s in range(len(self.links)) for enc in parts[s].payload)
        self._release()
        return replace(lead, payload=payload)

    def _waiting(self) -> bool:
        """A result shard 0 sent is in part here (another shard's part to come): shard 0's plans
        after it wait for it. A result of which only other shards' parts came holds nothing:
        shard 0 sends its part before any plan that names its version, or never (it restarted
        before it announced it, and the site catches up)."""
        return any(0 in parts for parts in self._results.values())

    def _give_up(self, why: str, upto: int | None = None) -> None:
        """Drop the results in part here that shard 0 sent its part of (of versions up to
        ``upto``): the plans held behind them are due, and the site catches up (a plan naming a
        version it lacks makes it ask; without one, this link asks every shard)."""
        dropped = [k for k, p in self._results.items() if 0 in p and (upto is None or k[2] <= upto)]
        for key in dropped:
            log.warning("[site] result of version %d never completed (%s): dropped", key[2], why)
            del self._results[key]
        plan = any(isinstance(m, RoundStart) for m in self._held)
        self._release()
        if dropped and not plan and self._site_id:
            base = min(k[1] if not k[3] else -1 for k in dropped)
            for link in self.links:
                link.send(SyncRequest(site_id=self._site_id, global_version=base))

    def _release(self) -> None:
        """Shard 0's held plans are due once no result it sent is in part here."""
        if not self._waiting() and self._held:
            self._due.extend(self._held)
            self._held.clear()

    def close(self) -> None:
        for link in self.links:
            link.close()
