"""The inner loop driver: serve rounds as the round state machine (``site_agent.rounds``)
decides, train each slot of inner steps, and handle messages between steps.

Functions of a :class:`~site_agent.agent.SiteAgent`, bound onto it as its methods.
"""

from __future__ import annotations

import logging
import time
from dataclasses import astuple, replace
from typing import TYPE_CHECKING

from comm.wire.schema import RoundStart
from site_agent.exits import EXIT_FATAL, EXIT_OK
from site_agent.rounds import Drop, Send, Stop, Train, Wait
from site_agent.trainer import NonFiniteLossError, TrainStats

if TYPE_CHECKING:
    from site_agent.agent import SiteAgent

log = logging.getLogger("crossdc.site")


def run(self: SiteAgent) -> int:
    """Serve rounds until the coordinator says Shutdown; return the process exit code."""
    assert self.link is not None, "start() first"
    self._join()
    while True:
        code = self._drain()
        if code is not None:
            return code
        decision = self.rounds.next_action()
        if isinstance(decision, Stop):
            return EXIT_OK
        if isinstance(decision, Drop):
            # A plan that can no longer be met on time (cancelled, or its round closed
            # without us). Progress is not lost: it goes out with the next update.
            log.debug("[site=%s round=%d] dropped: %s", self.site_id, *astuple(decision))
        elif isinstance(decision, Wait):
            code = self._wait(0.5)
        else:
            assert isinstance(decision, Train)
            try:
                code = self._round(decision.plan)
            except NonFiniteLossError as exc:
                # Nothing of the diverged training is sent; the checkpoint keeps the last
                # global model, so a restart resumes from it.
                log.error("[site=%s] %s", self.site_id, exc)
                self.leave(f"training diverged at inner step {exc.step}")
                self._write_site_status()
                return EXIT_FATAL
        if code is not None:
            return code


def play_round(self: SiteAgent, rs: RoundStart) -> int | None:
    if self._first_round_at is None:
        self._first_round_at = self.clock()
    if rs.evaluate and self.global_version == rs.global_version:
        self._evaluate()
    stats, code = self._train_slot(rs.num_inner_steps)
    if code is not None:
        return code
    for f in range(rs.num_fragments):
        self._tokens[f] = self._tokens.get(f, 0) + stats.tokens
    # The plan: this fragment's previous result must be applied before we send on top of it.
    while isinstance(decision := self.rounds.slot_done(), Wait):
        code = self._wait(0.5)
        if code is not None:
            return code
    if isinstance(decision, Send):
        self._send_update(rs, stats)
    # else dropped (cancelled): the progress stays local and goes out with the next update
    return None


def train_slot(self: SiteAgent, num_steps: int) -> tuple[TrainStats, int | None]:
    """Train ``num_steps`` inner steps, applying results that land in between."""
    steps = tokens = 0
    loss_sum = seconds = last = 0.0
    while steps < num_steps:
        n = min(self.cfg.steps_per_poll, num_steps - steps)
        # Nothing of ours on the wire or waiting for its result; the run's first call is
        # warm-up (allocations, first kernels), no measure of the steady rate.
        sync_free = not self._sent and self._steps_done > 0
        t0 = self.clock()
        s = self.trainer.train_steps(n)
        if self.cfg.fault_slow_step_s:
            # A deliberately slow accelerator: its extra time counts as compute.
            time.sleep(self.cfg.fault_slow_step_s * s.steps)
            s = replace(s, compute_seconds=s.compute_seconds + self.cfg.fault_slow_step_s * s.steps)
        if sync_free:
            self._free_steps += s.steps
            self._free_s += self.clock() - t0
        steps += s.steps
        self._steps_done += s.steps
        tokens += s.tokens
        loss_sum += s.loss_mean * s.steps
        seconds += s.compute_seconds
        last = s.loss_last
        code = self._drain()
        if code is not None:
            return TrainStats(steps, tokens, loss_sum / max(1, steps), last, seconds), code
    self._compute_s += seconds
    stats = TrainStats(steps, tokens, loss_sum / max(1, steps), last, seconds)
    self.metrics.inner(stats.steps, stats.tokens, stats.compute_seconds, stats.loss_mean)
    return stats, None


def stop_if_requested(self: SiteAgent) -> int | None:
    """A stop asked for from outside (a signal to a pipelined site's leader): leave the
    federation between two inner steps, so the other ranks are never left inside a step."""
    if self.stop_reason is None:
        return None
    log.info("[site=%s] stopping: %s", self.site_id, self.stop_reason)
    self.leave(self.stop_reason)
    self.save_checkpoint()
    self._write_site_status()
    return EXIT_OK


def drain(self: SiteAgent) -> int | None:
    """Handle every queued message without waiting; an exit code ends the run."""
    assert self.link is not None
    if (code := stop_if_requested(self)) is not None:
        return code
    while (msg := self.link.recv(0.0)) is not None:
        code = self._dispatch(msg)
        if code is not None:
            return code
    self._publish_link_metrics()
    return None


def wait(self: SiteAgent, timeout_s: float) -> int | None:
    """Block for the next message (time counted as stalled on sync once rounds run)."""
    assert self.link is not None
    if (code := stop_if_requested(self)) is not None:
        return code
    t0 = time.monotonic()
    msg = self.link.recv(timeout_s)
    waited = time.monotonic() - t0
    if self._first_round_at is not None:
        self._stall_s += waited
        self.metrics.stalled(waited)
    self._publish_link_metrics()
    return None if msg is None else self._dispatch(msg)
