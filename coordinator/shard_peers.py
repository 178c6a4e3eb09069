"""The two ends of a sharded coordinator's control plane, over :mod:`coordinator.shard_link`.

:class:`ShardLeader` is shard 0's: it answers every shard's hello with the version it committed,
keeps each shard's liveness, feeds what the shards report (parts folded, frozen, prepared) to
its :class:`~coordinator.shard_plane.ShardPlane` and hands the plane's answers (close, abort,
commit) to its caller, which sends them to every shard (:meth:`ShardLeader.broadcast`) and
carries them out itself. :class:`ShardFollower` is every other shard's: it says hello every
heartbeat interval, learns from shard 0's answer which version to run
(:func:`~coordinator.shard_plane.resume`), and hands shard 0's decisions (open, freeze, close,
commit, abort) to its caller, which reports back through :meth:`ShardFollower.report`.

Neither decides anything about rounds: the leader's caller is the coordinator's lifecycle, and
the follower's runs what shard 0 decided. A shard whose hello carries another shard count or
another partition of the model is refused (logged, never answered): it runs another config.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from comm.wire.schema import (
    Message,
    ShardAbort,
    ShardClose,
    ShardCommit,
    ShardFolded,
    ShardFreeze,
    ShardFrozen,
    ShardHello,
    ShardInitial,
    ShardInitialDone,
    ShardOpen,
    ShardOpened,
    ShardPrepared,
    ShardState,
)
from coordinator.scheduler import RoundPlan
from coordinator.shard_link import ShardClient, ShardServer
from coordinator.shard_plane import AbortAll, CloseAll, CommitAll, Resume, ShardPlane, resume

log = logging.getLogger("crossdc.coordinator.shards")

Decision = ShardOpen | ShardFreeze | ShardClose | ShardCommit | ShardAbort | ShardInitialDone
"""What shard 0 tells the other shards to do."""


@dataclass(frozen=True)
class Joined:
    """Shard ``shard`` said hello from a new connection (its first, or after a restart: what it
    folded of the rounds in flight is gone, so those rounds cannot close)."""

    shard: int
    first: bool


@dataclass(frozen=True)
class Lost:
    """Shard ``shard`` has not been heard from for the timeout."""

    shard: int


@dataclass(frozen=True)
class Ready:
    """Every shard opened round ``round_id``: shard 0 may send the sites its plan."""

    round_id: int


LeaderEvent = Joined | Lost | Ready | CloseAll | AbortAll | CommitAll | ShardInitial


def plan_fields(plan: RoundPlan) -> dict[str, Any]:
    """A round plan as the plain values ``ShardOpen.plan`` carries."""
    return {
        "num_inner_steps": plan.num_inner_steps,
        "num_fragments": plan.num_fragments,
        "overlap": plan.overlap,
        "uplink": dict(plan.uplink),
        "downlink": plan.downlink,
        "extra_steps": dict(plan.extra_steps),
    }


def plan_of(fields: Mapping[str, Any]) -> RoundPlan:
    """The round plan ``ShardOpen.plan`` carries; ValueError names what is missing or not of
    its kind (shard 0 of another build)."""
    try:
        plan = RoundPlan(
            num_inner_steps=int(fields["num_inner_steps"]),
            num_fragments=int(fields["num_fragments"]),
            overlap=bool(fields["overlap"]),
            uplink={str(k): str(v) for k, v in dict(fields["uplink"]).items()},
            downlink=str(fields["downlink"]),
            extra_steps={str(k): int(v) for k, v in dict(fields["extra_steps"]).items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a round plan from shard 0 that does not read: {exc!r}") from None
    return plan


class ShardLeader:
    """Shard 0's end of the control plane (see the module doc)."""

    def __init__(
        self,
        server: ShardServer,
        plane: ShardPlane,
        *,
        partition: str,
        committed: Callable[[], tuple[int, int]],
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        committed_hash: Callable[[], str] = lambda: "",
        session: str = "",
    ) -> None:
        """``committed``: shard 0's last committed version and its round counter, as the
        answer to each hello says them (with ``committed_hash``, the whole model's hash at that
        version, and ``session``, this process's id); ``timeout_s``: silence after which a
        shard is lost."""
        self.server = server
        self.session = session
        self.plane = plane
        self.partition = partition
        self._committed = committed
        self._committed_hash = committed_hash
        self._timeout_s = timeout_s
        self._clock = clock
        self.peers: dict[int, bytes] = {}
        """Each shard's connection (routing id)."""
        self.heard: dict[int, float] = {}
        self.held: dict[int, int] = {}
        """The version each shard said it holds in its last hello."""
        self._lost: set[int] = set()
        self._polled_at: float | None = None
        """When the last poll ended (a gap since is this process's, not the others')."""
        self._replaced: set[bytes] = set()
        """Connections another connection of the same shard took over from."""
        self.refused_hellos = 0
        """Hellos refused from a connection another one of the same shard took over from."""

    @property
    def present(self) -> bool:
        """Every other shard is connected and heard from within the timeout."""
        return len(self.peers) == self.plane.count - 1 and not self._lost

    def poll(self, timeout_s: float) -> list[LeaderEvent]:
        """Handle at most one message (waiting up to ``timeout_s``), then check liveness."""
        events: list[LeaderEvent] = []
        start = self._clock()
        if self._polled_at is not None and start - self._polled_at > self._timeout_s / 2:
            # This process was busy between two polls (a close over its tensors): what the
            # other shards said meanwhile waits unread, so the silence is not theirs. Each gets
            # half the timeout from now to be read.
            for shard, at in self.heard.items():
                self.heard[shard] = max(at, start - self._timeout_s / 2)
        got = self.server.recv(timeout_s)
        if got is not None:
            events += self._handle(*got)
        now = self._polled_at = self._clock()
        for shard, at in self.heard.items():
            if now - at > self._timeout_s and shard not in self._lost:
                self._lost.add(shard)
                log.warning("[coordinator shards] shard %d silent for %.0fs", shard, now - at)
                events.append(Lost(shard))
        return events

    def broadcast(self, msg: Decision) -> None:
        """Send a decision to every other shard (each holds it until acknowledged)."""
        for peer in self.peers.values():
            self.server.send(peer, msg)

    def abort_in_flight(self, why: str) -> tuple[int, ...]:
        """Abort every round in flight on every shard (one of them left, or came back without
        its folds): the plane's record and a :class:`ShardAbort` to each shard; their ids."""
        ids = self.plane.abort_in_flight(why)
        if ids:
            self.broadcast(ShardAbort(round_ids=ids, reason=why))
        return ids

    def _handle(self, peer: bytes, msg: Message) -> list[LeaderEvent]:
        if isinstance(msg, ShardHello):
            return self._hello(peer, msg)
        shard = next((s for s, p in self.peers.items() if p == peer), None)
        if shard is None:
            log.warning("[coordinator shards] %s before a hello: dropped", type(msg).__name__)
            return []
        self.heard[shard] = self._clock()
        try:
            return self._report(shard, msg)
        except ValueError as exc:  # out of protocol: nothing changed
            log.warning("[coordinator shards] shard %d: %s refused: %s", shard, msg, exc)
            return []

    def _hello(self, peer: bytes, msg: ShardHello) -> list[LeaderEvent]:
        count = self.plane.count
        # A shard that holds no θ0 yet (an upload to come) knows no cut: its partition is "".
        other = msg.partition != self.partition and "" not in (msg.partition, self.partition)
        if msg.shards != count or not 0 < msg.shard < count or other:
            log.error(
                "[coordinator shards] refused a hello from shard %d of %d (partition %s): this "
                "is shard 0 of %d (partition %s); every shard must run the same config",
                msg.shard,
                msg.shards,
                msg.partition,
                count,
                self.partition,
            )
            return []
        if peer in self._replaced:
            # Two processes run as this shard (a config copied with its --shard), or an old
            # connection still speaks: the newer one keeps the shard, this one is never answered
            # (answered, each would take the shard back from the other at every hello and every
            # round in flight would be aborted each time).
            self.refused_hellos += 1
            log.error(
                "[coordinator shards] refused a hello as shard %d from a connection another one "
                "took over from (%d refused): is a second process running as shard %d?",
                msg.shard,
                self.refused_hellos,
                msg.shard,
            )
            return []
        version, counter = self._committed()
        self.server.send(
            peer,
            ShardState(
                global_version=version,
                round_counter=counter,
                sent_at=msg.sent_at,
                state_hash=self._committed_hash(),
                session=self.session,
            ),
        )
        self.heard[msg.shard] = self._clock()
        self.held[msg.shard] = msg.global_version
        self._lost.discard(msg.shard)
        before = self.peers.get(msg.shard)
        if before == peer:
            return []
        self.peers[msg.shard] = peer
        if before is not None:
            self._replaced.add(before)
        log.info(
            "[coordinator shards] shard %d %s",
            msg.shard,
            "joined" if before is None else "joined again",
        )
        return [Joined(msg.shard, before is None)]

    def _report(self, shard: int, msg: Message) -> list[LeaderEvent]:
        plane = self.plane
        if isinstance(msg, ShardOpened):
            if msg.shard != shard:
                raise ValueError(f"it reports for shard {msg.shard}")
            return [Ready(msg.round_id)] if plane.acknowledged(shard, msg.round_id) else []
        if isinstance(msg, ShardFolded):
            if msg.shard != shard:
                raise ValueError(f"it reports for shard {msg.shard}")
            if msg.accepted:
                plane.folded(shard, msg.round_id, msg.site_id, msg.squared_norm)
            else:
                plane.refused(shard, msg.round_id, msg.site_id, msg.detail)
            return []
        if isinstance(msg, ShardFrozen):
            frozen = plane.frozen(shard, msg.round_id, frozenset(msg.folded))
            return [] if frozen is None else [frozen]
        if isinstance(msg, ShardPrepared):
            digests = {name: bytes.fromhex(str(d)) for name, d in msg.digests.items()}
            prepared = plane.prepared(shard, msg.round_id, msg.global_version, digests)
            return [] if prepared is None else [prepared]
        if isinstance(msg, ShardInitial):
            if msg.shard != shard:
                raise ValueError(f"it reports for shard {msg.shard}")
            return [msg]
        raise ValueError(f"{type(msg).__name__} is not for shard 0")


