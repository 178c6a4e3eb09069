"""One hostile peer of ``crossdc bench hostile``: a certified site's raw CURVE connection.

A :class:`HostilePeer` is a ZeroMQ DEALER with a site's kit (its certificate issued by the
federation's CA), a routing id ``<site_id>/<random>`` as real sites present, and a socket monitor
that sees its connection cut. It sends what an attack builds, frames as they are or messages
under its own (session, sequence) header, and keeps what came back: the coordinator's Error
replies (code and detail), the other messages by type, the chunks of the coordinator's large
messages (acknowledged in full unless an attack answers them itself), and the delivery numbers
of what must arrive, which its heartbeats acknowledge as a site does.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from comm.security.rolekits import load_site_kit
from comm.wire.chunking import Reassembler
from comm.wire.frames import Envelope, WireError, from_wire_envelope, to_wire
from comm.wire.schema import Chunk, ChunkAck, Error, Heartbeat, Message
from crossdc.bench.fuzz_live_sites import code_name

FULL_CREDIT_BYTES = 64 << 20
"""The credit a peer that takes what it is sent grants each chunk's transfer."""


@dataclass
class Replies:
    """What came back to one peer."""

    errors: list[tuple[str, str]] = field(default_factory=list)
    """(code name, detail) of each Error reply, in order."""
    by_type: Counter[str] = field(default_factory=Counter)
    chunks: int = 0
    chunk_acks: list[ChunkAck] = field(default_factory=list)
    """The coordinator's acknowledgements of this peer's chunks."""
    disconnects: int = 0
    """Connections of this socket that ended (a cut, or the coordinator going away)."""
    auth_failures: int = 0
    """Handshakes the coordinator refused (a revoked certificate's reconnects)."""
    first_disconnect_at: float | None = None


ChunkAnswer = Callable[[Chunk], ChunkAck | None]
"""How a peer answers a chunk of the coordinator's: an acknowledgement, or None for none."""


class HostilePeer:
    """``site_id``'s connection to ``endpoint``; :meth:`close` it."""

    def __init__(
        self,
        endpoint: str,
        kit_dir: Path,
        site_id: str,
        *,
        routing_suffix: str | None = None,
        answer_chunk: ChunkAnswer | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.site_id = site_id
        self.routing_id = f"{site_id}/{routing_suffix or os.urandom(8).hex()}".encode()
        self._own_ctx = context is None
        self.ctx: zmq.Context[Any] = context or zmq.Context()
        curve = load_site_kit(kit_dir, site_id=site_id).curve
        assert curve.server_public is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.SNDTIMEO, 30_000)
        sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        self.monitor = sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        sock.connect(endpoint)
        self.sock = sock
        self.session = f"{site_id}-{os.urandom(4).hex()}"
        self.seq = 0
        self.sent = 0
        self.replies = Replies()
        self.answer_chunk = answer_chunk or _full_credit
        self._reassembler = Reassembler(max_transfer_bytes=1 << 30)
        self._peer_session = ""
        self._held: set[int] = set()
        self._floor = 0

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()

    # ---- sending ---------------------------------------------------------------------------

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def frames(self, msg: Message, *, delivery: tuple[int, int] | None = None) -> list[Any]:
        """``msg`` under this peer's header, acknowledging what it holds of the coordinator's
        stream."""
        return to_wire(
            msg, session=self.session, seq=self.next_seq(), delivery=delivery, ack=self.ack()
        )

    def send(self, msg: Message, *, delivery: tuple[int, int] | None = None) -> None:
        self.send_frames(self.frames(msg, delivery=delivery))

    def send_frames(self, frames: Sequence[Any]) -> None:
        self.sock.send_multipart(list(frames))
        self.sent += 1

    def heartbeat(self) -> None:
        self.send(Heartbeat(site_id=self.site_id, global_version=-1, sent_at=time.monotonic()))

    def ack(self) -> tuple[str, int, tuple[int, ...]] | None:
        """What this peer holds of the coordinator's numbered stream: (session, contiguous,
        numbers above the gap)."""
        if not self._peer_session:
            return None
        contiguous = self._floor
        while contiguous + 1 in self._held:
            contiguous += 1
        above = tuple(sorted(n for n in self._held if n > contiguous))[-64:]
        return (self._peer_session, contiguous, above)

    # ---- receiving -------------------------------------------------------------------------

    def poll(self, timeout_s: float = 0.0) -> list[Message]:
        """Everything that arrived (waiting up to ``timeout_s`` for the first), recorded."""
        got: list[Message] = []
        self._watch()
        if not self.sock.poll(int(timeout_s * 1000)):
            return got
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            msg = self._take([f.buffer for f in frames])
            if msg is not None:
                got.append(msg)
        self._watch()
        return got

    def _take(self, frames: list[Any]) -> Message | None:
        try:
            msg, env = from_wire_envelope(frames)
        except WireError:
            self.replies.by_type["undecodable"] += 1
            return None
        if isinstance(msg, Chunk):
            self.replies.chunks += 1
            answer = self.answer_chunk(msg)
            if answer is not None:
                self.send(answer)
            try:
                whole = self._reassembler.add(b"c", msg, time.monotonic())
            except WireError:
                return None
            if whole is None:
                return None
            try:
                msg, env = from_wire_envelope(whole)
            except WireError:
                return None
        self._note_delivery(env)
        self.replies.by_type[type(msg).__name__] += 1
        if isinstance(msg, Error):
            self.replies.errors.append((code_name(msg.code), msg.detail))
        elif isinstance(msg, ChunkAck):
            self.replies.chunk_acks.append(msg)
        return msg

    def _note_delivery(self, env: Envelope) -> None:
        if env.delivery is None:
            return
        number, floor = env.delivery
        if env.session != self._peer_session:
            self._peer_session, self._held, self._floor = env.session, set(), 0
        self._floor = max(self._floor, floor)
        self._held.add(number)
        self._held = {n for n in self._held if n > self._floor}

    def _watch(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.replies.disconnects += 1
                if self.replies.first_disconnect_at is None:
                    self.replies.first_disconnect_at = time.monotonic()
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.replies.auth_failures += 1


def _full_credit(chunk: Chunk) -> ChunkAck:
    """A peer that takes what it is sent: every chunk acknowledged, a large window granted."""
    return ChunkAck(
        transfer_id=chunk.transfer_id, next_index=chunk.index + 1, credit_bytes=FULL_CREDIT_BYTES
    )
