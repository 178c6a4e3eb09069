"""The site agent daemon: one per data center, the site's only WAN endpoint.

It owns the site's side of each round: join, receive the global model, train H inner steps,
send the pseudo-gradient Δ = θ_global − θ_local, apply the global delta the coordinator
broadcasts, check the state hash, and checkpoint. Training runs on the main thread; the
coordinator link (``comm.channel.SiteLink``) runs on its own thread, so heartbeats continue while
the site computes. The trainer is a seam (:class:`SiteTrainer`): a single process here, a
pipeline of stages x replicas under torchrun where the site spans several devices.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from comm.channel import SiteLink
from comm.compress import get_codec
from comm.observe import ObserveServer
from comm.schema import (
    ERROR_MEANINGS,
    Error,
    ErrorCode,
    Eval,
    Global,
    Heartbeat,
    InitParams,
    Join,
    Leave,
    Message,
    RoundStart,
    Shutdown,
    SyncRequest,
    Update,
    Welcome,
)
from comm.tensors import decode_tensors, encode_tensors, spec_of, state_hash
from comm.wire import WireError
from site_agent.config import SiteConfig
from site_agent.data import BatchSampler, ByteCorpus, eval_batches, stdlib_split
from site_agent.metrics import SiteMetrics
from site_agent.model import build_model, model_fingerprint
from site_agent.trainer import LocalTrainer, TrainStats

log = logging.getLogger("crossdc.site")

EXIT_OK = 0
EXIT_FATAL = 3


class SiteTrainer(Protocol):
    """What the agent needs from whatever trains inside the site."""

    def train_steps(self, num_steps: int) -> TrainStats: ...

    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float: ...

    def parameters_numpy(self) -> dict[str, np.ndarray]: ...

    def load_parameters(self, params: Mapping[str, np.ndarray]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def resolve_device(spec: str) -> str:
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"site.device={spec!r} but CUDA is not available")
    return spec


@dataclass
class SiteData:
    train: ByteCorpus
    val: ByteCorpus


def load_site_data(cfg: SiteConfig) -> SiteData:
    """The site's training corpus and the validation corpus (never trained on)."""
    d = cfg.data
    max_bytes = d.max_bytes or None
    if d.source == "stdlib":
        shards, heldout = stdlib_split(d.num_shards)
        train = ByteCorpus.from_stdlib_modules(shards[d.shard_index], max_bytes)
        val = ByteCorpus.from_stdlib_modules(heldout, 4 << 20)
        return SiteData(train, val)
    corpus = ByteCorpus.from_text_dir(d.path, max_bytes)
    if d.val_path:
        return SiteData(corpus, ByteCorpus.from_text_dir(d.val_path, 4 << 20))
    cut = int(len(corpus) * (1 - d.val_fraction))
    return SiteData(
        ByteCorpus(corpus.data[:cut], source=f"{corpus.source}[:{cut}]"),
        ByteCorpus(corpus.data[cut:], source=f"{corpus.source}[{cut}:]"),
    )


def build_local_trainer(cfg: SiteConfig, data: SiteData) -> LocalTrainer:
    device = resolve_device(cfg.device)
    model = build_model(cfg.model, cfg.seed, device=device)
    site_seed = cfg.seed * 1000 + cfg.data.shard_index + 1
    sampler = BatchSampler(
        data.train,
        batch_size=cfg.optim.batch_size,
        context_len=cfg.model.context_len,
        seed=site_seed,
    )
    return LocalTrainer(model=model, sampler=sampler, optim_cfg=cfg.optim, device=device)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_endpoint_file(path: str, timeout_s: float) -> str:
    """Wait for a local coordinator's ``endpoint.json`` and return the endpoint in it."""
    deadline = time.monotonic() + timeout_s
    p = Path(path)
    while True:
        if p.exists():
            try:
                endpoint = json.loads(p.read_text())["endpoint"]
                return str(endpoint).replace("0.0.0.0", "127.0.0.1")
            except (ValueError, KeyError):
                pass  # a half-written file from a non-atomic writer; retry
        if time.monotonic() > deadline:
            raise ValueError(f"site.coordinator_endpoint_file {path!r} did not appear")
        time.sleep(0.1)


