"""The receiving side of a chunked transfer: reassembly, duplicates, and the credit it grants.

:class:`TransferReceiver` wraps a :class:`~comm.wire.chunking.Reassembler` and answers every
chunk with a :class:`~comm.wire.schema.ChunkAck` whose credit is ``max(min_window, factor x
bandwidth x RTT)`` from the sender's link estimate, clamped to ``max_window``. It admits
transfers for reassembly within the receive budget (``comm.transport.receive_budget``, which
counts what is admitted and what waits): the chunks of a waiting transfer are held outside the
reassembler, and its sender is acknowledged but granted nothing until it is admitted.

Every open transfer is charged to its sender (``comm.transport.charges``): its size and its
chunk flags, from its first chunk until it completes or is dropped. A first chunk whose transfer
does not fit in what its sender may still hold is refused and opens nothing. An admitted
transfer that moves slower than ``min_progress_bytes_per_s`` over ``progress_window_s`` is
dropped like an idle one, so a sender trickling chunks cannot keep a place for ever.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from comm.transport.charges import PeerCharges
from comm.transport.chunk_checks import check_bounds, check_digest, chunk_stride
from comm.transport.credit import TransferConfig, grant_window_bytes
from comm.transport.linkest import LinkEstimator
from comm.transport.receive_budget import ReceiveBudget, TransferKey
from comm.wire.chunking import Reassembler
from comm.wire.frames import WireError
from comm.wire.schema import Chunk, ChunkAck, ErrorCode

# --------------------------------------------------------------------------------------------
# The receiver


@dataclass
class _Incoming:
    num_chunks: int
    total_bytes: int
    stride: int
    edge: int
    started_at: float
    received: bytearray  # one flag per chunk
    last_at: float = 0.0  # when its latest new chunk arrived (or it was admitted)
    progressed_bytes: int = 0
    """New bytes received since ``started_at`` (its opening, or its admission after waiting)."""
    next_index: int = 0
    waiting: bool = False
    """Not admitted yet: its chunks are held in ``parked``, not in a reassembly buffer."""
    parked: list[Chunk] = field(default_factory=list)
    link: LinkEstimator | None = None
    """The sender's link estimator, which sizes the window it is granted on admission."""
    acked_at: float = 0.0
    """When it was last acknowledged (a chunk's answer, a grant or a keepalive)."""
    grant_unanswered: bool = False
    """Admitted after waiting, and no chunk came since: the grant may have been lost."""


@dataclass(frozen=True, kw_only=True)
class Received:
    """What one chunk did: the acknowledgement to send back, and the message if it completed."""

    ack: ChunkAck
    frames: list[memoryview] | None
    """The complete message's frames (views into one buffer), once its last chunk arrived."""
    duplicate: bool
    """The chunk was already held (a resend after a reconnect); it changed nothing."""
    waiting: bool = False
    """The transfer waits for the receive budget (its chunk, if new and within the initial
    credit, is held)."""


@dataclass
class ReceiverStats:
    chunks_received: int = 0
    duplicates: int = 0
    transfers_completed: int = 0
    transfers_expired: int = 0
    transfers_waited: int = 0
    """Transfers that had to wait for the receive budget before they were admitted."""
    chunks_beyond_credit: int = 0
    """Chunks of a waiting transfer beyond the initial credit (a sender that does not keep to
    it): dropped, not held; the sender resends them once it is granted credit."""
    peak_admitted_bytes: int = 0
    """The most bytes admitted for reassembly at once."""
    peak_held_bytes: int = 0
    """The most bytes held at once: admitted transfers plus the chunks waiting ones hold."""


