"""The sending side of a chunked transfer: a pure state machine over credit and acknowledgements.

:class:`TransferSender` sends a chunk only if it ends within the right edge the receiver's
acknowledgements granted, keeps that edge from moving back, measures round trips from
acknowledgements, and on a stall resumes from the last acknowledged chunk, never from zero.
Only an acknowledgement that moves ``next_index`` on is progress (:attr:`last_advance_at`), and
the first grant beyond the initial credit (the receiver admitted the transfer); a receiver's
keepalives while it holds the transfer back keep the stall timer from firing, nothing more.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from comm.transport.credit import stream_bytes
from comm.wire.chunking import new_transfer_id, split_frames
from comm.wire.frames import Frame
from comm.wire.schema import Chunk

# --------------------------------------------------------------------------------------------
# The sender


class TransferSender:
    """Which chunk of one message may go next, given the receiver's acknowledgements.

    Invariant (asserted in tests at every step): ``bytes_in_flight <= window_bytes``, i.e. no
    chunk ever sent ends beyond the right edge the receiver granted (or the initial credit).
    Chunks are cut lazily, so the first goes out before the last digest is computed.
    """

    def __init__(
        self,
        frames: Sequence[Frame],
        *,
        chunk_bytes: int,
        transfer_id: str | None = None,
        initial_credit_bytes: int | None = None,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes!r}")
        credit = chunk_bytes if initial_credit_bytes is None else initial_credit_bytes
        if credit < chunk_bytes:
            raise ValueError("initial_credit_bytes must be >= chunk_bytes")
        self.transfer_id = transfer_id or new_transfer_id()
        self.chunk_bytes = chunk_bytes
        self.total_bytes = stream_bytes(frames)
        self.num_chunks = max(1, -(-self.total_bytes // chunk_bytes))
        self._source = split_frames(frames, chunk_bytes, self.transfer_id)
        self._chunks: list[Chunk | None] = []  # None: acknowledged, released
        self._released = 0  # chunks below this are released
        self._acked = 0  # the receiver's next_index as last acknowledged
        self._next = 0  # next chunk to send
        self._high = 0  # one past the highest chunk ever sent
        self._edge = credit  # absolute stream offset no sent byte may reach
        self._initial_edge = credit
        self._admitted = False  # a grant went beyond the initial credit
        self._sent_at: dict[int, float] = {}  # first-send times, for RTT samples (Karn)
        self._progress_at: float | None = None  # the stall timer
        self._advanced_at: float | None = None
        self.chunks_sent = 0
        self.chunks_resent = 0
        self.resumes = 0

    # -- state ----------------------------------------------------------------------------

    def _start(self, index: int) -> int:
        return min(self.total_bytes, index * self.chunk_bytes)

    def _end(self, index: int) -> int:
        return min(self.total_bytes, (index + 1) * self.chunk_bytes)

    @property
    def acked_index(self) -> int:
        """The receiver's last acknowledged ``next_index``: every chunk below it has arrived."""
        return self._acked

    @property
    def next_index(self) -> int:
        """The chunk :meth:`next_chunk` would send next."""
        return self._next

    @property
    def high_water_index(self) -> int:
        """One past the highest chunk ever sent."""
        return self._high

    @property
    def done(self) -> bool:
        """Every chunk acknowledged."""
        return self._acked >= self.num_chunks

    @property
    def acked_bytes(self) -> int:
        return self._start(self._acked)

    @property
    def bytes_in_flight(self) -> int:
        """Bytes of the chunks sent from the last acknowledged one on."""
        return (
            self._end(self._next - 1) - self._start(self._acked) if self._next > self._acked else 0
        )

    @property
    def window_bytes(self) -> int:
        """The granted window: bytes from the last acknowledged chunk up to the right edge."""
        return max(0, self._edge - self._start(self._acked))

    @property
    def last_progress_at(self) -> float | None:
        """The stall timer: when an acknowledgement last advanced, the receiver admitted the
        transfer or answered while holding it back (or the first send, or the last resume)."""
        return self._progress_at

    @property
    def last_advance_at(self) -> float | None:
        """When the acknowledged index last advanced or the receiver admitted the transfer (or
        the first chunk went): the only progress a give-up timeout counts from."""
        return self._advanced_at

    @property
    def admitted(self) -> bool:
        """The receiver granted credit beyond the initial credit: it is reassembling this
        transfer. One that holds the transfer back for its receive budget grants none."""
        return self._admitted

    def can_send(self) -> bool:
        return self._next < self.num_chunks and self._end(self._next) <= self._edge

    @property
    def waiting_for_credit(self) -> bool:
        """Every chunk sent was acknowledged and the window is used up: the receiver holds the
        transfer but grants no more yet (its receive budget is taken). Nothing is in flight, so
        there is nothing to resend; an acknowledgement while waiting counts as progress."""
        return not self.done and self._next == self._acked and not self.can_send()

    def stalled(self, now: float, timeout_s: float) -> bool:
        """Whether nothing advanced for ``timeout_s`` while chunks are unacknowledged."""
        if self.done or self._progress_at is None:
            return False
        return now - self._progress_at >= timeout_s

    # -- events ---------------------------------------------------------------------------

    def _chunk(self, index: int) -> Chunk:
        while len(self._chunks) <= index:
            self._chunks.append(next(self._source))
        chunk = self._chunks[index]
        assert chunk is not None, f"chunk {index} was released"
        return chunk

    def next_chunk(self, now: float | None = None) -> Chunk | None:
        """The next chunk the window allows (marked sent), or None: window full or all sent."""
        if not self.can_send():
            return None
        index = self._next
        chunk = self._chunk(index)
        assert chunk.num_chunks == self.num_chunks and chunk.total_bytes == self.total_bytes
        if index < self._high:
            self.chunks_resent += 1
        else:
            self._high = index + 1
            if now is not None:
                self._sent_at[index] = now
        self._next += 1
        self.chunks_sent += 1
        if self._progress_at is None and now is not None:
            self._progress_at = now
        if self._advanced_at is None and now is not None:
            self._advanced_at = now
        return chunk

    def pending_chunks(self, now: float | None = None) -> Iterator[Chunk]:
        """Yield every chunk the window allows now."""
        while (chunk := self.next_chunk(now)) is not None:
            yield chunk

    def on_ack(
        self, transfer_id: str, next_index: int, credit_bytes: int, now: float | None = None
    ) -> float | None:
        """Take one acknowledgement; return an RTT sample (seconds) when ``now`` is given and it
        newly covers a chunk sent only once (a resent chunk's sample would be ambiguous).

        Acknowledgements that arrive late (``next_index`` below the last one) are ignored except
        for their credit, which can only move the right edge forward. One that does not advance
        is progress (:attr:`last_advance_at`) only as the first grant beyond the initial credit;
        one that comes while :attr:`waiting_for_credit` restarts the stall timer
        (:attr:`last_progress_at`) and nothing else: more credit alone is no progress.
        """
        if transfer_id != self.transfer_id:
            raise ValueError(f"ack for transfer {transfer_id!r}, this is {self.transfer_id!r}")
        if credit_bytes < 0 or not 0 <= next_index <= self.num_chunks:
            raise ValueError(f"ack index {next_index}/{self.num_chunks} credit {credit_bytes}")
        if next_index > self._high:
            raise ValueError(f"ack of chunk {next_index - 1}, never sent (sent {self._high})")
        edge = self._start(next_index) + credit_bytes
        admitted = not self._admitted and edge > self._initial_edge
        self._admitted = self._admitted or admitted
        self._edge = max(self._edge, edge)
        if next_index <= self._acked:
            if now is not None and (admitted or self.waiting_for_credit):
                # The receiver's keepalive while it holds the transfer back, or the grant that
                # ends the wait: it is there and has everything sent, so the stall timer starts
                # again. Only the grant is progress: keepalives alone keep it waiting, not going.
                self._progress_at = now
                if admitted:
                    self._advanced_at = now
            return None
        sample: float | None = None
        sent_at = self._sent_at.get(next_index - 1)
        if now is not None and sent_at is not None:
            sample = now - sent_at
        for index in [i for i in self._sent_at if i < next_index]:
            del self._sent_at[index]
        self._acked = next_index
        self._next = max(self._next, next_index)  # the receiver already holds those
        if now is not None:
            self._progress_at = self._advanced_at = now
        # Chunks below the acknowledgement are never sent again (a resume goes back to it at
        # most); chunks spanning frame boundaries are copies, so let them go.
        for index in range(self._released, min(next_index, len(self._chunks))):
            self._chunks[index] = None
        self._released = max(self._released, min(next_index, len(self._chunks)))
        return sample

    def resume(self, from_index: int | None = None, now: float | None = None) -> None:
        """Send again from ``from_index`` (default: the last acknowledged chunk).

        After a reconnect the receiver's own acknowledgement names where it stands; anything
        sent from there on may have been lost with the old connection. ``from_index`` above the
        last acknowledgement counts as an acknowledgement; below it is a ValueError: those
        chunks were acknowledged (and released), a transfer never goes back behind that.
        """
        start = self._acked if from_index is None else from_index
        if not self._acked <= start <= self._high:
            raise ValueError(f"resume from {start}: acknowledged {self._acked}, sent {self._high}")
        self._acked = start
        self._next = start
        self._sent_at.clear()
        self.resumes += 1
        if now is not None:
            self._progress_at = now
