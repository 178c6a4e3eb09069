"""Which TCP connection each peer of a ROUTER speaks on, and cutting one off.

A ROUTER socket has no per-peer disconnect. :class:`Connections` finds the connection under a
routing id instead: every frame received with ``copy=False`` names the file descriptor it came
from (``ZMQ_SRCFD``; deprecated in libzmq but present through 4.3), and a monitor on the socket
reports each accepted connection's descriptor, and its end. To cut a peer, a duplicate of the
descriptor is shut down (``shutdown(SHUT_RDWR)``) after checking that it is still the same
connection (its local and remote addresses as recorded when it was accepted: a descriptor
number is reused once libzmq closes it). libzmq then sees the connection end and drops the
peer's pipe; the peer's reconnect goes through the handshake again, and ZAP.

A connection that delivers no message for ``silent_s`` (since it was accepted, or since its
last message) is cut too: every site heartbeats each interval, so a silent connection is dead,
half-open, or held by a peer with nothing to say. This is the coordinator's dead-peer detection:
its ROUTER sends no ZMTP heartbeats of its own (``comm.transport.profile`` says why). Without
``ROUTER_HANDOVER`` (see ``comm.transport.router``) libzmq holds a second connection that
presents a routing id already in use apart, delivering nothing from it, and keeps it apart
after the first one ends: the connection a site opens when it reconnects before the coordinator
noticed its previous one end, or one that presents a stolen routing id. Cut, a site reconnects
and gets through once its previous connection is gone; a connection that has nothing to say
(every site heartbeats each interval) costs nothing to cut.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


@dataclass
class _Connection:
    ends: tuple[Any, Any]
    """(local, remote) address when accepted: what makes the descriptor this connection."""
    accepted_at: float
    spoke_at: float | None = None
    """When a message last came from it (None: none yet)."""


def _ends(fd: int) -> tuple[Any, Any] | None:
    """(local, remote) address of the socket behind ``fd``; None when it is no socket now."""
    try:
        with socket.socket(fileno=os.dup(fd)) as dup:
            return dup.getsockname(), dup.getpeername()
    except OSError:
        return None


class Connections:
    """The connections a ROUTER socket accepted and the peer (routing id) each one carries.

    ``note`` every received frame, read the monitor's news (``events``) at least every few
    tens of milliseconds (its clock dates each connection's start), ``cut`` a peer,
    ``cut_silent`` what stopped speaking, ``close`` before the socket."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        *,
        silent_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.silent_s = silent_s
        self._clock = clock
        self._sock = sock
        self._monitor: zmq.Socket[Any] | None = sock.get_monitor_socket(_EVENTS)
        self._open: dict[int, _Connection] = {}
        self._fd_of: dict[bytes, int] = {}
        self.usable = True
        """Whether frames name their connection (``ZMQ_SRCFD``): without it nothing is cut."""
        self.cuts = 0
        """Connections cut, over the socket's life."""

    def note(self, peer: bytes, frame: zmq.Frame) -> None:
        """A frame from ``peer`` (received with ``copy=False``): the connection it came on."""
        if not self.usable:
            return
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError as exc:
            self.usable = False
            log.error("frames do not name their connection (%s): peers cannot be cut off", exc)
            return
        if not isinstance(fd, int) or fd < 0:
            return
        self._fd_of[peer] = fd
        conn = self._open.get(fd)
        if conn is None:  # accepted since the monitor was last read
            self.events()
            conn = self._open.get(fd)
        if conn is not None:
            conn.spoke_at = self._clock()

    def events(self) -> None:
        """Take the monitor's news: connections accepted and ended."""
        monitor, now = self._monitor, self._clock()
        while monitor is not None and monitor.poll(0):
            event = recv_monitor_message(monitor)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                ends = _ends(fd)
                if ends is not None:
                    self._open[fd] = _Connection(ends=ends, accepted_at=now)
            else:
                self._open.pop(fd, None)

    def cut(self, peer: bytes) -> bool:
        """Cut the connection ``peer`` last spoke on; False when there is none to cut (it
        ended, or its descriptor now holds another connection)."""
        self.events()
        fd = self._fd_of.pop(peer, None)
        if fd is None:
            return False
        conn = self._open.get(fd)
        return conn is not None and self._shutdown(fd, conn)

    def cut_silent(self) -> int:
        """Cut the connections that delivered no message for ``silent_s`` (since they were
        accepted, or since their last one); how many."""
        self.events()
        if not self.usable:
            return 0
        now = self._clock()
        quiet = [
            (fd, c)
            for fd, c in self._open.items()
            if now - (c.accepted_at if c.spoke_at is None else c.spoke_at) >= self.silent_s
        ]
        cut = 0
        for fd, conn in quiet:
            if self._shutdown(fd, conn):
                cut += 1
                log.warning(
                    "cut connection from %s: it delivered no message for %.1f s",
                    conn.ends[1],
                    self.silent_s,
                )
        return cut

    def _shutdown(self, fd: int, conn: _Connection) -> bool:
        self._open.pop(fd, None)
        try:
            with socket.socket(fileno=os.dup(fd)) as dup:
                if (dup.getsockname(), dup.getpeername()) != conn.ends:
                    return False  # the descriptor was reused: that connection already ended
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False  # closed meanwhile
        self.cuts += 1
        return True

    def forget(self, peer: bytes) -> None:
        self._fd_of.pop(peer, None)

    def close(self) -> None:
        """Stop the monitor (before the socket closes)."""
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