@dataclass(frozen=True)
class Resumed:
    """Shard 0 answered this shard's first hello, or its first since shard 0 started again (a
    new session): run ``resume.version``; nothing shard 0 had in flight before is."""

    resume: Resume
    round_counter: int
    state_hash: str = ""
    """The whole model's hash at ``resume.version`` (empty: shard 0 did not say)."""


@dataclass(frozen=True)
class Heard:
    """Shard 0's answer to a later hello (same shard 0): its last committed version and the
    whole model's hash at it (empty: not known)."""

    version: int
    state_hash: str


FollowerEvent = Resumed | Heard | Decision


class ShardFollower:
    """The end of shards 1 to S-1 (see the module doc)."""

    def __init__(
        self,
        client: ShardClient,
        *,
        shard: int,
        shards: int,
        partition: str,
        held: Callable[[], tuple[int, int]],
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``held``: the version this shard holds and its round counter, for each hello."""
        self.client = client
        self.shard, self.shards, self.partition = shard, shards, partition
        self._held = held
        self._interval_s = interval_s
        self._clock = clock
        self._hello_at: float | None = None
        self.resumed: Resumed | None = None
        """Shard 0's first answer (None until it came), or its first since it started again."""
        self._session = ""
        """The session of shard 0 that ``resumed`` came from."""
        self.heard_at: float | None = None

    def poll(self, timeout_s: float) -> list[FollowerEvent]:
        """Say hello when due, then handle at most one message (waiting up to ``timeout_s``)."""
        now = self._clock()
        if self._hello_at is None or now - self._hello_at >= self._interval_s:
            version, counter = self._held()
            self.client.send(
                ShardHello(
                    shard=self.shard,
                    shards=self.shards,
                    partition=self.partition,
                    global_version=version,
                    round_counter=counter,
                    sent_at=now,
                )
            )
            self._hello_at = now
        msg = self.client.recv(timeout_s)
        if msg is None:
            return []
        self.heard_at = self._clock()
        if isinstance(msg, ShardState):
            if self.resumed is not None and msg.session == self._session:
                return [Heard(msg.global_version, msg.state_hash)]
            if self.resumed is not None:
                log.warning(
                    "[coordinator shard=%d] shard 0 started again (session %s)",
                    self.shard,
                    msg.session,
                )
            self._session = msg.session
            self.resumed = Resumed(
                resume(msg.global_version, self._held()[0]), msg.round_counter, msg.state_hash
            )
            return [self.resumed]
        if isinstance(msg, Decision):
            return [msg]
        log.warning("[coordinator shard=%d] %s is not for me", self.shard, type(msg).__name__)
        return []

    def report(
        self, msg: ShardOpened | ShardFolded | ShardFrozen | ShardPrepared | ShardInitial
    ) -> None:
        self.client.send(msg)