class SiteAgent:
    """One site. ``start``, ``run`` (returns an exit code), ``close``."""

    def __init__(
        self,
        cfg: SiteConfig,
        *,
        trainer: SiteTrainer,
        val_batches: list[tuple[torch.Tensor, torch.Tensor]],
        metrics: SiteMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.val_batches = val_batches
        self.metrics = metrics or SiteMetrics(cfg.site_id)
        self.fingerprint = model_fingerprint(cfg.model)
        self.site_id = cfg.site_id
        self.global_params: dict[str, np.ndarray] = {
            k: v.copy() for k, v in trainer.parameters_numpy().items()
        }
        self.global_version = -1
        self.tokens_since_sync = 0
        self.session_id = ""
        self.link: SiteLink | None = None
        self.http: ObserveServer | None = None
        self._pending_round: RoundStart | None = None
        self._last_join = 0.0
        self._started = time.monotonic()
        self._first_round_at: float | None = None
        self._compute_s = 0.0
        self._stall_s = 0.0
        self._bytes_seen = (0, 0)
        self._last_val: float | None = None
        self._rounds_sent = 0

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        return self.cfg.state_path / "checkpoint.pt"

    def start(self) -> None:
        self.cfg.state_path.mkdir(parents=True, exist_ok=True)
        self._load_checkpoint()
        endpoint = self.cfg.coordinator or read_endpoint_file(
            self.cfg.coordinator_endpoint_file, timeout_s=120
        )
        self.link = SiteLink(
            self.cfg.channel,
            identity=self.site_id,
            endpoint=endpoint,
            heartbeat=lambda: Heartbeat(site_id=self.site_id, global_version=self.global_version),
            on_reject=lambda _p, code, _d: self.metrics.rejected(code.name.lower()),
        )
        self.link.start()
        if self.cfg.metrics_port:
            self.http = ObserveServer(
                registry=self.metrics.registry,
                status=self.status,
                host=self.cfg.metrics_host,
                port=self.cfg.metrics_port,
            )
            self.http.start()
        log.info(
            "[site=%s] connecting to %s; v%d; %d parameters",
            self.site_id,
            endpoint,
            self.global_version,
            sum(v.size for v in self.global_params.values()),
        )

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.http is not None:
            self.http.close()
            self.http = None

    def _load_checkpoint(self) -> None:
        if not self.checkpoint_path.exists():
            return
        ckpt = torch.load(self.checkpoint_path, weights_only=True)
        self.trainer.load_state_dict(ckpt["trainer"])
        self.global_params = {k: v.numpy().copy() for k, v in ckpt["global_params"].items()}
        self.global_version = int(ckpt["global_version"])
        self.tokens_since_sync = int(ckpt["tokens_since_sync"])
        log.info("[site=%s] resumed from checkpoint at v%d", self.site_id, self.global_version)

    def save_checkpoint(self) -> None:
        ckpt = {
            "global_version": self.global_version,
            "global_params": {k: torch.from_numpy(v.copy()) for k, v in self.global_params.items()},
            "trainer": self.trainer.state_dict(),
            "tokens_since_sync": self.tokens_since_sync,
        }
        _atomic_torch_save(ckpt, self.checkpoint_path)

    # ---- the loop ----------------------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        assert self.link is not None
        self.link.send(msg)

    def _join(self) -> None:
        self._last_join = time.monotonic()
        self._send(
            Join(
                site_id=self.site_id,
                model_fingerprint=self.fingerprint,
                global_version=self.global_version,
                state_hash=state_hash(self.global_params),
                capabilities={
                    "stages": self.cfg.stages,
                    "replicas": self.cfg.replicas,
                    "device": resolve_device(self.cfg.device),
                    "codecs": ["fp32"],
                },
            )
        )

    def run(self) -> int:
        """Serve rounds until the coordinator says Shutdown; return the process exit code."""
        assert self.link is not None, "start() first"
        self._join()
        while True:
            t0 = time.monotonic()
            msg = self.link.recv(0.5)
            if self._first_round_at is not None:
                self._stall_s += time.monotonic() - t0
                self.metrics.stalled(time.monotonic() - t0)
            self._publish_link_metrics()
            if msg is None:
                continue
            code = self._dispatch(msg)
            if code is not None:
                return code

    def _dispatch(self, msg: Message) -> int | None:
        if isinstance(msg, Welcome):
            self.session_id = msg.session_id
            log.info(
                "[site=%s] welcomed by session %s (global v%d)",
                self.site_id,
                msg.session_id,
                msg.global_version,
            )
            if msg.need_init:
                self._send(
                    InitParams(
                        site_id=self.site_id,
                        model_fingerprint=self.fingerprint,
                        payload=encode_tensors(self.global_params, get_codec("fp32")),
                    )
                )
                self.global_version = 0
        elif isinstance(msg, Global):
            self._on_global(msg)
        elif isinstance(msg, RoundStart):
            if msg.global_version != self.global_version:
                log.warning(
                    "[site=%s round=%d] round base v%d but I hold v%d: asking for the model",
                    self.site_id,
                    msg.round_id,
                    msg.global_version,
                    self.global_version,
                )
                self._pending_round = msg
                self._send(SyncRequest(site_id=self.site_id, global_version=self.global_version))
            else:
                self._run_round(msg)
        elif isinstance(msg, Error):
            return self._on_error(msg)
        elif isinstance(msg, Shutdown):
            log.info("[site=%s] shutdown: %s", self.site_id, msg.reason)
            self.save_checkpoint()
            return EXIT_OK
        else:
            log.warning("[site=%s] ignoring unexpected %s", self.site_id, type(msg).__name__)
        return None

    def _on_error(self, msg: Error) -> int | None:
        try:
            code = ErrorCode(msg.code)
        except ValueError:
            log.warning("[site=%s] coordinator error %d: %s", self.site_id, msg.code, msg.detail)
            return None
        self.metrics.rejected(f"remote_{code.name.lower()}")
        if code is ErrorCode.NOT_JOINED:
            if time.monotonic() - self._last_join > 1.0:
                log.info("[site=%s] coordinator does not know us: joining again", self.site_id)
                self._join()
            return None
        if code is ErrorCode.MODEL_MISMATCH:
            log.error("[site=%s] %s", self.site_id, msg.detail)
            return EXIT_FATAL
        log.warning(
            "[site=%s] coordinator rejected: %s (%s)",
            self.site_id,
            msg.detail,
            ERROR_MEANINGS[code],
        )
        return None

    def _on_global(self, msg: Global) -> None:
        try:
            if msg.is_full:
                decoded = decode_tensors(msg.payload, spec_of(self.global_params))
                new = {k: np.array(v, dtype=np.float32) for k, v in decoded.items()}
            else:
                if msg.base_version != self.global_version:
                    log.warning(
                        "[site=%s] delta from v%d but I hold v%d: asking for the model",
                        self.site_id,
                        msg.base_version,
                        self.global_version,
                    )
                    self._send(
                        SyncRequest(site_id=self.site_id, global_version=self.global_version)
                    )
                    return
                delta = decode_tensors(msg.payload, spec_of(self.global_params))
                new = {k: self.global_params[k] + delta[k] for k in self.global_params}
        except WireError as exc:
            self.metrics.rejected(exc.code.name.lower())
            log.warning("[site=%s] bad global model: %s", self.site_id, exc)
            self._send(SyncRequest(site_id=self.site_id, global_version=self.global_version))
            return
        digest = state_hash(new)
        if digest != msg.state_hash:
            self.metrics.rejected("hash_mismatch")
            log.warning(
                "[site=%s] state hash %s != coordinator %s at v%d: asking for the model",
                self.site_id,
                digest,
                msg.state_hash,
                msg.global_version,
            )
            self._send(SyncRequest(site_id=self.site_id, global_version=self.global_version))
            return
        self.global_params = new
        self.global_version = msg.global_version
        self.trainer.load_parameters(new)
        self.tokens_since_sync = 0
        self.save_checkpoint()
        self.metrics.global_version(self.global_version)
        log.info(
            "[site=%s] now at v%d (%s)",
            self.site_id,
            self.global_version,
            "full" if msg.is_full else "delta",
        )
        if msg.evaluate:
            self._evaluate()
        pending = self._pending_round
        if pending is not None and pending.global_version == self.global_version:
            self._pending_round = None
            self._run_round(pending)

    def _evaluate(self) -> None:
        loss = self.trainer.evaluate(self.val_batches)
        self._last_val = loss
        self.metrics.val_loss(loss)
        tokens = sum(int(y.numel()) for _, y in self.val_batches)
        self._send(
            Eval(
                site_id=self.site_id,
                global_version=self.global_version,
                val_loss=loss,
                num_tokens=tokens,
            )
        )
        log.info("[site=%s] val_loss=%.4f at v%d", self.site_id, loss, self.global_version)

    def _run_round(self, rs: RoundStart) -> None:
        if self._first_round_at is None:
            self._first_round_at = time.monotonic()
        if rs.evaluate:
            self._evaluate()
        stats = self.trainer.train_steps(rs.num_inner_steps)
        self._compute_s += stats.compute_seconds
        self.tokens_since_sync += stats.tokens
        self.metrics.inner(stats.steps, stats.tokens, stats.compute_seconds, stats.loss_mean)
        local = self.trainer.parameters_numpy()
        delta = {k: self.global_params[k] - local[k] for k in self.global_params}
        if not all(np.isfinite(v).all() for v in delta.values()) or not np.isfinite(
            stats.loss_mean
        ):
            # Never send a corrupt update: drop this round's local progress and start over.
            self.metrics.rejected("non_finite_local")
            log.error(
                "[site=%s round=%d] local training diverged (NaN/Inf): resetting",
                self.site_id,
                rs.round_id,
            )
            self.trainer.load_parameters(self.global_params)
            self.tokens_since_sync = 0
            return
        payload = encode_tensors(delta, get_codec(rs.codec))
        self._send(
            Update(
                site_id=self.site_id,
                round_id=rs.round_id,
                global_version=self.global_version,
                weight=float(self.tokens_since_sync),
                train_loss=stats.loss_mean,
                compute_seconds=stats.compute_seconds,
                payload=payload,
            )
        )
        self._rounds_sent += 1
        self.metrics.round_sent()
        wall = time.monotonic() - self._first_round_at
        self.metrics.utilization(self._compute_s / wall if wall > 0 else 0.0)
        log.info(
            "[site=%s round=%d] sent update: %d steps loss=%.4f %.1fs compute",
            self.site_id,
            rs.round_id,
            stats.steps,
            stats.loss_mean,
            stats.compute_seconds,
        )

    def _publish_link_metrics(self) -> None:
        if self.link is None:
            return
        sent, received = self.link.stats.bytes_sent, self.link.stats.bytes_received
        self.metrics.wire(sent - self._bytes_seen[0], received - self._bytes_seen[1])
        self._bytes_seen = (sent, received)

    def leave(self, reason: str) -> None:
        self._send(Leave(site_id=self.site_id, reason=reason))

    def status(self) -> dict[str, Any]:
        wall = time.monotonic() - self._first_round_at if self._first_round_at else 0.0
        return {
            "site_id": self.site_id,
            "session_id": self.session_id,
            "global_version": self.global_version,
            "rounds_sent": self._rounds_sent,
            "compute_seconds": self._compute_s,
            "stall_seconds": self._stall_s,
            "compute_utilization": self._compute_s / wall if wall else 0.0,
            "val_loss": self._last_val,
        }


def build_agent(cfg: SiteConfig) -> SiteAgent:
    """Assemble a single-process site from its config (data, model, trainer)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    data = load_site_data(cfg)
    trainer = build_local_trainer(cfg, data)
    val = eval_batches(
        data.val, cfg.eval_batches, cfg.eval_batch_size, cfg.model.context_len, seed=0
    )
    return SiteAgent(cfg, trainer=trainer, val_batches=val)
