"""Secure aggregation's keys: each member's announced session key, checked at its join, and its
certificate, from which each round's masking plan is drawn."""

from __future__ import annotations

from comm.security.masking import Peer, check_x25519_public
from comm.wire.schema import Join
from coordinator.post import PostOffice

SESSION_KEY = "secagg_session_public"
"""The join capability that carries a site's session key (64 hex digits)."""


def announced_session_key(msg: Join) -> bytes:
    """The session key a join announces; ValueError naming the site unless it is a 32-byte
    X25519 public key of large order (:func:`check_x25519_public`): the all-zero key or another
    point of small order would make every honest site's key exchange with it fail."""
    announced = msg.capabilities.get(SESSION_KEY)
    where = f"site {msg.site_id!r}: secure aggregation is on and the join's session key"
    if not isinstance(announced, str):
        raise ValueError(f"{where} is missing")
    try:
        public = bytes.fromhex(announced)
        check_x25519_public(public)
    except ValueError as exc:
        raise ValueError(f"{where} is unusable: {exc}") from None
    return public


class MaskingKeys:
    """The masking keys of the members that announced one (none without secure aggregation)."""

    def __init__(self, *, enabled: bool, post: PostOffice) -> None:
        self.enabled = enabled
        self._post = post  # the connection's certified identity, and the registry
        self.peers: dict[str, Peer] = {}

    def check(self, msg: Join) -> None:
        """Refuse (ValueError naming the site) a join whose session key no site could mask
        with; nothing to check without secure aggregation."""
        if self.enabled:
            announced_session_key(msg)

    def joined(self, peer: bytes, msg: Join) -> None:
        """A joining site's masking keys (checked by :meth:`check`): its session key, and the
        certificate its connection authenticated with, which the sites verify themselves."""
        if not self.enabled:
            self.peers.pop(msg.site_id, None)
            return
        certificate = None
        registry = self._post.registry
        if registry is not None:
            identity = self._post.identity(peer)
            cert = registry.certificate(identity.serial) if identity else None
            certificate = cert.to_pem() if cert is not None else None
        self.peers[msg.site_id] = Peer(
            session_public=announced_session_key(msg), certificate=certificate
        )

    def forget(self, site_id: str) -> None:
        self.peers.pop(site_id, None)
