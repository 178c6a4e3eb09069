"""A site's side: the DEALER channel, and :class:`SiteLink`, which runs it on an I/O thread.

:class:`SiteLink` runs a DEALER on its own thread so a site keeps its liveness (heartbeats) and
its transfers moving while its main thread trains.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from comm.transport.endpoint import _Endpoint
from comm.transport.profile import COORDINATOR_PEER, ChannelConfig, RejectHook, _apply_profile
from comm.transport.stats import ChannelStats
from comm.wire.schema import Heartbeat, Message

log = logging.getLogger(__name__)

_ACK_GAP_S = 0.02
"""Least time between two heartbeats sent early to carry or ask for an acknowledgement."""


class DealerChannel(_Endpoint):
    """A site's connection to the coordinator. Not thread-safe: one thread owns it."""

    def __init__(
        self,
        cfg: ChannelConfig,
        *,
        identity: str,
        context: zmq.Context[Any] | None = None,
        on_reject: RejectHook | None = None,
    ) -> None:
        ctx = context or zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        # A stable routing id per process lets the coordinator address us across reconnects.
        routing_id = f"{identity}/{os.urandom(16).hex()}".encode()
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        _apply_profile(sock, cfg, server=False)
        super().__init__(sock, cfg, on_reject)
        self.routing_id = routing_id

    def connect(self, endpoint: str) -> None:
        self._sock.connect(endpoint)

    def watch_disconnects(self) -> zmq.Socket[Any]:
        """A monitor socket that gets an event each time the connection to the coordinator
        drops (a reset, or given up by the heartbeat timeout); the caller polls it and closes
        it (with :meth:`unwatch`) before this channel."""
        return self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def unwatch(self, monitor: zmq.Socket[Any]) -> None:
        self._sock.disable_monitor()
        monitor.close(linger=0)

    def _prefix_for(self, peer: bytes) -> list[bytes]:
        return []

    def send(self, msg: Message) -> None:
        """Send to the coordinator. A large message is under way when this returns: the rest
        follows as the coordinator acknowledges, inside :meth:`recv` and :meth:`flush`, and
        messages sent meanwhile wait behind it (heartbeats excepted)."""
        self._send_frames(COORDINATOR_PEER, msg)

    def recv(self, timeout_s: float) -> Message | None:
        got = self._next(timeout_s)
        return None if got is None else got[1]

    def _recv_one(self) -> tuple[bytes, Message] | None:
        frames = self._recv_frames()
        if self._refuse_oversize(COORDINATOR_PEER):
            return None
        msg = self._parse(COORDINATOR_PEER, [f.buffer for f in frames])
        return None if msg is None else (COORDINATOR_PEER, msg)


