"""The synchronous data-parallel baseline's coordinator: one all-reduce over the WAN per step.

This module owns the baseline crossdc is compared against. Every inner step each participating
site sends the gradient of its own batch (:class:`~comm.schema.StepGrad`, fp32, weighted by its
tokens); once all of them are in, the coordinator computes the token-weighted mean
(``coordinator.strategy.weighted_mean``, sites in id order, so the mean is a pure function of the
inputs) and broadcasts it (:class:`~comm.schema.StepMean`). Every site applies the same mean with
the same AdamW step, so the sites stay bit-identical and the coordinator holds no parameters.

Protocol, over the same channels as DiLoCo:

- sites ``Join``, declaring their fingerprint, initial state hash and ``capabilities["param_spec"]``
  (``[[name, shape], ...]``); every joiner must match the first one, so all start from the same
  parameters. The run starts once ``min_sites`` have joined; later joiners are refused.
- the run is cut into segments of ``eval_every`` steps (one segment when evaluation is off). Each
  segment opens with a ``RoundStart`` (``round_id`` = segment number, ``global_version`` = steps
  done, ``num_inner_steps`` = steps in the segment); the first participant (by id) is asked to
  ``evaluate`` the model it holds before training the segment. After the last step a segment of
  zero steps asks it for the final validation loss.
- then every site gets ``Shutdown``; a participant that leaves or falls silent ends the run early.

The loop only receives, ticks and sends; :func:`decide` is the pure decision. ``status.json``
(atomic writes) holds steps, per-step timing, wire bytes both ways and the reported val losses.

Run it as ``python -m coordinator.ddp --config FILE``, FILE holding a ``[ddp]`` table.
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from comm.channel import ChannelConfig, RouterChannel
from comm.compress import get_codec
from comm.configio import ConfigError, load_section
from comm.schema import (
    ERROR_MEANINGS,
    Error,
    ErrorCode,
    Eval,
    Heartbeat,
    Join,
    Leave,
    Message,
    RoundStart,
    Shutdown,
    StepGrad,
    StepMean,
    Welcome,
)
from comm.tensors import decode_tensors, encode_tensors
from comm.wire import WireError
from coordinator.state import StatusBoard, write_endpoint
from coordinator.strategy import Arrays, weighted_mean

log = logging.getLogger("crossdc.ddp")

EXIT_OK = 0
EXIT_ABORTED = 1
EXIT_BAD_CONFIG = 2


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """The data-parallel baseline's coordinator; every field can be set in ``[ddp]``."""

    bind: str = "tcp://0.0.0.0:7711"
    """ZeroMQ endpoint the ROUTER binds; port 0 picks a free port (written to endpoint.json)."""
    state_dir: str = "./ddp-state"
    """Where ``endpoint.json`` and ``status.json`` go; empty writes neither."""
    min_sites: int = 2
    """The run starts when this many sites have joined; they are its participants."""
    max_steps: int = 100
    """Inner steps (one gradient all-reduce each) before the run ends."""
    eval_every: int = 10
    """The first participant reports the validation loss every this many steps (and at the
    start and the end); 0 turns evaluation off."""
    site_timeout_s: float = 60.0
    """A participant not heard from this long ends the run (aborted); also the longest wait
    for the final validation loss."""
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    """WAN socket profile."""

    def __post_init__(self) -> None:
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"ddp.bind must be a ZeroMQ endpoint, got {self.bind!r}")
        if self.min_sites < 1:
            raise ValueError(f"ddp.min_sites must be >= 1, got {self.min_sites}")
        if self.max_steps < 1:
            raise ValueError(f"ddp.max_steps must be >= 1, got {self.max_steps}")
        if self.eval_every < 0:
            raise ValueError(f"ddp.eval_every must be >= 0, got {self.eval_every}")
        if not self.site_timeout_s > 0:
            raise ValueError(f"ddp.site_timeout_s must be > 0, got {self.site_timeout_s}")

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)

    @property
    def segment_steps(self) -> int:
        """Steps between two RoundStarts (between two evaluations)."""
        return self.eval_every or self.max_steps


def load_ddp_config(path: str | Path, **explicit: object) -> DDPConfig:
    return load_section(DDPConfig, path, "ddp", **explicit)


