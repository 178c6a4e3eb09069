"""The link emulator's proxy state and socket I/O: accept, read, shape, flush, drop and cut."""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from crossdc.lab.profiles import UNLIMITED, Direction, LinkProfile
from crossdc.lab.shaping import _READ_BUDGET_BYTES, _RECV_BYTES, _Conn, _Pipe, _reset_close, _Shaper

log = logging.getLogger(__name__)


_LISTENER = "listener"
_WAKER = "waker"


class _ProxyIO:
    """The proxy's state and its socket I/O: accept, read, shape and flush, drop and cut
    connections. Runs on the proxy thread only; :class:`LinkEmulator` is the public face."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        profile: LinkProfile = UNLIMITED,
        down_profile: LinkProfile | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        name: str = "link",
    ) -> None:
        if not 0 < upstream_port < 65536:
            raise ValueError(f"upstream_port must be in 1..65535; got {upstream_port!r}")
        if not 0 <= listen_port < 65536:
            raise ValueError(f"listen_port must be in 0..65535; got {listen_port!r}")
        self.name = name
        self._upstream = (upstream_host, upstream_port)
        self._listen = (listen_host, listen_port)
        self._profiles: dict[Direction, LinkProfile] = {
            "up": profile,
            "down": profile if down_profile is None else down_profile,
        }
        self._clock: Callable[[], float] = time.monotonic
        self._bytes: dict[Direction, int] = {"up": 0, "down": 0}
        self._cut_budget: dict[Direction, int | None] = {"up": None, "down": None}
        self._down = False
        self._num_accepted = 0
        self._num_refused = 0
        self._num_cuts = 0
        self._conns: dict[int, _Conn] = {}
        self._by_fd: dict[int, tuple[_Conn, socket.socket]] = {}
        self._lined: set[_Pipe] = set()
        self._shapers: dict[Direction, _Shaper] = {}
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._upstream_addr: tuple[socket.AddressFamily, Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False
        self._lock = threading.Lock()
        self._commands: deque[tuple[Callable[[float], Any], _Reply]] = deque()
        self._port = 0

    def _accept(self) -> None:
        assert self._listener is not None and self._upstream_addr is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # e.g. out of file descriptors: keep serving the others
                log.warning("[link=%s port=%d] accept failed: %s", self.name, self._port, exc)
                return
            if self._down:
                self._num_refused += 1
                _reset_close(client)
                continue
            family, address = self._upstream_addr
            upstream = socket.socket(family, socket.SOCK_STREAM)
            for sock in (client, upstream):
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = upstream.connect_ex(address)
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                _reset_close(client)
                upstream.close()
                continue
            conn = _Conn(self._num_accepted, client, upstream, self._profiles)
            self._num_accepted += 1
            conn.connected = err == 0
            self._conns[conn.conn_id] = conn
            self._by_fd[client.fileno()] = (conn, client)
            self._by_fd[upstream.fileno()] = (conn, upstream)
            self._update_interest(conn)

    def _on_event(self, fd: int, mask: int, touched: set[_Conn]) -> None:
        entry = self._by_fd.get(fd)
        if entry is None:
            return
        conn, sock = entry
        if conn.closed:
            return
        touched.add(conn)
        if sock is conn.upstream and not conn.connected:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._abort(conn)
                return
            conn.connected = True
            return
        if mask & selectors.EVENT_READ:
            self._read(conn.up if sock is conn.client else conn.down)

    def _read(self, pipe: _Pipe) -> None:
        shaper = self._shapers[pipe.direction]
        budget = min(shaper.window - pipe.buffered, _READ_BUDGET_BYTES)
        while budget > 0 and not pipe.src_eof:
            want = min(budget, _RECV_BYTES)
            try:
                data = pipe.src.recv(want)
            except BlockingIOError:
                break
            except OSError:
                self._peer_failed(pipe.conn, pipe.src)
                return
            if not data:
                pipe.src_eof = True
                break
            pipe.queue.append(memoryview(data))
            pipe.queue_bytes += len(data)
            budget -= len(data)
            if len(data) < want:
                break  # drained; skip the extra recv that would only say EAGAIN
        shaper.enqueue(pipe)

    def _flush(self, pipe: _Pipe, now: float) -> None:
        due = pipe.line.pop_due(now)
        if due:
            pipe.out.extend(due)
            pipe.out_bytes += sum(len(c) for c in due)
        if pipe.line.nbytes:
            self._lined.add(pipe)
        else:
            self._lined.discard(pipe)
        if pipe.direction == "up" and not pipe.conn.connected:
            return
        direction = pipe.direction
        while pipe.out:
            budget = self._cut_budget[direction]
            if budget == 0:
                return
            chunk = pipe.out[0]
            view = chunk if budget is None or budget >= len(chunk) else chunk[:budget]
            try:
                sent = pipe.dst.send(view)
            except BlockingIOError:
                return
            except OSError:
                self._peer_failed(pipe.conn, pipe.dst)
                return
            self._bytes[direction] += sent
            pipe.out_bytes -= sent
            if budget is not None:
                self._cut_budget[direction] = budget - sent
            if sent == len(chunk):
                pipe.out.popleft()
            else:
                pipe.out[0] = chunk[sent:]
                if sent < len(view):
                    return  # the socket buffer is full; wait for writability
        if pipe.src_eof and not pipe.dst_shut and pipe.buffered == 0:
            if pipe.src_reset:
                self._abort(pipe.conn)  # everything sent before the reset arrived; now the reset
                return
            try:
                pipe.dst.shutdown(socket.SHUT_WR)
            except OSError:
                self._peer_failed(pipe.conn, pipe.dst)
                return
            pipe.dst_shut = True

    def _finish_or_update(self, conn: _Conn) -> None:
        if conn.up.dst_shut and conn.down.dst_shut:
            # Both sides ended their stream and everything was delivered: close politely.
            self._forget(conn)
            conn.client.close()
            conn.upstream.close()
            return
        self._update_interest(conn)

    def _update_interest(self, conn: _Conn) -> None:
        sel = self._sel
        assert sel is not None
        read, write = selectors.EVENT_READ, selectors.EVENT_WRITE
        up_window = self._shapers["up"].window
        down_window = self._shapers["down"].window
        client_mask = 0
        if not conn.up.src_eof and conn.up.buffered < up_window:
            client_mask |= read
        if conn.down.out:
            client_mask |= write
        if not conn.connected:
            upstream_mask = write
        else:
            upstream_mask = 0
            if not conn.down.src_eof and conn.down.buffered < down_window:
                upstream_mask |= read
            if conn.up.out:
                upstream_mask |= write
        for sock, mask in ((conn.client, client_mask), (conn.upstream, upstream_mask)):
            fd = sock.fileno()
            old = conn.masks[fd]
            if mask == old:
                continue
            if old == 0:
                sel.register(sock, mask)
            elif mask == 0:
                sel.unregister(sock)
            else:
                sel.modify(sock, mask)
            conn.masks[fd] = mask

    def _forget(self, conn: _Conn) -> None:
        conn.closed = True
        sel = self._sel
        assert sel is not None
        for sock in (conn.client, conn.upstream):
            fd = sock.fileno()
            if conn.masks.get(fd):
                sel.unregister(sock)
                conn.masks[fd] = 0
            self._by_fd.pop(fd, None)
        for pipe in (conn.up, conn.down):
            self._drop(pipe)
        self._conns.pop(conn.conn_id, None)

    def _drop(self, pipe: _Pipe) -> None:
        """Discard every byte of ``pipe``: queued, in the delay line, ready to write."""
        self._lined.discard(pipe)
        pipe.line.clear()
        pipe.queue.clear()
        pipe.queue_bytes = 0
        pipe.out.clear()
        pipe.out_bytes = 0

    def _peer_failed(self, conn: _Conn, sock: socket.socket) -> None:
        """One end of ``conn`` reset or failed. As on a real network, what it sent before is on
        the link and still reaches the other end, followed by the reset; what was on its way to
        it is lost, and nothing more is read from the other end."""
        if conn.closed:
            return
        sent_by = conn.up if sock is conn.client else conn.down
        lost = conn.down if sent_by is conn.up else conn.up
        sent_by.src_eof = sent_by.src_reset = True
        lost.src_eof = lost.dst_shut = True
        self._drop(lost)
        if sent_by.buffered == 0 or sent_by.dst_shut:
            self._abort(conn)
            return
        self._update_interest(conn)

    def _abort(self, conn: _Conn) -> None:
        if conn.closed:
            return
        self._forget(conn)
        _reset_close(conn.client)
        _reset_close(conn.upstream)

    def _cut_all(self, reason: str) -> int:
        conns = list(self._conns.values())
        self._num_cuts += 1  # before the resets, so a peer that saw one also sees the count
        for conn in conns:
            self._abort(conn)
        log.info(
            "[link=%s port=%d] %s: cut %d connection(s)", self.name, self._port, reason, len(conns)
        )
        return len(conns)


class _Reply:
    """A one-shot result handed from the proxy thread to the caller of a control method."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def wait(self, *, timeout_s: float) -> Any:
        if not self._event.wait(timeout_s):
            raise TimeoutError(f"proxy loop did not answer within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._value
