"""The coordinator's ZAP handler (ZeroMQ RFC 27): which CURVE clients may connect, as whom.

libzmq asks a ZAP handler, over ``inproc://zeromq.zap.01`` in the socket's own context, whether
to accept each CURVE handshake. :class:`ZapHandler` answers from a
:class:`comm.security.registry.CertificateRegistry`: a client key holding a valid, unexpired, unrevoked
certificate is accepted with ``User-Id`` = the certified ``site_id`` and a ``X-Cert-Serial``
property; everything else is refused with a reason, counted and reported through ``on_reject``.
Every frame the ROUTER then receives from that connection carries both, so the coordinator checks
per message that the claimed ``site_id`` is the certified one (:func:`peer_of` and
:meth:`CertificateRegistry.check_peer`, which also cuts a connection whose certificate was
revoked or expired after the handshake).

The decision is the pure function :func:`decide`; the thread only receives, decides and replies.
Logs name keys by fingerprint only.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from comm.security.common import AuthError, key_fingerprint
from comm.security.identity import SERIAL_PROPERTY, USER_ID, PeerIdentity, peer_of

__all__ = [
    "DOMAIN",
    "USER_ID",
    "SERIAL_PROPERTY",
    "PeerIdentity",
    "ZapHandler",
    "ZapReply",
    "decide",
    "peer_of",
]

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
DOMAIN = b"crossdc"
"""The ZAP domain ``comm.transport`` sets on CURVE sockets."""


class Admitted(Protocol):
    """Who a key was admitted as: the ``User-Id`` and ``X-Cert-Serial`` of its connection."""

    @property
    def site_id(self) -> str: ...

    @property
    def serial(self) -> str: ...


class Authorizer(Protocol):
    """What a handler answers from: a
    :class:`~comm.security.registry.CertificateRegistry` for the sites' channel, or one that
    admits a single key (the coordinator's shards, ``coordinator.shard_link``)."""

    def authorize(self, curve_public: bytes, now: float) -> Admitted:
        """Who ``curve_public`` may connect as at ``now``; AuthError when it may not."""
        ...


RejectCallback = Callable[[str, str], None]
"""``on_reject(reason, detail)``: reason is an :data:`comm.security.common.AuthReason` or ``bad_request``."""


@dataclass(frozen=True, kw_only=True)
class ZapReply:
    """What to answer one ZAP request; ``reason`` is None when accepted."""

    request_id: bytes
    status_code: bytes
    status_text: str
    user_id: str = ""
    serial: str = ""
    reason: str | None = None
    detail: str = ""

    def frames(self) -> list[bytes]:
        metadata = _metadata({SERIAL_PROPERTY: self.serial}) if self.serial else b""
        return [
            ZAP_VERSION,
            self.request_id,
            self.status_code,
            self.status_text.encode(),
            self.user_id.encode(),
            metadata,
        ]


def _metadata(props: dict[str, str]) -> bytes:
    """ZMTP property encoding (RFC 23/27): name length (1 byte), name, value length (4), value."""
    out = b""
    for name, value in props.items():
        raw_name, raw_value = name.encode(), value.encode()
        out += bytes([len(raw_name)]) + raw_name + struct.pack(">I", len(raw_value)) + raw_value
    return out


def decide(
    frames: Sequence[bytes], registry: Authorizer, *, now: float, domain: bytes = DOMAIN
) -> ZapReply:
    """Answer one ZAP request (its frames as received on the REP socket)."""
    request_id = frames[1] if len(frames) > 1 else b""

    def refuse(reason: str, detail: str, code: bytes = b"400") -> ZapReply:
        return ZapReply(
            request_id=request_id,
            status_code=code,
            status_text=reason,
            reason=reason,
            detail=detail,
        )

    if len(frames) < 6 or frames[0] != ZAP_VERSION:
        return refuse("bad_request", f"malformed ZAP request ({len(frames)} frames)", b"500")
    _version, _request_id, req_domain, address, _identity, mechanism, *credentials = frames
    peer = address.decode(errors="replace")
    if req_domain != domain:
        return refuse("bad_request", f"peer={peer} wrong ZAP domain {req_domain!r}")
    if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
        return refuse("bad_request", f"peer={peer} mechanism {mechanism!r} is not CURVE")
    key = credentials[0]
    try:
        cert = registry.authorize(key, now)
    except AuthError as exc:
        return refuse(exc.reason, f"peer={peer} key={key_fingerprint(key)}: {exc.detail}")
    return ZapReply(
        request_id=request_id,
        status_code=b"200",
        status_text="OK",
        user_id=cert.site_id,
        serial=cert.serial,
        detail=f"peer={peer} key={key_fingerprint(key)} site={cert.site_id}",
    )


class ZapHandler:
    """A ZAP handler thread for one zmq.Context. Start it before the ROUTER binds; the context
    must be the ROUTER's own (ZAP is inproc), and holds at most one handler.

    ``on_reject(reason, detail)`` runs on the handler thread for every refusal; keep it short.
    ``rejected`` counts refusals by reason, ``accepted`` counts accepted handshakes.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        registry: Authorizer,
        *,
        on_reject: RejectCallback | None = None,
        domain: bytes = DOMAIN,
        clock: Callable[[], float] = time.time,
        poll_interval_s: float = 0.1,
    ) -> None:
        self.context = context
        self.registry = registry
        self.domain = domain
        self.rejected: Counter[str] = Counter()
        self.accepted = 0
        self._on_reject = on_reject
        self._clock = clock
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._socket: zmq.Socket[Any] | None = None

    def start(self) -> None:
        """Bind the ZAP endpoint (now, so no handshake can race it) and start answering."""
        assert self._thread is None, "ZapHandler started twice"
        sock = self.context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            sock.close()
            raise
        self._socket = sock
        # The socket moves to the handler thread here; Thread.start is the memory barrier.
        self._thread = threading.Thread(target=self._run, name="zap-handler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._socket
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(self._poll_ms):
                    continue
                frames = sock.recv_multipart()
                try:
                    reply = decide(frames, self.registry, now=self._clock(), domain=self.domain)
                except Exception as exc:  # a REP socket must answer, or the handshake hangs
                    log.exception("ZAP decision failed")
                    request_id = frames[1] if len(frames) > 1 else b""
                    reply = ZapReply(
                        request_id=request_id,
                        status_code=b"500",
                        status_text="internal",
                        reason="internal",
                        detail=repr(exc),
                    )
                sock.send_multipart(reply.frames())
                self._report(reply)
        finally:
            sock.close(linger=0)

    def _report(self, reply: ZapReply) -> None:
        if reply.reason is None:
            self.accepted += 1
            log.info("ZAP accepted %s", reply.detail)
            return
        self.rejected[reply.reason] += 1
        log.warning("ZAP refused: %s: %s", reply.reason, reply.detail)
        if self._on_reject is not None:
            try:
                self._on_reject(reply.reason, reply.detail)
            except Exception:
                log.exception("on_reject callback failed")

    def close(self) -> None:
        """Stop answering and release the ZAP endpoint; safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 + self._poll_ms / 1000)
            self._thread = None
            self._socket = None

    def __enter__(self) -> ZapHandler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
