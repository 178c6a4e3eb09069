"""The coordinator's post office: its socket, its authentication, and the durability barrier every
send waits behind.

:class:`PostOffice` binds the ROUTER channel (CURVE and the ZAP handler when the federation has a
key kit), runs the background state writer (:class:`~coordinator.outbox.Outbox`), and sends: a
message goes out now when every save queued so far is durable, otherwise once it is. The channel
delivers what must arrive, sending it again when it is lost or the site was away
(``comm.transport.reliable``); a refusal is an Error to the sender, a counter and a log line.
With a key kit, the channel checks each message's certificate against the registry, and
:meth:`PostOffice.cut_off` checks every connected peer's at least once per heartbeat interval
(the registry rereads the kit every half interval): a revoked or expired peer is cut off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import zmq

from comm.security.identity import PeerIdentity
from comm.security.registry import CertificateRegistry
from comm.security.rolekits import CoordinatorKit
from comm.security.zap import ZapHandler
from comm.transport.charges import Allowance
from comm.transport.faults import WireFaults
from comm.transport.router import CutOff, RouterChannel
from comm.wire.schema import ERROR_MEANINGS, Error, ErrorCode, Global, Message
from coordinator.config import PostConfig
from coordinator.metrics import CoordinatorMetrics
from coordinator.outbox import Outbox
from coordinator.state import GlobalState, StateStore

log = logging.getLogger("crossdc.coordinator")


class PostOffice:
    """``start_writer``, ``bind``, then send; ``close`` flushes what waits and closes."""

    def __init__(
        self,
        cfg: PostConfig,
        store: StateStore,
        metrics: CoordinatorMetrics,
        kit: CoordinatorKit | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = cfg
        self._clock = clock
        self._store = store
        self._metrics = metrics
        self._kit = kit
        self.outbox: Outbox | None = None
        self.chan: RouterChannel | None = None
        self.registry: CertificateRegistry | None = None
        self._zap: ZapHandler | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._seen: dict[str, int] = {}  # the channel's counts, as far as the metrics have them

    # ---- lifecycle -------------------------------------------------------------------------

    def load(self) -> GlobalState | None:
        """The durable state the store holds (None: a new federation)."""
        return self._store.load()

    def roll_back(self, version: int) -> GlobalState:
        """Every queued save made durable, then the store's ``version`` (the one before its
        newest) made the stored state again, and read back (``FileStateStore.roll_back``)."""
        self.drain()
        roll_back = getattr(self._store, "roll_back", None)
        if roll_back is None:
            raise ValueError(f"{type(self._store).__name__} cannot go back a version")
        roll_back(version)
        state = self._store.load()
        if state is None or state.global_version != version:
            raise ValueError(f"the store did not go back to version {version}")
        return state

    def start_writer(self) -> None:
        self.outbox = Outbox(self._store)

    def bind(self, allowance: Allowance | None = None) -> str:
        """Bind the socket (after the ZAP handler, so no handshake races it); the endpoint.
        ``allowance``: what each peer may make the channel hold (``coordinator.allowance``)."""
        self._ctx = zmq.Context()
        channel_cfg = self._cfg.channel
        if self._kit is not None:
            self.registry = CertificateRegistry.from_kit(
                self._kit.kit_dir,
                reload_interval_s=min(1.0, channel_cfg.heartbeat_interval_s / 2),
                on_refuse=self._on_trust_refused,
            )
            self._metrics.watch_certificates(self._trusted_certificates)
            self._metrics.watch_cas(self._trusted_cas)
            self._zap = ZapHandler(self._ctx, self.registry, on_reject=self._on_auth_reject)
            self._zap.start()
            channel_cfg = replace(channel_cfg, curve=self._kit.curve)
        else:
            log.warning(
                "[coordinator] INSECURE MODE: no encryption, no authentication. "
                "For loopback experiments only; never expose this endpoint."
            )
        self.chan = RouterChannel(
            channel_cfg,
            context=self._ctx,
            on_reject=self._on_wire_reject,
            allowance=allowance,
            vet=self._vet if self.registry is not None else None,
            clock=self._clock,
        )
        return self.chan.bind(self._cfg.bind)

    def close_writer(self) -> bool:
        """Write every queued save and run what waited on it; False if there was no writer."""
        if self.outbox is None:
            return False
        self.outbox.close()
        self.outbox = None
        return True

    def close(self, *, finished: bool) -> None:
        if self.chan is not None:
            # Finished: the last results, and the Shutdown queued behind each, go out in full
            # (a site that stops acknowledging is dropped after channel.send_timeout_s without
            # progress), within a round's deadline; otherwise the usual linger.
            self.chan.close(flush_timeout_s=self._cfg.finish_flush_s if finished else None)
            self.chan = None
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        if self._ctx is not None:
            # term() waits (up to the linger) until queued messages, e.g. Shutdown, are sent.
            self._ctx.term()
            self._ctx = None

    # ---- durability before announcement ----------------------------------------------------

    def persist(self, state: GlobalState, counter_only: bool) -> None:
        assert self.outbox is not None, "start_writer() first"
        self.outbox.persist(state, counter_only=counter_only)

    def later(self, action: Callable[[], None]) -> None:
        """Run ``action`` once every save queued so far is durable."""
        assert self.outbox is not None, "start_writer() first"
        self.outbox.later(action)

    @property
    def durable(self) -> bool:
        return self.outbox is None or self.outbox.durable

    def drain(self) -> None:
        """Wait until every save queued so far is durable, and run what waited on them."""
        if self.outbox is not None:
            self.outbox.drain()

    # ---- sending ---------------------------------------------------------------------------

    def send(self, peer: bytes, msg: Message) -> bool:
        """Send now, or after the latest save is durable (then True means queued)."""
        if self.outbox is not None and not self.outbox.settled():
            self.later(lambda: self._send_queued(peer, msg))
            return True
        return self.send_now(peer, msg)

    def _send_queued(self, peer: bytes, msg: Message) -> None:
        self.send_now(peer, msg)

    def models_given_up(self) -> list[bytes]:
        """The peers a model (a ``Global``) was given up to since the last call, over what the
        channel may hold for them: they do not hold it."""
        if self.chan is None:
            return []
        given_up = list(self.chan.given_up)
        self.chan.given_up.clear()
        return [peer for peer, msg in given_up if isinstance(msg, Global)]

    def awaits_model(self, peer: bytes) -> bool:
        """Whether a model (a ``Global``) sent to ``peer`` in chunks is not acknowledged yet."""
        return self.chan is not None and self.chan.unacknowledged_large(peer, Global)

    def send_now(self, peer: bytes, msg: Message) -> bool:
        """Send now: False when ``peer`` is not connected and ``msg`` need not arrive (one that
        must is held by the channel until the peer is back: True)."""
        assert self.chan is not None
        before = self.chan.stats.bytes_sent
        ok = self.chan.send(peer, msg)
        self._metrics.wire_bytes.labels(direction="out").inc(self.chan.stats.bytes_sent - before)
        return ok

    def probe(self, peer: bytes, msg: Message) -> bool:
        """Send ``msg``, small and revealing no state, to ``peer`` now (past the durability
        barrier, ahead of what waits for it): False when the socket has no connection to
        ``peer`` any more (``RouterChannel.notify``)."""
        assert self.chan is not None
        before = self.chan.stats.bytes_sent
        ok = self.chan.notify(peer, msg)
        self._metrics.wire_bytes.labels(direction="out").inc(self.chan.stats.bytes_sent - before)
        return ok

    def reject(
        self, peer: bytes, code: ErrorCode, detail: str, who: str = "?", reason: str = ""
    ) -> None:
        reason = reason or code.name.lower()
        self._metrics.rejected.labels(reason=reason).inc()
        log.warning("[coordinator site=%s] rejected: %s: %s", who, reason, detail)
        self.send(peer, Error(code=int(code), detail=f"{ERROR_MEANINGS[code]}: {detail}"))

    def lose_next(self, peer: bytes, kind: type) -> None:
        """Fault injection: the next message of ``kind`` to ``peer`` is lost after the socket
        accepts it (``comm.transport.faults``)."""
        assert self.chan is not None
        if self.chan.faults is None:
            self.chan.faults = WireFaults()
        self.chan.faults.lose_next(kind, peer=peer)

    def forget(self, peer: bytes) -> None:
        """A peer that left or was removed: its connection's state goes."""
        if self.chan is not None:
            self.chan.forget(peer)

    def cut_off(self) -> list[CutOff]:
        """Check the certificates of the peers connected (at most every half heartbeat
        interval) and return every peer the channel cut off since the last call, for a
        revoked or expired certificate: each one's messages are refused and counted by
        reason, and its connection is shut."""
        if self.chan is None:
            return []
        self.chan.sweep()
        cut = self.chan.take_cut_off()
        for c in cut:
            self._metrics.rejected.labels(reason=c.reason).inc()
        return cut

    def _vet(self, identity: PeerIdentity) -> None:
        """The channel's check of a connection's certified identity (raises AuthError)."""
        assert self.registry is not None
        self.registry.check_peer(
            user_id=identity.site_id,
            serial=identity.serial,
            claimed_site_id=identity.site_id,
            now=time.time(),
        )

    def identity(self, peer: bytes) -> PeerIdentity | None:
        """The certified identity of ``peer``'s connection (CURVE mode)."""
        assert self.chan is not None
        return self.chan.identities.get(peer)

    def describe(self, peer: bytes) -> str:
        """``peer`` for a log line: its routing id, the address its connection comes from and,
        in CURVE mode, the serial of the certificate it authenticated with."""
        assert self.chan is not None
        routing_id = peer.decode("ascii", errors="backslashreplace")
        address = self.chan.addresses.get(peer, "?")
        identity = self.chan.identities.get(peer)
        serial = f" certificate={identity.serial}" if identity is not None else ""
        return f"[peer={routing_id} address={address}{serial}]"

    # ---- what operators see ----------------------------------------------------------------

    def observe_transfers(self) -> None:
        """The channel's figures into the metrics: the receive budget's
        (``comm/transport/receiver.py``) and acknowledged delivery's (``reliable.py``)."""
        if self.chan is None:
            return
        stats, m = self.chan.stats, self._metrics
        m.transfers_waiting.set(stats.transfers_waiting)
        m.reassembly_peak_bytes.set(stats.reassembly_peak_bytes)
        for counter, name in (
            (m.transfers_waited, "transfers_waited"),
            (m.messages_resent, "messages_resent"),
            (m.messages_abandoned, "messages_abandoned"),
            (m.duplicates_dropped, "duplicates_dropped"),
        ):
            value = getattr(stats, name)
            counter.inc(value - self._seen.get(name, 0))
            self._seen[name] = value

    def _trusted_certificates(self) -> list[tuple[str, str, float]]:
        """(site, serial, not_after) of each certificate the registry trusts (HTTP thread)."""
        registry = self.registry
        if registry is None:
            return []
        return [(c.site_id, c.serial, c.not_after) for c in registry.trusted_certificates()]

    def _trusted_cas(self) -> list[tuple[str, float]]:
        """(fingerprint, not_after) of each CA the registry trusts (HTTP thread)."""
        registry = self.registry
        if registry is None:
            return []
        return [(ca.fingerprint, ca.not_after) for ca in registry.trusted_cas()]

    def _on_trust_refused(self, reason: str, detail: str) -> None:
        """Trust material in the kit the registry refused to load (any thread)."""
        self._metrics.trust_refused.labels(reason=reason).inc()

    def _on_wire_reject(self, peer: bytes, code: ErrorCode, detail: str) -> None:
        self._metrics.rejected.labels(reason=code.name.lower()).inc()

    def _on_auth_reject(self, reason: str, detail: str) -> None:
        """A connection refused at the CURVE handshake (ZAP handler thread)."""
        self._metrics.rejected.labels(reason=reason).inc()
