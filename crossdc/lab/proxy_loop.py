"""The link emulator's proxy thread: the selector loop, commands from other threads, shutdown."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from crossdc.lab.profiles import DIRECTIONS
from crossdc.lab.proxy_io import _LISTENER, _WAKER, _ProxyIO, _Reply
from crossdc.lab.shaping import _Conn

log = logging.getLogger(__name__)


_T = TypeVar("_T")


class _ProxyLoop(_ProxyIO):
    """The proxy thread: one selector loop that serves I/O events, runs commands sent from
    other threads (:meth:`_call`), ticks the shapers and shuts down."""

    def _call(self, fn: Callable[[float], _T]) -> _T:
        thread = self._thread
        if thread is None or threading.current_thread() is thread:
            return fn(self._clock())
        if self._closed or not thread.is_alive():
            raise RuntimeError(f"[link={self.name}] not running")
        reply: _Reply = _Reply()
        with self._lock:
            self._commands.append((fn, reply))
        self._wake()
        result: _T = reply.wait(timeout_s=10.0)
        return result

    def _wake(self) -> None:
        if self._wake_w is not None:
            # BlockingIOError: a wake-up is already pending; OSError: the loop is gone.
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    def _serve(self) -> None:
        sel = self._sel
        assert sel is not None
        try:
            while not self._stop:
                timeout = self._timeout(self._clock())
                events = sel.select(timeout)
                now = self._clock()
                touched: set[_Conn] = set()
                for key, mask in events:
                    if key.data is _LISTENER:
                        self._accept()
                    elif key.data is _WAKER:
                        self._drain_waker()
                    else:
                        self._on_event(key.fd, mask, touched)
                self._run_commands()
                self._tick(now, touched)
        except Exception:
            log.exception("[link=%s port=%d] proxy loop failed", self.name, self._port)
        finally:
            self._shutdown()

    def _timeout(self, now: float) -> float | None:
        wake: float | None = None
        for shaper in self._shapers.values():
            at = shaper.wake_at(now)
            if at is not None and (wake is None or at < wake):
                wake = at
        for pipe in self._lined:
            due = pipe.line.next_due()
            if due is not None and (wake is None or due < wake):
                wake = due
        return None if wake is None else max(0.0, wake - now)

    def _tick(self, now: float, touched: set[_Conn]) -> None:
        for direction in DIRECTIONS:
            self._shapers[direction].release(now, touched)
        for pipe in self._lined:
            due = pipe.line.next_due()
            if due is not None and due <= now:
                touched.add(pipe.conn)
        for conn in touched:
            if not conn.closed:
                self._flush(conn.up, now)
            if not conn.closed:
                self._flush(conn.down, now)
        if any(budget == 0 for budget in self._cut_budget.values()):
            self._cut_all("cut_after_bytes")
            for direction in DIRECTIONS:
                if self._cut_budget[direction] == 0:
                    self._cut_budget[direction] = None
        for conn in touched:
            if not conn.closed:
                self._finish_or_update(conn)

    def _run_commands(self) -> None:
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for fn, reply in commands:
            try:
                reply.set(fn(self._clock()))
            except Exception as exc:  # handed to the caller's thread
                reply.fail(exc)

    def _drain_waker(self) -> None:
        assert self._wake_r is not None
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _shutdown(self) -> None:
        for conn in list(self._conns.values()):
            self._abort(conn)
        if self._sel is not None:
            self._sel.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
