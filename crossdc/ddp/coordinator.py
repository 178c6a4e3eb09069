"""The baseline's coordinator service: one all-reduce over the WAN per step.

This module owns the coordinator's loop (the protocol is in ``crossdc.ddp``'s docstring): it
only receives, ticks and sends; ``crossdc.ddp.decision`` holds its configuration, what it admits
and the pure decision it carries out. ``status.json`` (atomic writes) holds steps, per-step
timing, wire bytes both ways and the reported val losses.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from comm.codecs.registry import get_codec
from comm.transport.router import RouterChannel
from comm.wire.frames import WireError
from comm.wire.schema import (
    ERROR_MEANINGS,
    Error,
    ErrorCode,
    Eval,
    Heartbeat,
    Join,
    Leave,
    Message,
    Shutdown,
    StepGrad,
    StepMean,
    Welcome,
)
from comm.wire.tensors import decode_tensors, encode_tensors
from coordinator.status_board import StatusBoard, write_endpoint
from crossdc.ddp.decision import (
    Action,
    DDPConfig,
    FirstJoin,
    Grad,
    Refused,
    Snapshot,
    Spec,
    admit_grad,
    admit_join,
    decide,
    mean_gradient,
    segment_starts,
    weighted_loss,
)

log = logging.getLogger("crossdc.ddp")


@dataclass
class _Member:
    peer: bytes
    last_seen: float


class DDPCoordinator:
    """One baseline run. ``start``, then ``run`` (or ``step``), then ``close``."""

    def __init__(self, cfg: DDPConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.session_id = os.urandom(8).hex()
        self.endpoint = ""
        self.chan: RouterChannel | None = None
        self.members: dict[str, _Member] = {}
        self.participants: tuple[str, ...] = ()
        self.first_join: FirstJoin | None = None
        """The first joiner's model; every later joiner must declare the same."""
        self.step_index = 0
        """Steps completed: the step whose gradients are being gathered."""
        self.segment = 0
        self.grads: dict[str, Grad] = {}
        self.val_losses: dict[int, float] = {}
        self.history: list[dict[str, Any]] = []
        self.rejected: Counter[str] = Counter()
        self.finished = False
        self.outcome = ""
        self.aborted = False
        self.tokens_total = 0.0
        self._started_at: float | None = None
        self._finished_at: float | None = None
        self._step_opened_at = 0.0
        self._step_bytes_at_open = (0, 0)
        self._final_eval_asked_at: float | None = None
        self._status = StatusBoard(
            self.cfg.state_path / "status.json" if self.cfg.state_dir else None, self.clock
        )

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> str:
        """Bind the socket, write ``endpoint.json``; return the bound endpoint."""
        self.chan = RouterChannel(self.cfg.channel)
        self.endpoint = self.chan.bind(self.cfg.bind)
        if self.cfg.state_dir:
            write_endpoint(self.cfg.state_path, self.endpoint, self.session_id)
        log.info("[ddp] listening on %s session=%s", self.endpoint, self.session_id)
        self._publish_status()
        return self.endpoint

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()
            self.chan = None

    def __enter__(self) -> DDPCoordinator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def done(self) -> bool:
        """Finished, and every site acknowledged the Shutdown (Leave) or the drain timed out:
        closing earlier could cut the last StepMean still queued for a slow link."""
        if not self.finished or self._finished_at is None:
            return False
        return not self.members or self.clock() - self._finished_at > self.cfg.site_timeout_s

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until the run is done (finished or aborted) or ``stop`` is set."""
        while not self.done and not (stop is not None and stop.is_set()):
            self.step(0.05)
        self._publish_status()  # with the bytes of the last Leaves

    def step(self, timeout_s: float) -> None:
        """Handle at most one message (waiting up to ``timeout_s``), then tick."""
        assert self.chan is not None, "start() first"
        got = self.chan.recv(timeout_s)
        if got is not None:
            peer, msg = got
            self._handle(peer, msg)
        self.tick()

    # ---- helpers -----------------------------------------------------------------------------

    def _reject(self, peer: bytes, code: ErrorCode, detail: str, who: str = "?") -> None:
        self.rejected[code.name.lower()] += 1
        log.warning("[ddp site=%s] rejected: %s: %s", who, code.name.lower(), detail)
        self._send(peer, Error(code=int(code), detail=f"{ERROR_MEANINGS[code]}: {detail}"))

    def _send(self, peer: bytes, msg: Message) -> bool:
        assert self.chan is not None
        return self.chan.send(peer, msg)

    def _member_for(self, peer: bytes, site_id: str) -> bool:
        m = self.members.get(site_id)
        if m is None or m.peer != peer:
            self._reject(peer, ErrorCode.NOT_JOINED, f"site {site_id!r} must join", site_id)
            return False
        m.last_seen = self.clock()
        return True

    def _alive(self, now: float) -> tuple[str, ...]:
        return tuple(
            sorted(
                s for s, m in self.members.items() if now - m.last_seen <= self.cfg.site_timeout_s
            )
        )

    # ---- message handling --------------------------------------------------------------------

    def _handle(self, peer: bytes, msg: Message) -> None:
        if isinstance(msg, Join):
            self._on_join(peer, msg)
        elif isinstance(msg, Heartbeat):
            # A non-member's heartbeat (one that overtook its Join) is ignored, not refused:
            # a site cannot rejoin a run anyway.
            m = self.members.get(msg.site_id)
            if m is not None and m.peer == peer:
                m.last_seen = self.clock()
                self._send(peer, msg)  # echoed: the site measures its round trip
        elif isinstance(msg, StepGrad):
            if self._member_for(peer, msg.site_id):
                self._on_grad(peer, msg)
        elif isinstance(msg, Eval):
            if self._member_for(peer, msg.site_id):
                self._on_eval(peer, msg)
        elif isinstance(msg, Leave):
            if self._member_for(peer, msg.site_id):
                log.info("[ddp site=%s] left: %s", msg.site_id, msg.reason)
                del self.members[msg.site_id]
                assert self.chan is not None
                self.chan.forget(peer)
        else:
            self._reject(peer, ErrorCode.UNEXPECTED, f"{type(msg).__name__} is not for me")

    def _on_join(self, peer: bytes, msg: Join) -> None:
        try:
            spec = admit_join(msg, participants=self.participants, first=self.first_join)
        except Refused as refused:
            self._reject(peer, refused.code, refused.detail, msg.site_id)
            return
        if self.first_join is None:
            self.first_join = FirstJoin(msg.model_fingerprint, msg.state_hash, spec)
        old = self.members.get(msg.site_id)
        if old is not None and old.peer != peer:
            assert self.chan is not None
            self.chan.forget(old.peer)
        self.members[msg.site_id] = _Member(peer=peer, last_seen=self.clock())
        log.info("[ddp site=%s] joined (%d members)", msg.site_id, len(self.members))
        self._send(
            peer,
            Welcome(
                site_id=msg.site_id,
                session_id=self.session_id,
                global_version=self.step_index,
                heartbeat_interval_s=self.cfg.channel.heartbeat_interval_s,
                need_init=False,
            ),
        )
        self._publish_status()

    def _on_grad(self, peer: bytes, msg: StepGrad) -> None:
        try:
            admit_grad(
                msg,
                participants=self.participants,
                open_step=self.step_index,
                max_steps=self.cfg.max_steps,
                received=frozenset(self.grads),
            )
        except Refused as refused:
            self._reject(peer, refused.code, refused.detail, msg.site_id)
            return
        assert self.first_join is not None
        try:
            grad = decode_tensors(msg.payload, self.first_join.spec)
        except WireError as exc:
            self._reject(peer, exc.code, exc.detail, msg.site_id)
            return
        self.grads[msg.site_id] = Grad(weight=msg.weight, loss=msg.loss, grad=grad)

    def _on_eval(self, peer: bytes, msg: Eval) -> None:
        if not np.isfinite(msg.val_loss):
            self._reject(peer, ErrorCode.NON_FINITE, f"val_loss {msg.val_loss}", msg.site_id)
            return
        if msg.global_version in self.val_losses:
            return
        self.val_losses[msg.global_version] = msg.val_loss
        log.info(
            "[ddp site=%s step=%d] val_loss=%.4f", msg.site_id, msg.global_version, msg.val_loss
        )
        self._publish_status()

    # ---- the tick: decisions carried out -----------------------------------------------------

    def snapshot(self, now: float) -> Snapshot:
        return Snapshot(
            joined=self._alive(now),
            participants=self.participants,
            step=self.step_index,
            received=frozenset(self.grads),
            final_eval_asked_at=self._final_eval_asked_at,
            have_final_eval=self.cfg.max_steps in self.val_losses,
        )

    def tick(self) -> None:
        if self.finished:
            return
        now = self.clock()
        if now - self._status.published_at > 1.0:
            self._publish_status()
        action, why = decide(now, self.snapshot(now), self.cfg)
        if action is Action.START:
            self._start_run(now, why)
        elif action is Action.REDUCE:
            self._reduce(now)
        elif action is Action.FINISH:
            self._finish(now, why, aborted=False)
        elif action is Action.ABORT:
            self._finish(now, why, aborted=True)

    def _start_run(self, now: float, why: str) -> None:
        self.participants = self._alive(now)
        self._started_at = now
        log.info("[ddp] run starts: %s; participants=%s", why, self.participants)
        self._open_segment(now)

    def _open_segment(self, now: float) -> None:
        """Announce the next segment; at the end of the run, a zero-step one asks for the final
        validation loss."""
        assert self.chan is not None
        starts = segment_starts(
            self.cfg,
            segment=self.segment + 1,
            step=self.step_index,
            participants=self.participants,
            evaluated=self.step_index in self.val_losses,
        )
        if not starts:
            return
        self.segment += 1
        for site_id, msg in starts.items():
            self._send(self.members[site_id].peer, msg)
        if self.step_index >= self.cfg.max_steps:  # the final evaluation's segment
            self._final_eval_asked_at = now
        self._step_opened_at = now
        self._step_bytes_at_open = (self.chan.stats.bytes_received, self.chan.stats.bytes_sent)

    def _reduce(self, now: float) -> None:
        assert self.chan is not None
        step = self.step_index
        num_sites = len(self.grads)
        t0 = time.perf_counter()
        payload = encode_tensors(mean_gradient(self.grads), get_codec("fp32"))
        reduce_s = time.perf_counter() - t0
        msg = StepMean(step=step, num_sites=num_sites, payload=payload)
        for site_id in self.participants:
            self._send(self.members[site_id].peer, msg)
        total_weight, train_loss = weighted_loss(self.grads)
        entry: dict[str, Any] = {
            "step": step,
            "duration_s": now - self._step_opened_at,
            "reduce_s": reduce_s,
            "train_loss": train_loss,
            "tokens": total_weight,
            "wire_bytes_in": self.chan.stats.bytes_received - self._step_bytes_at_open[0],
            "wire_bytes_out": self.chan.stats.bytes_sent - self._step_bytes_at_open[1],
        }
        self.history.append(entry)
        self.tokens_total += total_weight
        self.grads.clear()
        self.step_index = step + 1
        log.info(
            "[ddp step=%d] mean of %d gradients sent; train_loss=%.4f %.2fs",
            step,
            num_sites,
            entry["train_loss"],
            entry["duration_s"],
        )
        if self.step_index % self.cfg.segment_steps == 0 or self.step_index == self.cfg.max_steps:
            self._open_segment(now)
            self._publish_status()
        else:
            self._step_opened_at = now
            self._step_bytes_at_open = (
                self.chan.stats.bytes_received,
                self.chan.stats.bytes_sent,
            )

    def _finish(self, now: float, why: str, *, aborted: bool) -> None:
        self.outcome = why
        self.aborted = aborted
        alive = self._alive(now)
        self.members = {s: m for s, m in self.members.items() if s in alive}
        for _site_id, m in sorted(self.members.items()):
            self._send(m.peer, Shutdown(reason=f"{'aborted' if aborted else 'finished'}: {why}"))
        self.finished = True
        self._finished_at = now
        (log.error if aborted else log.info)("[ddp] %s: %s", "aborted" if aborted else "done", why)
        self._publish_status()

    # ---- status ------------------------------------------------------------------------------

    def _publish_status(self) -> None:
        chan = self.chan
        spec: Spec = self.first_join.spec if self.first_join is not None else {}
        run_s = None
        if self._started_at is not None:
            run_s = (self._finished_at or self.clock()) - self._started_at
        status: dict[str, Any] = {
            "kind": "ddp",
            "session_id": self.session_id,
            "endpoint": self.endpoint,
            "finished": self.finished,
            "aborted": self.aborted,
            "outcome": self.outcome,
            "members": sorted(self.members),
            "participants": list(self.participants),
            "steps_completed": self.step_index,
            "max_steps": self.cfg.max_steps,
            "eval_every": self.cfg.eval_every,
            "run_seconds": run_s,
            "tokens_total": self.tokens_total,
            "num_parameters": int(sum(int(np.prod(s)) for s in spec.values())),
            "val_losses": {str(k): v for k, v in sorted(self.val_losses.items())},
            "step_seconds": [h["duration_s"] for h in self.history],
            "history": list(self.history),
            "wire_bytes_in": chan.stats.bytes_received if chan else 0,
            "wire_bytes_out": chan.stats.bytes_sent if chan else 0,
            "rejected": dict(self.rejected + (chan.stats.rejected if chan else Counter())),
        }
        self._status.publish(status)

    def status(self) -> dict[str, Any]:
        """The latest published status (safe to call from another thread)."""
        return self._status.get()
