"""The receive budget: which transfers a receiver reassembles at once, and which wait.

Reassembly buffers are whole messages, so the receiver bounds how many it fills at once, over all
senders: at most ``receive_max_transfers`` transfers and ``receive_budget_bytes`` bytes are
*admitted*. A transfer that does not fit *waits*: the chunks its sender
sent on its initial credit are held and acknowledged (so the sender releases them and never sends
them again), no further credit is granted, and the receiver acknowledges it again every half
stall timeout so its sender keeps waiting instead of resending or giving up. When an admitted
transfer finishes (or is dropped or expires), the next waiting one is admitted and its sender
gets a window: the oldest one of a sender that has nothing admitted, else the oldest one, so a
sender with several transfers open does not keep the others' out. What each sender holds is
bounded by its own allowance (``comm.transport.charges``), and an admitted transfer that stops
moving is dropped (``TransferReceiver.expire``), so no sender keeps a place for ever. What the receiver holds is the admitted transfers plus at most the initial credit
per waiting one; nothing is sent twice for waiting.

:class:`ReceiveBudget` is the bookkeeping of that rule: the admitted count and bytes, the bytes
waiting transfers hold, and the queue they wait in. It moves no chunk and answers no sender;
:class:`~comm.transport.receiver.TransferReceiver` does, and tells it every change.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from comm.transport.credit import TransferConfig

TransferKey = tuple[bytes, str]
"""A transfer as a receiver knows it: (sender, transfer id)."""


class ReceiveBudget:
    """Counts what is admitted for reassembly and what waits, and decides who waits."""

    def __init__(self, config: TransferConfig) -> None:
        self._config = config
        self._waiting: OrderedDict[TransferKey, int] = OrderedDict()  # total bytes, by arrival
        self._admitted_by: Counter[bytes] = Counter()  # admitted transfers per sender
        self.admitted = 0
        """Transfers being reassembled."""
        self.admitted_bytes = 0
        """The sizes of the transfers being reassembled (their buffers), summed."""
        self.held_waiting_bytes = 0
        """The chunks waiting transfers hold, summed."""

    @property
    def waiting(self) -> int:
        """Transfers waiting to be admitted."""
        return len(self._waiting)

    @property
    def held_bytes(self) -> int:
        """Admitted bytes plus the chunks waiting transfers hold."""
        return self.admitted_bytes + self.held_waiting_bytes

    def fits(self, total_bytes: int) -> bool:
        """Whether a transfer of ``total_bytes`` can be admitted beside the admitted ones."""
        if not self.admitted:
            return True  # one transfer at a time always moves, however large
        cfg = self._config
        return (
            self.admitted < cfg.receive_max_transfers
            and self.admitted_bytes + total_bytes <= cfg.receive_budget_bytes
        )

    def must_wait(self, total_bytes: int) -> bool:
        """Whether a new transfer of ``total_bytes`` waits instead of being admitted."""
        if total_bytes <= self._config.initial_credit_bytes:
            return False  # sent whole before any acknowledgement: holding it back saves nothing
        return bool(self._waiting) or not self.fits(total_bytes)  # the queue goes first

    def admit(self, key: TransferKey, total_bytes: int) -> None:
        """Count a transfer in as admitted."""
        self.admitted += 1
        self.admitted_bytes += total_bytes
        self._admitted_by[key[0]] += 1

    def enqueue(self, key: TransferKey, total_bytes: int) -> None:
        """Put a transfer at the end of the queue of those waiting."""
        self._waiting[key] = total_bytes

    def hold(self, nbytes: int) -> None:
        """Count a chunk a waiting transfer holds."""
        self.held_waiting_bytes += nbytes

    def unhold(self, nbytes: int) -> None:
        """Count out chunks a waiting transfer held (admitted or dropped)."""
        self.held_waiting_bytes -= nbytes

    def next_admissible(self) -> TransferKey | None:
        """Take the next waiting transfer off the queue if it fits now (None: none does): the
        oldest of a sender with nothing admitted, else the oldest; the caller admits it."""
        if not self._waiting:
            return None
        key = next((k for k in self._waiting if not self._admitted_by[k[0]]), None)
        if key is None:
            key = next(iter(self._waiting))
        if not self.fits(self._waiting[key]):
            return None
        del self._waiting[key]
        return key

    def release_admitted(self, key: TransferKey, total_bytes: int) -> None:
        """Count out an admitted transfer (finished, dropped or expired)."""
        self.admitted -= 1
        self.admitted_bytes -= total_bytes
        self._admitted_by[key[0]] -= 1
        if not self._admitted_by[key[0]]:
            del self._admitted_by[key[0]]

    def release_waiting(self, key: TransferKey, held_nbytes: int) -> None:
        """Take a waiting transfer out of the queue and count out the chunks it held."""
        del self._waiting[key]
        self.unhold(held_nbytes)
