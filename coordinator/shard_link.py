"""The channel between a sharded coordinator's shards: shard 0 listens, every other shard
connects to it.

It is a channel of its own, apart from the sites' (another socket, another ZeroMQ context and
ZAP handler), with the same transport (``comm.transport``: acknowledged delivery, chunking, the
wire schema's ``Shard*`` messages) and CURVE on both ends. Every shard runs with the
federation's coordinator kit, so the shards prove to each other that they hold the coordinator's
secret key: shard 0's ZAP handler admits the coordinator's own public key and nothing else
(:class:`OwnKeyOnly`), so a site's certified key, good on the sites' channel, is refused here.
Without a kit (insecure mode, loopback only) the channel is plain, as the sites' is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import zmq

from comm.security.common import AuthError, curve_raw, key_fingerprint
from comm.security.identity import CurveKeys
from comm.security.rolekits import CoordinatorKit
from comm.security.zap import ZapHandler
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.transport.router import RouterChannel
from comm.wire.schema import Message

log = logging.getLogger("crossdc.coordinator.shards")

SHARD_USER = "coordinator-shard"
"""The identity a shard's connection is admitted as (``User-Id``)."""


@dataclass(frozen=True)
class _Shard:
    site_id: str = SHARD_USER
    serial: str = "coordinator-key"


class OwnKeyOnly:
    """A ZAP authorizer admitting one CURVE key, the coordinator's own: the shards of this
    coordinator, and nothing else (``unknown_key`` for any other key, a site's included)."""

    def __init__(self, public: bytes) -> None:
        self._raw = curve_raw(public)

    def authorize(self, curve_public: bytes, now: float) -> _Shard:
        if curve_raw(curve_public) != self._raw:
            raise AuthError(
                "unknown_key",
                f"key {key_fingerprint(curve_public)} is not the coordinator's: only its shards "
                "may connect here",
            )
        return _Shard()


class ShardServer:
    """Shard 0's end: a ROUTER the other shards connect to, peers named by routing id."""

    def __init__(
        self,
        cfg: ChannelConfig,
        kit: CoordinatorKit | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ctx: zmq.Context[Any] | None = zmq.Context()
        self._zap: ZapHandler | None = None
        if kit is not None:
            self._zap = ZapHandler(self._ctx, OwnKeyOnly(kit.curve.public), on_reject=_refused)
            self._zap.start()
            cfg = replace(cfg, curve=kit.curve)
        self.chan = RouterChannel(cfg, context=self._ctx, clock=clock)

    @property
    def refused(self) -> int:
        """Handshakes refused (a key other than the coordinator's)."""
        return 0 if self._zap is None else sum(self._zap.rejected.values())

    def bind(self, endpoint: str) -> str:
        return self.chan.bind(endpoint)

    def send(self, peer: bytes, msg: Message) -> bool:
        return self.chan.send(peer, msg)

    def recv(self, timeout_s: float) -> tuple[bytes, Message] | None:
        return self.chan.recv(timeout_s)

    def close(self) -> None:
        self.chan.close()
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


class ShardClient:
    """A shard's end of the channel to shard 0 (shards 1 to S-1)."""

    def __init__(self, cfg: ChannelConfig, kit: CoordinatorKit | None, shard: int) -> None:
        self._ctx: zmq.Context[Any] | None = zmq.Context()
        if kit is not None:
            keys = kit.curve
            cfg = replace(
                cfg,
                curve=CurveKeys(public=keys.public, secret=keys.secret, server_public=keys.public),
            )
        # The routing id must begin with the identity the handshake admits (the channel checks
        # it); which shard this is, the hello says.
        self.shard = shard
        self.chan = DealerChannel(cfg, identity=SHARD_USER, context=self._ctx)

    def connect(self, endpoint: str) -> None:
        self.chan.connect(endpoint)

    def send(self, msg: Message) -> None:
        self.chan.send(msg)

    def recv(self, timeout_s: float) -> Message | None:
        return self.chan.recv(timeout_s)

    def close(self) -> None:
        self.chan.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


def _refused(reason: str, detail: str) -> None:
    log.warning("[coordinator shards] handshake refused (%s): %s", reason, detail)