# ---- the decision -------------------------------------------------------------------------------


class Action(enum.Enum):
    WAIT = "wait"
    START = "start"
    REDUCE = "reduce"
    FINISH = "finish"
    ABORT = "abort"


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """What :func:`decide` looks at."""

    joined: tuple[str, ...]
    """Sites joined and alive, in id order."""
    participants: tuple[str, ...]
    """The run's sites, empty before it starts."""
    step: int
    """Steps completed (the step whose gradients are being gathered, 0-based)."""
    received: frozenset[str]
    """Participants whose gradient of ``step`` was accepted."""
    final_eval_asked_at: float | None
    """When the final validation loss was requested (None: not yet or evaluation off)."""
    have_final_eval: bool


def decide(now: float, snap: Snapshot, cfg: DDPConfig) -> tuple[Action, str]:
    """The next action of the coordinator and why; a pure function."""
    if not snap.participants:
        if len(snap.joined) >= cfg.min_sites:
            return Action.START, f"{len(snap.joined)} sites joined (min_sites={cfg.min_sites})"
        return Action.WAIT, f"{len(snap.joined)} of min_sites={cfg.min_sites} joined"
    gone = sorted(set(snap.participants) - set(snap.joined))
    if gone:
        return Action.ABORT, f"participant(s) {gone} left or went silent at step {snap.step}"
    if snap.step < cfg.max_steps:
        if snap.received >= set(snap.participants):
            return Action.REDUCE, f"all {len(snap.participants)} gradients of step {snap.step} in"
        missing = sorted(set(snap.participants) - snap.received)
        return Action.WAIT, f"step {snap.step} waits for {missing}"
    if cfg.eval_every == 0 or snap.have_final_eval:
        return Action.FINISH, f"completed {snap.step} steps"
    if snap.final_eval_asked_at is not None and now - snap.final_eval_asked_at > cfg.site_timeout_s:
        return Action.FINISH, f"completed {snap.step} steps; the final val loss never came"
    return Action.WAIT, "waiting for the final validation loss"


# ---- the service --------------------------------------------------------------------------------


@dataclass
class _Member:
    peer: bytes
    last_seen: float


@dataclass(frozen=True)
class _Grad:
    weight: float
    loss: float
    grad: Arrays


