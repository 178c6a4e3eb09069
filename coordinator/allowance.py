"""What each peer may make the coordinator hold at once, in bytes, and the updates it holds.

The channel charges every byte a peer makes it hold beyond the message at hand to that peer
(``comm.transport.charges``: transfers under way, messages held behind a gap) and asks this
rule how much it may. The coordinator charges the same account with the updates its rounds hold
(:func:`hold_update`): an accepted update is kept as the encoded bytes it came as until its
round's result is taken, or the round lets it go (aborted, retried), and those bytes are the
sender's from its arrival until then. An update that would take its sender past its allowance
is refused, and nothing changes.

A connection that has not joined may hold :data:`PRE_JOIN_BYTES`: its join travels whole (a
message of up to a chunk is read, handled and let go, never held), so nothing it may send before
it is a member needs more. A member may hold its messages in flight, one under way and another
waiting behind a gap, and the updates the rounds hold of it: one per round open at once and one
late update per fragment (a closed round's late updates wait for their fragment's next sync),
each at most the float32 model, so ``(2 + held) x 4 x parameters + MEMBER_SLACK_BYTES`` with
``held = rounds open at once + fragments`` (16 bytes a parameter for the default job). Before
the federation has a model the largest message is not known, and a member may hold the
channel's ``max_transfer_bytes``.

The worst case the channel holds is therefore ``members x member allowance + connections of
sites that have not joined x PRE_JOIN_BYTES``, with a site's connections sharing one account
(see docs/security.md).
"""

from __future__ import annotations

from collections.abc import Callable

from comm.transport.charges import PeerCharges
from coordinator.membership import Membership

PRE_JOIN_BYTES = 64 << 10
"""What a site that has not joined may make the coordinator hold."""
MEMBER_SLACK_BYTES = 4 << 20
"""A member's allowance beyond its messages of the float32 model: indexes, headers, chunk
flags."""


class PeerAllowance:
    """The coordinator's rule for ``RouterChannel(allowance=...)``."""

    def __init__(
        self,
        *,
        members: Membership,
        numel: Callable[[], int | None],
        unknown_model_bytes: int,
        held_updates: int = 2,
    ) -> None:
        """``numel``: the parameters of the federation's model (None: no model yet);
        ``unknown_model_bytes``: a member's allowance before there is a model;
        ``held_updates``: the updates of one member the rounds may hold at once (rounds open at
        once, plus one late update per fragment)."""
        self._members = members
        self._numel = numel
        self._unknown_model_bytes = unknown_model_bytes
        self._messages = 2 + held_updates
        self._model_bytes: int | None = None  # a federation's model never changes its shape

    def member_bytes(self) -> int:
        """What a member may hold now."""
        if self._model_bytes is None:
            numel = self._numel()
            if numel is None:
                return self._unknown_model_bytes
            self._model_bytes = self._messages * 4 * numel + MEMBER_SLACK_BYTES
        return self._model_bytes

    def __call__(self, peer: bytes) -> int:
        if self._members.holder(peer):
            return self.member_bytes()
        return PRE_JOIN_BYTES


class HeldUpdate:
    """An accepted update's encoded bytes, charged to the account of the peer that sent it
    while a round holds them; :meth:`release` gives them back (once: later calls do nothing)."""

    def __init__(self, charges: PeerCharges, account: bytes, nbytes: int) -> None:
        self._charges = charges
        self._account = account
        self.nbytes = nbytes
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._charges.release_account(self._account, self.nbytes)


def hold_update(charges: PeerCharges, peer: bytes, nbytes: int) -> HeldUpdate:
    """Charge an update of ``nbytes`` encoded bytes from ``peer`` to its account for as long as
    a round holds it; WireError (``oversize``) past the peer's allowance, nothing charged."""
    account = charges.charge(peer, nbytes, "an update to hold until its round closes,")
    return HeldUpdate(charges, account, nbytes)