class SiteLink:
    """A DEALER on its own I/O thread: queued sends, a receive queue, periodic heartbeats.

    The I/O thread also services the acknowledgements of large messages, so their transfers keep
    moving while the owner trains. ``heartbeat`` builds the liveness message sent every
    ``heartbeat_interval_s``, and sooner (at most every 20 ms) when it carries the
    acknowledgement of a numbered message just received or asks, by the coordinator's echo,
    for that of one just sent; it is called on the I/O thread and must only read simple shared
    state.
    """

    def __init__(
        self,
        cfg: ChannelConfig,
        *,
        identity: str,
        endpoint: str,
        heartbeat: Callable[[], Message] | None = None,
        on_reject: RejectHook | None = None,
    ) -> None:
        self.cfg = cfg
        self.identity = identity
        self.endpoint = endpoint
        self._heartbeat = heartbeat
        self._on_reject = on_reject
        self._outbox: queue.Queue[Message] = queue.Queue()
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: zmq.Context[Any] | None = None
        self._failure: BaseException | None = None
        self._flush_timeout_s = cfg.heartbeat_timeout_s
        self._pending_sends = 0  # written by the I/O thread only
        self._dropped = False  # I/O thread: a drop was logged and no echo came since
        self._beat_at = 0.0  # I/O thread: when the last heartbeat went
        self._acked = (0, 0)  # I/O thread: the delivery state the last heartbeat acknowledged
        self.stats = ChannelStats()

    @property
    def pending_sends(self) -> int:
        """Messages the I/O thread took but has not finished sending (as of its last pass):
        large ones in transfer and those queued behind them."""
        return self._pending_sends

    def start(self) -> None:
        assert self._thread is None, "SiteLink started twice"
        self._context = zmq.Context()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"sitelink-{self.identity}", daemon=True
        )
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        assert self._context is not None
        chan = DealerChannel(
            self.cfg, identity=self.identity, context=self._context, on_reject=self._on_reject
        )
        self.stats = chan.stats
        monitor = chan.watch_disconnects()
        try:
            chan.connect(self.endpoint)
            ready.set()
            next_beat = time.monotonic() + self.cfg.heartbeat_interval_s
            while not self._stop.is_set():
                now = time.monotonic()
                if self._heartbeat is not None and (now >= next_beat or self._ack_due(chan, now)):
                    self._send(chan, self._heartbeat())
                    next_beat = now + self.cfg.heartbeat_interval_s
                    self._beat_at, self._acked = now, self._ack_state(chan)
                self._drain_outbox(chan)
                self._count_disconnects(monitor)
                msg = chan.recv(0.005)  # also takes acks, sends on and resumes transfers
                self._pending_sends = chan.pending_transfers + chan.queued_messages
                if isinstance(msg, Heartbeat):  # the coordinator's echo of one of ours
                    self.stats.echoes_received += 1
                    self._dropped = False
                    now = time.monotonic()
                    self.stats.rtt_sample(now - msg.sent_at)
                    chan.rtt_sample(COORDINATOR_PEER, now - msg.sent_at, now)
                elif msg is not None:
                    self._inbox.put(msg)
            # Send what the owner queued before close(), and let large messages finish.
            self._drain_outbox(chan)
            if not chan.flush(self._flush_timeout_s):
                log.warning(
                    "[site=%s] closing with %d large and %d queued message(s) unsent",
                    self.identity,
                    chan.pending_transfers,
                    chan.queued_messages,
                )
            self._pending_sends = chan.pending_transfers + chan.queued_messages
        except BaseException as exc:  # surfaced to the owner on its next call
            self._failure = exc
            log.exception("site link I/O thread failed")
        finally:
            ready.set()
            chan.unwatch(monitor)
            chan.close(flush_timeout_s=0)

    @staticmethod
    def _ack_state(chan: DealerChannel) -> tuple[int, int]:
        stream = chan.in_streams.get(COORDINATOR_PEER)
        return (0, 0) if stream is None else (stream.contig, len(stream.pending))

    def _ack_due(self, chan: DealerChannel, now: float) -> bool:
        """Whether to send the next heartbeat now rather than at its time: it carries the
        acknowledgement of a numbered message received since the last one, or asks for that
        of one sent whole since (the coordinator's echo carries it). At most every 20 ms."""
        if now - self._beat_at < _ACK_GAP_S:
            return False
        if self._ack_state(chan) != self._acked:
            return True
        stream = chan.out_streams.get(COORDINATOR_PEER)
        return stream is not None and any(
            h.sent_at is not None and h.sent_at > self._beat_at for h in stream.held.values()
        )

    def _count_disconnects(self, monitor: zmq.Socket[Any]) -> None:
        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.stats.disconnects += 1
                # Once per outage: while the far end is away each reconnect attempt may drop.
                if not self._dropped:
                    log.info("[site=%s] connection to the coordinator dropped", self.identity)
                self._dropped = True

    def _drain_outbox(self, chan: DealerChannel) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._send(chan, msg)
            finally:
                self._pending_sends = chan.pending_transfers + chan.queued_messages
                self._outbox.task_done()

    def _send(self, chan: DealerChannel, msg: Message) -> None:
        try:
            chan.send(msg)
        except zmq.Again:
            # The coordinator has not drained for send_timeout_s: the round protocol recovers
            # (deadline, rejoin); the loss is counted, not hidden.
            self.stats.rejected["send_timeout"] += 1
            log.warning("[site=%s] send of %s timed out", self.identity, type(msg).__name__)

    def _check(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"site link failed: {self._failure!r}") from self._failure

    def send(self, msg: Message) -> None:
        self._check()
        self._outbox.put(msg)

    def recv(self, timeout_s: float) -> Message | None:
        self._check()
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued message is sent and every large one acknowledged, or
        ``timeout_s`` passed; True when nothing is left."""
        deadline = time.monotonic() + timeout_s
        while self._outbox.unfinished_tasks or self._pending_sends:
            self._check()
            if self._thread is None or time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Stop the I/O thread once it sent what was queued and flushed large messages (for at
        most ``flush_timeout_s``, default ``heartbeat_timeout_s``: a peer silent that long is
        gone), then close the socket."""
        if flush_timeout_s is not None:
            self._flush_timeout_s = flush_timeout_s
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._flush_timeout_s + self.cfg.linger_s + 5)
            self._thread = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def __enter__(self) -> SiteLink:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
