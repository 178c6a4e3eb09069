"""Who is on the other end of a CURVE socket: its key pair, and the identity ZAP certified.

:class:`CurveKeys` are the Z85 keys a channel endpoint is configured with. Once the coordinator's
ZAP handler (``comm.security.zap``) accepts a connection, every frame received on it carries the
certified site and certificate serial as ZAP metadata (:data:`USER_ID`, :data:`SERIAL_PROPERTY`);
:func:`peer_of` reads them back as a :class:`PeerIdentity`.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

# ZAP metadata a CURVE connection carries once the coordinator's handler accepted it.
USER_ID = "User-Id"
SERIAL_PROPERTY = "X-Cert-Serial"


@dataclass(frozen=True, kw_only=True)
class PeerIdentity:
    """Who sent a frame, as the ZAP handler certified at the connection's handshake."""

    site_id: str
    serial: str


def peer_of(frame: zmq.Frame) -> PeerIdentity | None:
    """The certified identity carried by a frame received with ``copy=False``; None when the
    connection was not authenticated by a ZAP handler (no CURVE, or another handler)."""
    try:
        site_id = frame.get(USER_ID)
        serial = frame.get(SERIAL_PROPERTY)
    except zmq.ZMQError:
        return None
    if not isinstance(site_id, str) or not isinstance(serial, str) or not site_id:
        return None
    return PeerIdentity(site_id=site_id, serial=serial)


def peer_address(frame: zmq.Frame) -> str:
    """The address of the connection a frame received with ``copy=False`` came from (the
    socket's ``Peer-Address`` property), or ``"?"`` where the transport has none."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return "?"
    return address if isinstance(address, str) and address else "?"


@dataclass(frozen=True, kw_only=True)
class CurveKeys:
    """Z85-encoded CURVE keys for one endpoint; ``server_public`` only on a client."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None
