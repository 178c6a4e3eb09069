"""What a channel counts: bytes, messages, chunks, rejections, RTT and goodput averages."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ChannelStats:
    """Byte and rejection counts of one channel (all threads read, one writes)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    rtt_s: float = 0.0
    """EWMA of measured round trips (0: none yet)."""
    goodput_bps: float = 0.0
    """EWMA of measured receive goodput of chunked transfers, bits/s (0: none yet)."""
    chunks_sent: int = 0
    """Chunks of large messages put on the wire, resends included."""
    chunks_resent: int = 0
    """Chunks sent again after a stall (the receiver may or may not have held them)."""
    transfer_resumes: int = 0
    """Times a large message went back to its last acknowledged chunk."""
    messages_dropped: int = 0
    """Messages given up after ``send`` took them: a large one that made no progress for
    ``send_timeout_s`` or whose peer restarted, and those queued behind it."""
    messages_acked: int = 0
    """Messages that must arrive the peer acknowledged holding."""
    messages_resent: int = 0
    """Messages that must arrive sent again because their acknowledgement was late."""
    messages_abandoned: int = 0
    """Messages that must arrive given up unacknowledged: over the held bounds, or the peer
    restarted or was forgotten."""
    duplicates_dropped: int = 0
    """Messages received that this end already had (a resend whose original arrived)."""
    acks_dropped: int = 0
    """Acknowledgements that could not be sent (peer gone or not draining)."""
    echoes_received: int = 0
    disconnects: int = 0
    """Times the connection to the peer dropped (a site's link: reset, or given up for silence);
    what was in flight then may be lost."""
    """Heartbeats the peer echoed back (a coordinator echoes only a member's heartbeats)."""
    credit_waits: int = 0
    """Large messages sent from here that waited for credit with every chunk acknowledged: the
    receiver held them back for its receive budget (they resent nothing meanwhile)."""
    transfers_waited: int = 0
    """Large messages received here that waited for this end's receive budget before they were
    reassembled."""
    transfers_waiting: int = 0
    """Large messages waiting for this end's receive budget now."""
    reassembly_peak_bytes: int = 0
    """The most bytes this end held at once for messages being received in chunks (reassembly
    buffers plus the chunks waiting messages hold)."""

    def rtt_sample(self, seconds: float, alpha: float = 0.2) -> None:
        self.rtt_s = seconds if self.rtt_s == 0 else (1 - alpha) * self.rtt_s + alpha * seconds

    def goodput_sample(self, bps: float, alpha: float = 0.3) -> None:
        self.goodput_bps = (
            bps if self.goodput_bps == 0 else (1 - alpha) * self.goodput_bps + alpha * bps
        )