def _parse_spec(raw: Any) -> dict[str, tuple[int, ...]]:
    """``capabilities["param_spec"]`` (``[[name, [dims...]], ...]``) as a spec, or ValueError."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("capabilities.param_spec must be a non-empty list of [name, shape]")
    spec: dict[str, tuple[int, ...]] = {}
    for item in raw:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], list | tuple)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in item[1])
        ):
            raise ValueError(f"capabilities.param_spec entry {item!r} is not [name, shape]")
        if item[0] in spec:
            raise ValueError(f"capabilities.param_spec names {item[0]!r} twice")
        spec[item[0]] = tuple(item[1])
    return spec


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
        self.fingerprint: str | None = None
        self.initial_hash: str | None = None
        self.spec: dict[str, tuple[int, ...]] | None = None
        self.step_index = 0
        """Steps completed: the step whose gradients are being gathered."""
        self.segment = 0
        self.grads: dict[str, _Grad] = {}
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
        if self.participants:
            self._reject(
                peer, ErrorCode.UNEXPECTED, f"the run started at {self.participants}", msg.site_id
            )
            return
        try:
            spec = _parse_spec(msg.capabilities.get("param_spec"))
        except ValueError as exc:
            self._reject(peer, ErrorCode.MALFORMED, str(exc), msg.site_id)
            return
        if self.fingerprint is not None and (
            msg.model_fingerprint != self.fingerprint
            or msg.state_hash != self.initial_hash
            or spec != self.spec
        ):
            self._reject(
                peer,
                ErrorCode.MODEL_MISMATCH,
                f"site model {msg.model_fingerprint}/{msg.state_hash} != run's "
                f"{self.fingerprint}/{self.initial_hash}: all sites must start from the same "
                "parameters (same model config and seed)",
                msg.site_id,
            )
            return
        if self.fingerprint is None:
            self.fingerprint, self.initial_hash, self.spec = (
                msg.model_fingerprint,
                msg.state_hash,
                spec,
            )
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
        if msg.site_id not in self.participants:
            self._reject(peer, ErrorCode.UNEXPECTED, "not a participant of the run", msg.site_id)
            return
        if msg.step != self.step_index or self.step_index >= self.cfg.max_steps:
            self._reject(
                peer,
                ErrorCode.STALE_ROUND,
                f"gradient of step {msg.step}, the open step is {self.step_index}",
                msg.site_id,
            )
            return
        if msg.site_id in self.grads:
            self._reject(peer, ErrorCode.DUPLICATE, f"step {msg.step}", msg.site_id)
            return
        if not (np.isfinite(msg.weight) and msg.weight > 0 and np.isfinite(msg.loss)):
            self._reject(
                peer, ErrorCode.NON_FINITE, f"weight {msg.weight} loss {msg.loss}", msg.site_id
            )
            return
        assert self.spec is not None
        try:
            grad = decode_tensors(msg.payload, self.spec)
        except WireError as exc:
            self._reject(peer, exc.code, exc.detail, msg.site_id)
            return
        self.grads[msg.site_id] = _Grad(weight=msg.weight, loss=msg.loss, grad=grad)

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
        num_steps = min(self.cfg.segment_steps, self.cfg.max_steps - self.step_index)
        evaluate = self.cfg.eval_every > 0 and self.step_index not in self.val_losses
        if num_steps == 0 and not evaluate:
            return
        self.segment += 1
        evaluator = self.participants[0]
        reason = (
            f"ddp segment of {num_steps} steps from step {self.step_index}"
            if num_steps
            else f"final evaluation after {self.step_index} steps"
        )
        for site_id in self.participants if num_steps else (evaluator,):
            self._send(
                self.members[site_id].peer,
                RoundStart(
                    round_id=self.segment,
                    global_version=self.step_index,
                    fragment_base_version=self.step_index,
                    fragment=-1,
                    num_fragments=1,
                    num_inner_steps=num_steps,
                    overlap=False,
                    codec="fp32",
                    deadline_s=self.cfg.site_timeout_s,
                    participants=self.participants,
                    evaluate=evaluate and site_id == evaluator,
                    reason=reason,
                ),
            )
        if num_steps == 0:
            self._final_eval_asked_at = now
        self._step_opened_at = now
        self._step_bytes_at_open = (self.chan.stats.bytes_received, self.chan.stats.bytes_sent)

    def _reduce(self, now: float) -> None:
        assert self.chan is not None
        step = self.step_index
        ordered = sorted(self.grads.items())  # site order fixes float summation order
        t0 = time.perf_counter()
        mean = weighted_mean([(g.weight, g.grad) for _, g in ordered])
        payload = encode_tensors(mean, get_codec("fp32"))
        reduce_s = time.perf_counter() - t0
        msg = StepMean(step=step, num_sites=len(ordered), payload=payload)
        for site_id in self.participants:
            self._send(self.members[site_id].peer, msg)
        total_weight = sum(g.weight for _, g in ordered)
        entry: dict[str, Any] = {
            "step": step,
            "duration_s": now - self._step_opened_at,
            "reduce_s": reduce_s,
            "train_loss": sum(g.weight * g.loss for _, g in ordered) / total_weight,
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
            len(ordered),
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
            "num_parameters": int(sum(int(np.prod(s)) for s in (self.spec or {}).values())),
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


# ---- the process --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m coordinator.ddp --config FILE``: serve one run; 0 when it completed."""
    p = argparse.ArgumentParser(
        prog="python -m coordinator.ddp", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", required=True, help="TOML file with a [ddp] table")
    p.add_argument("--log-level", default=os.environ.get("CROSSDC_LOG_LEVEL", "info"))
    args = p.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = load_ddp_config(args.config)
    except ConfigError as exc:
        print(f"coordinator.ddp: bad config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("[ddp] signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    coord = DDPCoordinator(cfg)
    coord.start()
    try:
        coord.run(stop)
    finally:
        coord.close()
    return EXIT_OK if coord.finished and not coord.aborted else EXIT_ABORTED


if __name__ == "__main__":
    sys.exit(main())
