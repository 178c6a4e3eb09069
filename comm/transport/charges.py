"""What each peer makes an endpoint hold, in bytes, against the allowance its owner gives it.

Every byte a peer can make this end keep beyond the message at hand is charged here, to that
peer: a chunked transfer's reassembly (its size and its chunk flags, charged when its first
chunk opens it and released when it completes or is dropped) and the messages held behind a
gap in its delivery stream (released when the gap fills); its owner may charge what it keeps
of a peer's messages after delivery too (a coordinator: the updates its rounds hold, released
by account, :meth:`PeerCharges.release_account`). A charge that would take a peer past
its allowance is refused (:class:`~comm.wire.frames.WireError`, ``oversize``, naming what was
asked and what the peer holds) and changes nothing.

The allowance is the owner's: a coordinator allows a site that has not joined a few KiB and a
member a few times the largest message its model makes (``coordinator.allowance``); without an
owner's rule every peer may hold ``default_bytes``. Charges are keyed by
:attr:`PeerCharges.key`: the routing id, or, where a channel knows the certified identity
behind it, that identity, so one site's connections share one allowance. A peer that sends
nothing for a while is *quiet*: :meth:`PeerCharges.quiet` names it so its owner frees what it
holds and keeps for it.
"""

from __future__ import annotations

from collections.abc import Callable

from comm.wire.frames import WireError
from comm.wire.schema import ErrorCode

Allowance = Callable[[bytes], int]
"""Bytes a peer (by routing id) may make this endpoint hold at once."""


class PeerCharges:
    """Bytes held per peer, each charge checked against the peer's allowance."""

    def __init__(self, default_bytes: int, allowance: Allowance | None = None) -> None:
        self.default_bytes = default_bytes
        self.allowance: Allowance = allowance or (lambda _peer: default_bytes)
        self.key: Callable[[bytes], bytes] = lambda peer: peer
        """Whose account a routing id's bytes go to (a channel may map it to an identity)."""
        self._held: dict[bytes, int] = {}
        self._heard: dict[bytes, float] = {}
        self.refused = 0
        """Charges refused, over all peers."""
        self.peak_bytes = 0
        """The most bytes held at once, over all peers."""

    def held(self, peer: bytes) -> int:
        """What ``peer``'s account holds now."""
        return self._held.get(self.key(peer), 0)

    @property
    def total(self) -> int:
        """What every peer holds, summed."""
        return sum(self._held.values())

    def room(self, peer: bytes) -> int:
        """Bytes ``peer`` may still make this end hold."""
        return max(0, self.allowance(peer) - self.held(peer))

    def charge(self, peer: bytes, nbytes: int, what: str) -> bytes:
        """Charge ``nbytes`` to ``peer``; refuse (``oversize``) past its allowance. Returns the
        account charged, for :meth:`release_account`."""
        assert nbytes >= 0, nbytes
        account = self.key(peer)
        held = self._held.get(account, 0)
        allowed = self.allowance(peer)
        if held + nbytes > allowed:
            self.refused += 1
            raise WireError(
                ErrorCode.OVERSIZE,
                f"{what} of {nbytes} bytes: the peer holds {held} of the {allowed} it may",
            )
        self._held[account] = held + nbytes
        self.peak_bytes = max(self.peak_bytes, self.total)
        return account

    def release(self, peer: bytes, nbytes: int) -> None:
        """Give back ``nbytes`` charged to ``peer`` before."""
        self.release_account(self.key(peer), nbytes)

    def release_account(self, account: bytes, nbytes: int) -> None:
        """Give back ``nbytes`` charged to ``account`` (what :meth:`charge` returned): for a
        charge that may outlive the routing id's mapping to its account."""
        left = self._held.get(account, 0) - nbytes
        assert left >= 0, f"released more than {account!r} held"
        if left:
            self._held[account] = left
        else:
            self._held.pop(account, None)

    def heard(self, peer: bytes, now: float) -> None:
        """A message (any) came from ``peer``."""
        self._heard[peer] = now

    def quiet(self, now: float, idle_s: float) -> list[bytes]:
        """Routing ids not heard from for ``idle_s``; they are forgotten here (their owner
        drops what it keeps for them, which releases what they hold)."""
        gone = [p for p, at in self._heard.items() if now - at > idle_s]
        for peer in gone:
            del self._heard[peer]
        return gone

    def forget(self, peer: bytes) -> None:
        """``peer``'s routing id is gone; its account keeps what its owner has not released."""
        self._heard.pop(peer, None)
