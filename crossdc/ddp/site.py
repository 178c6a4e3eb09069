"""A site of the synchronous data-parallel baseline: one gradient all-reduce over the WAN per step.

This module owns a baseline site's loop (the protocol is in ``crossdc.ddp``'s docstring). Every
inner step the site computes the gradient of its own batch (:meth:`DDPTrainer.compute_gradient`),
sends it (``StepGrad``, fp32, weight = tokens in the batch), waits for the coordinator's
token-weighted mean (``StepMean``) and takes the AdamW step on it
(:meth:`DDPTrainer.apply_gradient`). All sites start from the same parameters (same model config
and seed) and apply the same bytes, so they stay bit-identical; the final
:func:`~comm.wire.tensors.state_hash` is written to ``ddp-result.json`` in the state dir with the
site's compute and wall seconds (``compute_utilization``).

Data, model and sampler are built exactly as for the DiLoCo site (``load_site_data``,
``build_local_trainer``), so both train on the same batches of the same model. The coordinator
link runs on its own thread (``comm.transport.dealer.SiteLink``); training runs on the caller's.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from comm.codecs.base import NonFiniteError
from comm.codecs.registry import get_codec
from comm.durable import atomic_write
from comm.transport.dealer import SiteLink
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
    RoundStart,
    Shutdown,
    StepGrad,
    StepMean,
    Welcome,
)
from comm.wire.tensors import decode_tensors, encode_tensors, spec_of, state_hash
from crossdc.bench.local_trainer import build_local_trainer, bytegpt_options, load_site_data
from crossdc.ddp.trainer import Batch, DDPTrainer
from site_agent.config import SiteConfig, resolve_device
from site_agent.exits import EXIT_FATAL, EXIT_OK
from site_agent.jobs.bytegpt.data import eval_batches
from site_agent.jobs.bytegpt.model import model_fingerprint
from site_agent.session import read_endpoint_file

log = logging.getLogger("crossdc.site.ddp")

RESULT_FILE = "ddp-result.json"


class _Stop(Exception):
    """Ends ``run`` with an exit code (Shutdown, or a state the site cannot continue from)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class DDPSite:
    """One site of the baseline. ``start``, ``run`` (returns an exit code), ``close``."""

    def __init__(
        self,
        cfg: SiteConfig,
        *,
        trainer: DDPTrainer,
        val_batches: Sequence[Batch],
    ) -> None:
        self.cfg = cfg
        self.site_id = cfg.site_id
        self.trainer = trainer
        self.val_batches = list(val_batches)
        self.fingerprint = model_fingerprint(bytegpt_options(cfg).model)
        params = trainer.parameters_numpy()
        self.spec = spec_of(params)
        self.initial_hash = state_hash(params)
        self.link: SiteLink | None = None
        self.session_id = ""
        self.steps_done = 0
        """Mean gradients applied; equals the coordinator's step counter while in sync."""
        self.tokens = 0
        self.compute_seconds = 0.0
        """Gradient computation plus optimizer steps: the work DDP cannot overlap with the WAN."""
        self.errors: Counter[str] = Counter()
        """Rejections: ``remote_<code>`` from the coordinator, others found locally."""
        self.val_losses: dict[int, float] = {}
        self.shutdown_reason = ""
        self.stop_requested = threading.Event()
        """Set from any thread (a signal handler) to leave and end ``run`` at its next receive."""
        self._run_started: float | None = None
        self._last_step_at: float | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return self.cfg.state_path

    @property
    def wall_seconds(self) -> float:
        """From the run's first RoundStart to the last applied step."""
        if self._run_started is None or self._last_step_at is None:
            return 0.0
        return self._last_step_at - self._run_started

    @property
    def compute_utilization(self) -> float:
        wall = self.wall_seconds
        return self.compute_seconds / wall if wall > 0 else 0.0

    def start(self) -> None:
        self.state_path.mkdir(parents=True, exist_ok=True)
        endpoint = self.cfg.coordinator or read_endpoint_file(
            self.cfg.coordinator_endpoint_file, timeout_s=120
        )
        self.link = SiteLink(
            self.cfg.channel,
            identity=self.site_id,
            endpoint=endpoint,
            heartbeat=lambda: Heartbeat(
                site_id=self.site_id, global_version=self.steps_done, sent_at=time.monotonic()
            ),
            on_reject=lambda _p, code, _d: self.errors.update([code.name.lower()]),
        )
        self.link.start()
        log.info("[site=%s] ddp: connecting to %s", self.site_id, endpoint)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def __enter__(self) -> DDPSite:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the loop ----------------------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        assert self.link is not None
        self.link.send(msg)

    def _recv(self, timeout_s: float) -> Message | None:
        assert self.link is not None
        if self.stop_requested.is_set():
            log.info("[site=%s step=%d] stopping on request", self.site_id, self.steps_done)
            self.leave("stopped")
            raise _Stop(EXIT_OK)
        return self.link.recv(timeout_s)

    def _join(self) -> None:
        self._send(
            Join(
                site_id=self.site_id,
                model_fingerprint=self.fingerprint,
                global_version=self.steps_done,
                state_hash=self.initial_hash,
                capabilities={
                    "mode": "ddp",
                    "device": resolve_device(self.cfg.device),
                    "param_spec": [[name, list(shape)] for name, shape in self.spec.items()],
                },
            )
        )

    def run(self) -> int:
        """Serve the run until the coordinator says Shutdown; return the process exit code."""
        assert self.link is not None, "start() first"
        self._join()
        try:
            while True:
                msg = self._recv(0.5)
                if msg is None:
                    continue
                if isinstance(msg, RoundStart):
                    self._run_segment(msg)
                elif isinstance(msg, Welcome):
                    self.session_id = msg.session_id
                    log.info("[site=%s] welcomed by session %s", self.site_id, msg.session_id)
                else:
                    self._on_other(msg)
        except _Stop as stop:
            return stop.code

    def _on_other(self, msg: Message) -> None:
        """Messages that may arrive at any point: Error, Shutdown; anything else is ignored."""
        if isinstance(msg, Shutdown):
            self.shutdown_reason = msg.reason
            log.info("[site=%s] shutdown: %s", self.site_id, msg.reason)
            self._write_result()
            self._send(Leave(site_id=self.site_id, reason="shutdown"))
            raise _Stop(EXIT_OK)
        if isinstance(msg, Error):
            self._on_error(msg)
            return
        log.warning(
            "[site=%s step=%d] ignoring unexpected %s",
            self.site_id,
            self.steps_done,
            type(msg).__name__,
        )

    def _on_error(self, msg: Error) -> None:
        try:
            code = ErrorCode(msg.code)
        except ValueError:
            self.errors["remote_unknown"] += 1
            log.warning("[site=%s] coordinator error %d: %s", self.site_id, msg.code, msg.detail)
            return
        if code is ErrorCode.NOT_JOINED and not self.session_id:
            return  # a heartbeat that overtook our Join; the Welcome is on its way
        self.errors[f"remote_{code.name.lower()}"] += 1
        log.warning("[site=%s] coordinator rejected: %s", self.site_id, msg.detail)
        if not self.session_id:
            # Before the Welcome, an Error is the answer to our Join: we are not admitted.
            log.error("[site=%s] not admitted to the run: giving up", self.site_id)
            raise _Stop(EXIT_FATAL)
        if code is ErrorCode.NOT_JOINED:
            # A site that is not (or no longer) a participant cannot catch up: the run keeps no
            # parameters to send it.
            log.error("[site=%s] %s: giving up", self.site_id, ERROR_MEANINGS[code])
            raise _Stop(EXIT_FATAL)

    def _run_segment(self, rs: RoundStart) -> None:
        if rs.global_version != self.steps_done:
            log.error(
                "[site=%s segment=%d] starts at step %d but I am at %d: out of sync",
                self.site_id,
                rs.round_id,
                rs.global_version,
                self.steps_done,
            )
            raise _Stop(EXIT_FATAL)
        if self._run_started is None:
            self._run_started = time.monotonic()
            self._last_step_at = self._run_started
        if rs.evaluate:
            self._evaluate()
        for _ in range(rs.num_inner_steps):
            self._one_step()

    def _one_step(self) -> None:
        step = self.steps_done
        t0 = time.perf_counter()
        g = self.trainer.compute_gradient()
        self.compute_seconds += time.perf_counter() - t0
        try:
            payload = encode_tensors(g.grads, get_codec("fp32"))
        except NonFiniteError as exc:
            # The run cannot skip a step for one site: every site must apply the same means.
            self.errors["non_finite_local"] += 1
            log.error("[site=%s step=%d] gradient is not finite: %s", self.site_id, step, exc)
            raise _Stop(EXIT_FATAL) from None
        self._send(
            StepGrad(
                site_id=self.site_id,
                step=step,
                weight=float(g.tokens),
                loss=g.loss,
                payload=payload,
            )
        )
        mean = self._wait_mean(step)
        t0 = time.perf_counter()
        self.trainer.apply_gradient(mean)
        self.compute_seconds += time.perf_counter() - t0
        self.tokens += g.tokens
        self.steps_done = step + 1
        self._last_step_at = time.monotonic()
        log.debug("[site=%s step=%d] applied; loss=%.4f", self.site_id, step, g.loss)

    def _wait_mean(self, step: int) -> dict[str, np.ndarray]:
        while True:
            msg = self._recv(0.5)
            if msg is None:
                continue
            if isinstance(msg, StepMean):
                if msg.step != step:
                    self.errors["stale_mean"] += 1
                    log.warning(
                        "[site=%s step=%d] ignoring the mean of step %d",
                        self.site_id,
                        step,
                        msg.step,
                    )
                    continue
                try:
                    return dict(decode_tensors(msg.payload, self.spec))
                except WireError as exc:
                    self.errors[exc.code.name.lower()] += 1
                    log.error("[site=%s step=%d] bad mean gradient: %s", self.site_id, step, exc)
                    raise _Stop(EXIT_FATAL) from None
            self._on_other(msg)

    def _evaluate(self) -> None:
        if not self.val_batches:
            return
        loss = self.trainer.evaluate(self.val_batches)
        self.val_losses[self.steps_done] = loss
        self._send(
            Eval(
                site_id=self.site_id,
                global_version=self.steps_done,
                val_loss=loss,
            )
        )
        log.info("[site=%s step=%d] val_loss=%.4f", self.site_id, self.steps_done, loss)

    def leave(self, reason: str) -> None:
        self._send(Leave(site_id=self.site_id, reason=reason))

    # ---- results -----------------------------------------------------------------------------

    def result(self) -> dict[str, Any]:
        """What the site did, with its final state hash (equal on every site of a run)."""
        link = self.link
        return {
            "site_id": self.site_id,
            "steps": self.steps_done,
            "tokens": self.tokens,
            "compute_seconds": self.compute_seconds,
            "wall_seconds": self.wall_seconds,
            "compute_utilization": self.compute_utilization,
            "state_hash": state_hash(self.trainer.parameters_numpy()),
            "val_losses": {str(k): v for k, v in sorted(self.val_losses.items())},
            "errors": dict(self.errors),
            "wire_bytes_sent": link.stats.bytes_sent if link else 0,
            "wire_bytes_received": link.stats.bytes_received if link else 0,
            "link_rtt_s": link.stats.rtt_s if link else 0.0,
            "shutdown_reason": self.shutdown_reason,
        }

    def _write_result(self) -> None:
        body = json.dumps(self.result(), indent=1, sort_keys=True).encode()
        atomic_write(self.state_path / RESULT_FILE, body)


def build_ddp_site(cfg: SiteConfig) -> DDPSite:
    """Assemble a baseline site from its config exactly like the DiLoCo site (data, model)."""
    if cfg.stages != 1 or cfg.replicas != 1:
        raise ValueError(
            f"site.stages={cfg.stages} site.replicas={cfg.replicas}: "
            "the data-parallel baseline runs single-process sites (1 and 1)"
        )
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    data = load_site_data(cfg)
    trainer = DDPTrainer(build_local_trainer(cfg, data))
    opts = bytegpt_options(cfg)
    val = eval_batches(
        data.val, opts.eval_batches, opts.eval_batch_size, opts.model.context_len, seed=0
    )
    return DDPSite(cfg, trainer=trainer, val_batches=val)
