"""The coordinator's ROUTER channel: one socket, many sites, each frame's peer identity.

With CURVE, every message's certified identity is checked (``vet``: revoked, expired) before
anything else reads it, and the identities of all peers heard from are checked again by
:meth:`RouterChannel.sweep`, which its owner calls at least every half heartbeat interval. A
peer that fails is cut off: its messages are refused (counted by reason, e.g. ``revoked``), its
state here is forgotten, its TCP connection is shut (``comm.transport.connections``), and the
owner learns of it from :meth:`RouterChannel.take_cut_off` to forget it too.

No ``ROUTER_HANDOVER``: with it, a second connection presenting a routing id in use takes the
peer's pipe from the first one, which stays open and deaf until its heartbeat timeout, so a
stolen key that learns a site's routing id would take that site's connection over, by-passing
the identity-conflict check of a join (``coordinator.conflicts``). Without it, libzmq keeps the
second connection apart and delivers nothing from it; :meth:`RouterChannel.sweep` cuts such a
connection once it has delivered nothing for the heartbeat timeout, so a site that reconnected
before its previous connection was seen to end gets through after (measured on loopback: a
reconnect after a cut arrives within the reconnect interval; one made while the previous
connection was half open got through at the first sweep after that connection's heartbeat
timeout, and never without the sweep).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from comm.security.common import AuthError
from comm.security.identity import PeerIdentity, peer_address, peer_of
from comm.transport.charges import Allowance
from comm.transport.connections import Connections
from comm.transport.endpoint import _Endpoint
from comm.transport.profile import _PEER_GONE, ChannelConfig, RejectHook, _apply_profile
from comm.transport.reliable import MUST_ARRIVE
from comm.wire.schema import ErrorCode, Message

log = logging.getLogger(__name__)

PeerCheck = Callable[[PeerIdentity], None]
"""Whether a certified identity may still talk: raises
:class:`~comm.security.common.AuthError` (``revoked``, ``expired``, ...) when not."""

MAX_CUT_OFF_RECORDS = 4096
"""Cut-off records kept for the owner between two :meth:`RouterChannel.take_cut_off`."""


@dataclass(frozen=True, kw_only=True)
class CutOff:
    """A peer refused for its identity: a message of it, or its connection at a sweep."""

    peer: bytes
    identity: PeerIdentity
    reason: str
    """The :class:`~comm.security.common.AuthError` reason: ``revoked``, ``expired``, ..."""
    detail: str
    cut: bool
    """Whether a live connection of the peer was shut here."""


class RouterChannel(_Endpoint):
    """The coordinator's listening socket; peers are addressed by their routing id."""

    def __init__(
        self,
        cfg: ChannelConfig,
        *,
        context: zmq.Context[Any] | None = None,
        on_reject: RejectHook | None = None,
        allowance: Allowance | None = None,
        vet: PeerCheck | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``allowance``: the bytes a peer (by routing id) may make this end hold at once
        (``comm.transport.charges``); None: the transfer config's ``peer_hold_bytes``.
        ``vet``: checks a certified identity on every message and at every sweep (CURVE);
        ``clock``: the time :meth:`sweep` goes by."""
        ctx = context or zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        _apply_profile(sock, cfg, server=True)
        self._vet = vet
        self._clock = clock
        self._sweep_at = clock()
        self._cut_off: deque[CutOff] = deque(maxlen=MAX_CUT_OFF_RECORDS)
        self.connections = Connections(sock, silent_s=cfg.heartbeat_timeout_s, clock=clock)
        """The TCP connection under each routing id, to cut one off."""
        super().__init__(sock, cfg, on_reject)
        self.identities: dict[bytes, PeerIdentity] = {}
        """The ZAP-certified identity of each sender (CURVE mode only)."""
        self.addresses: dict[bytes, str] = {}
        """The network address each sender's connection comes from, as the socket reports it."""
        if allowance is not None:
            self.charges.allowance = allowance
        self.charges.key = self._account

    def _account(self, peer: bytes) -> bytes:
        """Whose account ``peer``'s bytes go to: its certified site, so that one site's
        connections share one allowance (its routing id where there is no certificate)."""
        identity = self.identities.get(peer)
        return peer if identity is None else b"site:" + identity.site_id.encode()

    def bind(self, endpoint: str) -> str:
        """Bind (``tcp://127.0.0.1:0`` picks a port) and return the endpoint actually bound."""
        if endpoint.endswith(":0"):
            endpoint = endpoint[:-2] + ":*"
        self._sock.bind(endpoint)
        bound = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(bound, bytes)
        return bound.decode()

    def _prefix_for(self, peer: bytes) -> list[bytes]:
        return [peer]

    def send(self, peer: bytes, msg: Message) -> bool:
        """Send to one peer; False when the peer is not connected (never raises for that) and
        ``msg`` is not one that must arrive. One that must arrive (``reliable.MUST_ARRIVE``) is
        held until the peer acknowledges it and goes again once the peer is heard from: True.

        A large message is under way when this returns: its first credit window is queued and
        the rest follows as the peer acknowledges, inside :meth:`recv` and :meth:`flush`.
        Messages sent while one is under way wait behind it (True: the peer was there when that
        one started); they are dropped with it if it makes no progress for ``send_timeout_s``.
        """
        try:
            self._send_frames(peer, msg)
        except zmq.ZMQError as exc:
            if exc.errno in _PEER_GONE:
                held = type(msg) in MUST_ARRIVE
                log.info("peer %r unreachable: %s%s", peer, exc, ", held" if held else "")
                return held
            raise
        return True

    def notify(self, peer: bytes, msg: Message) -> bool:
        """Send a small message at once, ahead of anything queued for ``peer`` (as heartbeats
        go): False when the socket has no connection to ``peer``, which it knows at once, so
        this also asks whether a connection is still open. A peer connected but not draining
        counts as connected (the message is then not sent)."""
        try:
            self._transmit(peer, msg, block=False)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            if exc.errno == zmq.EAGAIN:
                return True
            raise
        return True

    def recv(self, timeout_s: float) -> tuple[bytes, Message] | None:
        """The next complete, valid message and its sender, or None after ``timeout_s``."""
        return self._next(timeout_s)

    def _recv_one(self) -> tuple[bytes, Message] | None:
        frames = self._recv_frames()
        sender = frames[0].bytes
        if len(frames) < 2:
            self._reject(sender, ErrorCode.MALFORMED, "no frames after the routing id")
            return None
        self.addresses[sender] = peer_address(frames[1])
        self.connections.note(sender, frames[1])
        if self.cfg.curve is not None:
            peer = peer_of(frames[1])
            if peer is None:
                self._reject(sender, ErrorCode.UNAUTHENTICATED, "no certified identity")
                return None
            # Routing ids are "<site_id>/<random>": a certified site may not present another
            # site's routing id (once that one's connection ended, what is held for it would
            # go to the impostor).
            if sender.split(b"/", 1)[0] != peer.site_id.encode():
                self._reject(
                    sender, ErrorCode.UNAUTHENTICATED, f"routing id is not {peer.site_id}'s"
                )
                return None
            self.identities[sender] = peer
            if not self._vetted(sender, peer):
                return None
        if self._refuse_oversize(sender):
            return None
        msg = self._parse(sender, [f.buffer for f in frames[1:]])
        return None if msg is None else (sender, msg)

    def unacknowledged_large(self, peer: bytes, kind: type) -> bool:
        """Whether a message of ``kind`` to ``peer`` that travels in chunks (one that must
        arrive) is not acknowledged yet: queued, in transfer, or sent and awaiting the peer's
        word. (One sent whole is as good as delivered: the channel resends it until it is.)"""
        stream = self.out_streams.get(peer)
        if stream is None:
            return False
        big = self.cfg.chunk_bytes
        return any(isinstance(h.msg, kind) and h.nbytes > big for h in stream.held.values())

    def forget(self, peer: bytes) -> None:
        """Drop a departed peer's transfers, both directions, what was measured about it, and
        its replay state (the routing id names one site process: a restart gets a new one)."""
        self._drop_peer_transfers(peer)
        self.replay.forget(peer)
        self.identities.pop(peer, None)
        self.addresses.pop(peer, None)
        self.connections.forget(peer)
        self.links.pop(peer, None)
        self.send_links.pop(peer, None)

    def _drop_quiet(self, peer: bytes) -> None:
        """A routing id not heard from for ``idle_expire_s``: everything kept for it goes (a
        member speaks every heartbeat interval; a site's new connection has a new id)."""
        super()._drop_quiet(peer)
        self.forget(peer)

    # ---- identities checked while connected ------------------------------------------------

    def sweep(self) -> None:
        """Cut off what may no longer talk; call it from the loop, every few tens of
        milliseconds (it notes connections as they open). Every half heartbeat interval (by
        ``clock``): each peer heard from whose identity ``vet`` now refuses, and each connection
        that delivered nothing for the heartbeat timeout."""
        self.connections.events()
        now = self._clock()
        if now < self._sweep_at:
            return
        self._sweep_at = now + self.cfg.heartbeat_interval_s / 2
        self.connections.cut_silent()
        for peer, identity in list(self.identities.items()):
            self._vetted(peer, identity)

    def take_cut_off(self) -> list[CutOff]:
        """The peers cut off since the last call (one record per refusal), for the owner to
        forget them (their state here is gone already)."""
        taken = list(self._cut_off)
        self._cut_off.clear()
        return taken

    def _vetted(self, peer: bytes, identity: PeerIdentity) -> bool:
        """Whether ``identity`` may still talk; if not, ``peer`` is cut off (see the module)."""
        if self._vet is None:
            return True
        try:
            self._vet(identity)
        except AuthError as exc:
            self._cut(peer, identity, exc)
            return False
        return True

    def _cut(self, peer: bytes, identity: PeerIdentity, exc: AuthError) -> None:
        cut = self.connections.cut(peer)
        self.stats.rejected[exc.reason] += 1
        log.warning(
            "[site=%s] cut off %r (%s): %s: %s",
            identity.site_id,
            peer[:48],
            "connection shut" if cut else "no open connection",
            exc.reason,
            exc.detail,
        )
        for waiting in (self._backlog, self._released):  # received, not yet handed over
            kept = [item for item in waiting if item[0] != peer]
            waiting.clear()
            waiting.extend(kept)
        self.forget(peer)
        self._cut_off.append(
            CutOff(peer=peer, identity=identity, reason=exc.reason, detail=exc.detail, cut=cut)
        )

    def close(self, flush_timeout_s: float | None = None) -> None:
        self.connections.close()
        super().close(flush_timeout_s)
