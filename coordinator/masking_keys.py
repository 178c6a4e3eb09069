"""Secure aggregation's keys: each member's announced session key and its certified CURVE key,
from which each round's masking plan is drawn."""

from __future__ import annotations

from comm.security.masking import Peer
from comm.wire.schema import Join
from coordinator.post import PostOffice


class MaskingKeys:
    """The masking keys of the members that announced one (none without secure aggregation)."""

    def __init__(self, *, enabled: bool, post: PostOffice) -> None:
        self._enabled = enabled
        self._post = post  # the connection's certified identity, and the registry
        self.peers: dict[str, Peer] = {}

    def joined(self, peer: bytes, msg: Join) -> None:
        """A joining site's masking keys: its session key, and its certified CURVE key."""
        announced = msg.capabilities.get("secagg_session_public")
        if not self._enabled or not isinstance(announced, str):
            self.peers.pop(msg.site_id, None)
            return
        static = None
        registry = self._post.registry
        if registry is not None:
            identity = self._post.identity(peer)
            cert = registry.certificate(identity.serial) if identity else None
            static = cert.curve_public if cert is not None else None
        try:
            self.peers[msg.site_id] = Peer(
                session_public=bytes.fromhex(announced), static_public=static
            )
        except ValueError:
            self.peers.pop(msg.site_id, None)

    def forget(self, site_id: str) -> None:
        self.peers.pop(site_id, None)
