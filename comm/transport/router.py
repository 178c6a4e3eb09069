"""The coordinator's ROUTER channel: one socket, many sites, each frame's peer identity."""

from __future__ import annotations

import logging
from typing import Any

import zmq

from comm.security.identity import PeerIdentity, peer_address, peer_of
from comm.transport.charges import Allowance
from comm.transport.endpoint import _Endpoint
from comm.transport.profile import _PEER_GONE, ChannelConfig, RejectHook, _apply_profile
from comm.transport.reliable import MUST_ARRIVE
from comm.wire.schema import ErrorCode, Message

log = logging.getLogger(__name__)


class RouterChannel(_Endpoint):
    """The coordinator's listening socket; peers are addressed by their routing id."""

    def __init__(
        self,
        cfg: ChannelConfig,
        *,
        context: zmq.Context[Any] | None = None,
        on_reject: RejectHook | None = None,
        allowance: Allowance | None = None,
    ) -> None:
        """``allowance``: the bytes a peer (by routing id) may make this end hold at once
        (``comm.transport.charges``); None: the transfer config's ``peer_hold_bytes``."""
        ctx = context or zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        _apply_profile(sock, cfg, server=True)
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
        if self.cfg.curve is not None:
            peer = peer_of(frames[1])
            if peer is None:
                self._reject(sender, ErrorCode.UNAUTHENTICATED, "no certified identity")
                return None
            # Routing ids are "<site_id>/<random>": a certified site may not take over
            # another site's routing id (ROUTER_HANDOVER would let it).
            if sender.split(b"/", 1)[0] != peer.site_id.encode():
                self._reject(
                    sender, ErrorCode.UNAUTHENTICATED, f"routing id is not {peer.site_id}'s"
                )
                return None
            self.identities[sender] = peer
        if self._refuse_oversize(sender):
            return None
        msg = self._parse(sender, [f.buffer for f in frames[1:]])
        return None if msg is None else (sender, msg)

    def forget(self, peer: bytes) -> None:
        """Drop a departed peer's transfers, both directions, what was measured about it, and
        its replay state (the routing id names one site process: a restart gets a new one)."""
        self._drop_peer_transfers(peer)
        self.replay.forget(peer)
        self.identities.pop(peer, None)
        self.addresses.pop(peer, None)
        self.links.pop(peer, None)
        self.send_links.pop(peer, None)
