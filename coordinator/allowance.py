"""What each peer may make the coordinator's channel hold at once, in bytes.

The channel charges every byte a peer makes it hold beyond the message at hand to that peer
(``comm.transport.charges``: transfers under way, messages held behind a gap) and asks this
rule how much it may. A connection that has not joined may hold :data:`PRE_JOIN_BYTES`: its
join travels whole (a message of up to a chunk is read, handled and let go, never held), so
nothing it may send before it is a member needs more. A member may hold about twice the
largest message its model makes, the float32 model plus its index (an upload of θ0, an
update in any codec), so one such message can be under way while another waits behind a gap:
``2 x 4 x parameters + MEMBER_SLACK_BYTES``. Before the federation has a model the largest
message is not known, and a member may hold the channel's ``max_transfer_bytes``.

The worst case the channel holds is therefore ``members x member allowance + connections of
sites that have not joined x PRE_JOIN_BYTES``, with a site's connections sharing one account
(see docs/security.md).
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.membership import Membership

PRE_JOIN_BYTES = 64 << 10
"""What a site that has not joined may make the coordinator hold."""
MEMBER_SLACK_BYTES = 4 << 20
"""A member's allowance beyond twice its model in float32: indexes, headers, chunk flags."""


class PeerAllowance:
    """The coordinator's rule for ``RouterChannel(allowance=...)``."""

    def __init__(
        self, *, members: Membership, numel: Callable[[], int | None], unknown_model_bytes: int
    ) -> None:
        """``numel``: the parameters of the federation's model (None: no model yet);
        ``unknown_model_bytes``: a member's allowance before there is a model."""
        self._members = members
        self._numel = numel
        self._unknown_model_bytes = unknown_model_bytes
        self._model_bytes: int | None = None  # a federation's model never changes its shape

    def member_bytes(self) -> int:
        """What a member may hold now."""
        if self._model_bytes is None:
            numel = self._numel()
            if numel is None:
                return self._unknown_model_bytes
            self._model_bytes = 2 * 4 * numel + MEMBER_SLACK_BYTES
        return self._model_bytes

    def __call__(self, peer: bytes) -> int:
        if self._members.holder(peer):
            return self.member_bytes()
        return PRE_JOIN_BYTES