class TransferReceiver:
    """Reassembles chunked transfers from any number of senders and answers every chunk.

    Digest, size and bound checks are ``comm.wire.chunking.Reassembler``'s (this wraps one), plus
    the bounds and chunk layout of ``comm.transport.chunk_checks``; a bad chunk raises
    :class:`WireError` and changes nothing. Feeds the bytes it receives into the sender's link
    estimator and grants windows from it. Admits transfers for reassembly within the receive
    budget (``comm.transport.receive_budget``); the acknowledgements that are not
    answers to the chunk at hand (a grant to a transfer just admitted, keepalives) are collected
    by :meth:`acks_due`, which the driver calls after every chunk and on every tick.
    """

    def __init__(
        self, config: TransferConfig | None = None, charges: PeerCharges | None = None
    ) -> None:
        self.config = config or TransferConfig()
        self.charges = charges or PeerCharges(self.config.peer_hold_bytes)
        """What each sender holds here, against its allowance (shared with the endpoint)."""
        self._reassembler = Reassembler(
            max_transfer_bytes=self.config.max_transfer_bytes, max_pending=self.config.max_pending
        )
        self._incoming: dict[TransferKey, _Incoming] = {}
        self._budget = ReceiveBudget(self.config)
        self._completed: OrderedDict[TransferKey, int] = OrderedDict()
        self._grants: list[tuple[bytes, ChunkAck]] = []
        self._now = 0.0  # the latest time a call passed in
        self._keepalive_scan_at = 0.0
        self.stats = ReceiverStats()

    # -- state ----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Open transfers, admitted or waiting."""
        return len(self._incoming)

    @property
    def waiting(self) -> int:
        """Transfers waiting for the receive budget."""
        return self._budget.waiting

    @property
    def admitted(self) -> int:
        """Transfers being reassembled."""
        return self._budget.admitted

    @property
    def admitted_bytes(self) -> int:
        """The sizes of the transfers being reassembled (their buffers), summed."""
        return self._budget.admitted_bytes

    @property
    def held_bytes(self) -> int:
        """Admitted bytes plus the chunks waiting transfers hold."""
        return self._budget.held_bytes

    def window_bytes(self, link: LinkEstimator | None = None) -> int:
        return grant_window_bytes(self.config, None if link is None else link.snapshot())

    def next_index(self, sender: bytes, transfer_id: str) -> int | None:
        """Where an open transfer stands (None: not open)."""
        state = self._incoming.get((sender, transfer_id))
        return None if state is None else state.next_index

    def is_waiting(self, sender: bytes, transfer_id: str) -> bool:
        """Whether an open transfer waits for the receive budget."""
        state = self._incoming.get((sender, transfer_id))
        return state is not None and state.waiting

    # -- chunks ---------------------------------------------------------------------------

    def on_chunk(
        self, sender: bytes, chunk: Chunk, now: float, link: LinkEstimator | None = None
    ) -> Received:
        """Take one chunk from ``sender``; ``link`` is that sender's link estimator."""
        self._now = max(self._now, now)
        key = (sender, chunk.transfer_id)
        finished = self._completed.get(key)
        if finished is not None:
            self.stats.duplicates += 1
            ack = ChunkAck(transfer_id=chunk.transfer_id, next_index=finished, credit_bytes=0)
            return Received(ack=ack, frames=None, duplicate=True)
        check_bounds(chunk, self.config)
        nbytes = memoryview(chunk.data).nbytes
        stride = chunk_stride(chunk, nbytes)
        state = self._incoming.get(key)
        if state is not None:
            if (state.num_chunks, state.total_bytes) != (chunk.num_chunks, chunk.total_bytes):
                self._remove(key)
                self._admit_waiting(now)
                detail = f"chunk {chunk.index} disagrees on transfer size"
                raise WireError(ErrorCode.MALFORMED, detail)
            if state.stride != stride:
                raise WireError(ErrorCode.MALFORMED, f"chunk {chunk.index} disagrees on layout")
        duplicate = state is not None and bool(state.received[chunk.index])
        frames: list[memoryview] | None = None
        if state is None:
            state, frames = self._open(key, chunk, stride, now, link)  # may raise: none opened
        elif state.waiting:
            if not duplicate:
                check_digest(chunk)
        else:
            frames = self._reassembler.add(sender, chunk, now)  # digest and bounds; may raise
        if state.waiting:
            return self._park(key, state, chunk, nbytes, duplicate, now, link)
        self._count(state, chunk.index, duplicate)
        if not duplicate:
            state.last_at = now
            state.progressed_bytes += nbytes
            state.grant_unanswered = False
        if link is not None and not duplicate:
            link.on_bytes_acked(nbytes, now)
        if frames is not None:
            assert state.next_index == state.num_chunks, "reassembled before all chunks arrived"
            self._remove(key)
            self._remember(key, state.num_chunks)
            self.stats.transfers_completed += 1
            self._admit_waiting(now)
            ack = ChunkAck(
                transfer_id=chunk.transfer_id, next_index=state.num_chunks, credit_bytes=0
            )
            return Received(ack=ack, frames=frames, duplicate=False)
        start = state.next_index * stride
        state.edge = max(state.edge, start + max(stride, self.window_bytes(link)))
        return Received(
            ack=self._ack(state, chunk.transfer_id, now), frames=None, duplicate=duplicate
        )

    def _open(
        self, key: TransferKey, chunk: Chunk, stride: int, now: float, link: LinkEstimator | None
    ) -> tuple[_Incoming, list[memoryview] | None]:
        """A new transfer's first chunk: admitted (into a reassembly buffer) or waiting."""
        sender = key[0]
        if sum(1 for k in self._incoming if k[0] == sender) >= self.config.max_pending:
            detail = f"more than {self.config.max_pending} open transfers from this sender"
            raise WireError(ErrorCode.OVERSIZE, detail)
        check_digest(chunk)  # before anything is charged: a corrupt chunk costs its sender nothing
        cost = chunk.total_bytes + chunk.num_chunks
        self.charges.charge(sender, cost, f"a transfer of {chunk.num_chunks} chunks")
        wait = self._budget.must_wait(chunk.total_bytes)
        frames = None
        if not wait:
            try:
                frames = self._reassembler.add(sender, chunk, now)  # bounds; may raise
            except WireError:
                self.charges.release(sender, cost)
                raise
        state = _Incoming(
            num_chunks=chunk.num_chunks,
            total_bytes=chunk.total_bytes,
            stride=stride,
            edge=self.config.initial_credit_bytes,
            started_at=now,
            received=bytearray(chunk.num_chunks),
            waiting=wait,
            link=link,
        )
        self._incoming[key] = state
        if wait:
            self._budget.enqueue(key, state.total_bytes)
            self.stats.transfers_waited += 1
        else:
            self._budget.admit(key, state.total_bytes)
            self._note_peak()
        return state, frames

    def _park(
        self,
        key: TransferKey,
        state: _Incoming,
        chunk: Chunk,
        nbytes: int,
        duplicate: bool,
        now: float,
        link: LinkEstimator | None,
    ) -> Received:
        """A chunk of a waiting transfer: held if it is within the initial credit."""
        if duplicate:
            self._count(state, chunk.index, duplicate=True)
        elif chunk.offset + nbytes > state.edge:
            self.stats.chunks_received += 1
            self.stats.chunks_beyond_credit += 1
        else:
            state.parked.append(chunk)
            self._budget.hold(nbytes)
            self._count(state, chunk.index, duplicate=False)
            state.last_at = now
            if link is not None:
                link.on_bytes_acked(nbytes, now)
            self._note_peak()
        # Larger than the initial credit (or it would not wait), so never complete while waiting.
        assert state.next_index < state.num_chunks
        ack = self._ack(state, key[1], now)
        return Received(ack=ack, frames=None, duplicate=duplicate, waiting=True)

    def _ack(self, state: _Incoming, transfer_id: str, now: float) -> ChunkAck:
        """Where ``state`` stands and the credit it was granted, as an acknowledgement."""
        state.acked_at = now
        start = state.next_index * state.stride
        return ChunkAck(
            transfer_id=transfer_id,
            next_index=state.next_index,
            credit_bytes=max(0, state.edge - start),
        )

    # -- the receive budget ---------------------------------------------------------------

    def _admit_waiting(self, now: float) -> None:
        """Admit waiting transfers, oldest first, while the budget allows."""
        while (key := self._budget.next_admissible()) is not None:
            self._admit(key, self._incoming[key], now)

    def _admit(self, key: TransferKey, state: _Incoming, now: float) -> None:
        """Move a waiting transfer's held chunks into a reassembly buffer and grant a window."""
        sender, transfer_id = key
        parked, state.parked = state.parked, []
        self._budget.unhold(sum(memoryview(c.data).nbytes for c in parked))
        state.waiting = False
        self._budget.admit(key, state.total_bytes)
        for chunk in parked:  # checked when they came; the sender's open transfers are bounded
            frames = self._reassembler.add(sender, chunk, now)
            assert frames is None, "a waiting transfer is never complete"
        self._note_peak()
        state.last_at = state.started_at = now
        state.progressed_bytes = 0
        state.grant_unanswered = True
        start = state.next_index * state.stride
        state.edge = max(state.edge, start + max(state.stride, self.window_bytes(state.link)))
        self._grants.append((sender, self._ack(state, transfer_id, now)))

    def _remove(self, key: TransferKey) -> _Incoming:
        """Forget an open transfer and release what it held."""
        state = self._incoming.pop(key)
        if state.waiting:
            self._budget.release_waiting(key, sum(memoryview(c.data).nbytes for c in state.parked))
        else:
            self._budget.release_admitted(key, state.total_bytes)
            self._reassembler.discard(*key)
        self.charges.release(key[0], state.total_bytes + state.num_chunks)
        return state

    def _note_peak(self) -> None:
        stats = self.stats
        stats.peak_admitted_bytes = max(stats.peak_admitted_bytes, self._budget.admitted_bytes)
        stats.peak_held_bytes = max(stats.peak_held_bytes, self.held_bytes)

    def acks_due(self, now: float) -> list[tuple[bytes, ChunkAck]]:
        """Acknowledgements to send now, each with its sender: grants to transfers just
        admitted, and keepalives: the standing of every waiting transfer, and of every one
        admitted after waiting that sent nothing since, not acknowledged for half a stall
        timeout (a waiting sender keeps waiting; a grant that was lost is sent again)."""
        self._now = max(self._now, now)
        due, self._grants = self._grants, []
        if now >= self._keepalive_scan_at:
            period = self.config.stall_timeout_s / 2
            self._keepalive_scan_at = now + period / 4
            for (sender, transfer_id), state in self._incoming.items():
                if (state.waiting or state.grant_unanswered) and now - state.acked_at >= period:
                    due.append((sender, self._ack(state, transfer_id, now)))
        return due

    # -- bookkeeping ----------------------------------------------------------------------

    def _stuck(self, state: _Incoming, now: float, idle_s: float) -> bool:
        """An admitted transfer idle for ``idle_s``, or too slow over the progress window."""
        if now - state.last_at > idle_s:
            return True
        elapsed = now - state.started_at
        rate = self.config.min_progress_bytes_per_s
        return elapsed > self.config.progress_window_s and state.progressed_bytes < rate * elapsed

    def _count(self, state: _Incoming, index: int, duplicate: bool) -> None:
        """Count a chunk in; a new one advances ``next_index`` over every chunk now held."""
        self.stats.chunks_received += 1
        if duplicate:
            self.stats.duplicates += 1
            return
        state.received[index] = 1
        while state.next_index < state.num_chunks and state.received[state.next_index]:
            state.next_index += 1

    def _remember(self, key: TransferKey, num_chunks: int) -> None:
        self._completed[key] = num_chunks
        while len(self._completed) > self.config.completed_memory:
            self._completed.popitem(last=False)

    def drop_sender(self, sender: bytes) -> None:
        """Forget a sender's open transfers (it left); waiting ones may be admitted."""
        self._reassembler.drop_sender(sender)
        for key in [k for k in self._incoming if k[0] == sender]:
            self._remove(key)
        self._grants = [(s, a) for s, a in self._grants if s != sender]
        self._admit_waiting(self._now)

    def senders(self) -> set[bytes]:
        """The senders with an open transfer."""
        return {k[0] for k in self._incoming}

    def expire(self, now: float, max_idle_s: float | None = None) -> int:
        """Forget the admitted transfers that got no new chunk for ``max_idle_s`` (default: the
        config's ``idle_expire_s``) or moved slower than ``min_progress_bytes_per_s`` over the
        ``progress_window_s`` since they were admitted, freeing their buffers and admitting
        waiting ones; return how many. A waiting transfer's time counts from its admission: the
        wait is the receiver's, not a sign its sender is gone (a departed or quiet sender is
        dropped by :meth:`drop_sender`)."""
        self._now = max(self._now, now)
        idle_s = self.config.idle_expire_s if max_idle_s is None else max_idle_s
        old = [
            k for k, s in self._incoming.items() if not s.waiting and self._stuck(s, now, idle_s)
        ]
        for key in old:
            self._remove(key)
        self.stats.transfers_expired += len(old)
        self._admit_waiting(now)
        return len(old)
