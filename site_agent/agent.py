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
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from comm.channel import SiteLink
from comm.compress import EncodedTensor, NonFiniteError, get_codec
from comm.feedback import ErrorFeedback
from comm.keys import AuthError, SiteKit, load_site_kit, verify_blob
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
    RoundCancel,
    RoundStart,
    Shutdown,
    SyncRequest,
    Update,
    Welcome,
)
from comm.secagg import Peer, SecAggSession, x25519_from_curve_secret, x25519_public_bytes
from comm.tensors import (
    decode_tensors,
    encode_tensors,
    fragments,
    global_signed_bytes,
    spec_of,
    state_hash,
)
from comm.wire import WireError
from site_agent.authwatch import EXIT_AUTH_REFUSED, AuthWatch
from site_agent.config import SiteConfig
from site_agent.data import BatchSampler, ByteCorpus, eval_batches, sampler_seed, stdlib_split
from site_agent.metrics import SiteMetrics
from site_agent.model import build_model, model_fingerprint
from site_agent.privacy import PrivacyAccountant, new_noise_generator, privatize
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
    site_seed = sampler_seed(cfg.seed, cfg.data.shard_index)
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


@dataclass(frozen=True)
class _Sent:
    """One fragment's last send: its local values (the reference for merging the result) and the
    inner-step count then (the merge delay is counted from it)."""

    local: dict[str, np.ndarray]
    at_step: int


class SiteAgent:
    """One site. ``start``, ``run`` (returns an exit code), ``close``.

    The loop trains one slot of inner steps per planned round, then sends the pseudo-gradient of
    the round's fragment. With ``overlap`` it starts the next slot at once and merges the global
    fragment whenever it lands (between inner steps), keeping the local progress made since the
    send: θ_local[f] ← θ_local[f] + (θ_global_new[f] − θ_local_at_send[f]). It blocks on the WAN
    only when the plan says so: no overlap, or a fragment's previous result not yet applied.
    """

    def __init__(
        self,
        cfg: SiteConfig,
        *,
        trainer: SiteTrainer,
        val_batches: list[tuple[torch.Tensor, torch.Tensor]],
        metrics: SiteMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.auth = AuthWatch()
        self._echoes_seen = 0
        self.trainer = trainer
        self.val_batches = val_batches
        self.metrics = metrics or SiteMetrics(cfg.site_id)
        self.fingerprint = model_fingerprint(cfg.model)
        self.site_id = cfg.site_id
        self.global_params: dict[str, np.ndarray] = {
            k: v.copy() for k, v in trainer.parameters_numpy().items()
        }
        self.global_version = -1
        self.session_id = ""
        self.link: SiteLink | None = None
        self.http: ObserveServer | None = None
        self.feedback = ErrorFeedback()
        self.kit: SiteKit | None = (
            load_site_kit(cfg.security.kit_dir, site_id=cfg.site_id)
            if cfg.security.kit_dir
            else None
        )
        self.accountant = PrivacyAccountant(cfg.privacy) if cfg.privacy is not None else None
        # Secure aggregation: one X25519 key per process, announced at join; the masking session
        # is bound to the coordinator's session (every site derives pair keys from the same id).
        self._secagg_key = X25519PrivateKey.generate() if cfg.secure_aggregation else None
        self.secagg: SecAggSession | None = None
        # Secure aggregation: the unmasked update of each round, kept for a re-run.
        self._unmasked: dict[int, tuple[int, dict[str, np.ndarray], float, TrainStats]] = {}
        self._noise = new_noise_generator()
        self._pending: deque[RoundStart] = deque()
        self._cancelled: set[int] = set()
        self._awaiting_result: int | None = None
        # Per fragment: our last send, and the tokens trained since that fragment was last sent.
        self._sent: dict[int, _Sent] = {}
        self._steps_done = 0  # inner steps taken so far
        self._tokens: dict[int, int] = {}
        self._layout: tuple[int, list[list[str]]] = (0, [])
        self._last_join = 0.0
        self._first_round_at: float | None = None
        self._compute_s = 0.0
        self._stall_s = 0.0
        self._eval_s = 0.0
        self._bytes_seen = (0, 0)
        self._last_val: float | None = None
        self._rounds_sent = 0
        self._last_send_at: float | None = None

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
        channel_cfg = self.cfg.channel
        if self.kit is not None:
            channel_cfg = dc_replace(channel_cfg, curve=self.kit.curve)
        else:
            log.warning(
                "[site=%s] INSECURE MODE: no encryption, no authentication. "
                "For loopback experiments only.",
                self.site_id,
            )
        self.link = SiteLink(
            channel_cfg,
            identity=self.site_id,
            endpoint=endpoint,
            heartbeat=lambda: Heartbeat(
                site_id=self.site_id, global_version=self.global_version, sent_at=time.monotonic()
            ),
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
        self.feedback.load_state_dict({k: v.numpy() for k, v in ckpt["feedback"].items()})
        # Progress not yet synced when the process stopped is not trusted: restart from the
        # global model (the optimizer state and data cursor are kept).
        self.trainer.load_parameters(self.global_params)
        log.info("[site=%s] resumed from checkpoint at v%d", self.site_id, self.global_version)

    def save_checkpoint(self) -> None:
        ckpt = {
            "global_version": self.global_version,
            "global_params": {k: torch.from_numpy(v.copy()) for k, v in self.global_params.items()},
            "trainer": self.trainer.state_dict(),
            "feedback": {k: torch.from_numpy(v) for k, v in self.feedback.state_dict().items()},
        }
        _atomic_torch_save(ckpt, self.checkpoint_path)

    # ---- messages ----------------------------------------------------------------------------

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
                    **(
                        {"secagg_session_public": x25519_public_bytes(self._secagg_key).hex()}
                        if self._secagg_key is not None
                        else {}
                    ),
                },
            )
        )

    def _drain(self) -> int | None:
        """Handle every queued message without waiting; an exit code ends the run."""
        assert self.link is not None
        while (msg := self.link.recv(0.0)) is not None:
            code = self._dispatch(msg)
            if code is not None:
                return code
        self._publish_link_metrics()
        return None

    def _wait(self, timeout_s: float) -> int | None:
        """Block for the next message (time counted as stalled on sync once rounds run)."""
        assert self.link is not None
        t0 = time.monotonic()
        msg = self.link.recv(timeout_s)
        waited = time.monotonic() - t0
        if self._first_round_at is not None:
            self._stall_s += waited
            self.metrics.stalled(waited)
        self._publish_link_metrics()
        return None if msg is None else self._dispatch(msg)

    def _dispatch(self, msg: Message) -> int | None:
        if not isinstance(msg, Error):
            self.auth.accepted()
        if isinstance(msg, Welcome):
            self.session_id = msg.session_id
            if self.cfg.secure_aggregation is not None and self._secagg_key is not None:
                self.secagg = SecAggSession(
                    site_id=self.site_id,
                    session_id=msg.session_id,
                    config=self.cfg.secure_aggregation,
                    session_key=self._secagg_key,
                    static_key=x25519_from_curve_secret(self.kit.curve.secret)
                    if self.kit
                    else None,
                )
            log.info(
                "[site=%s] welcomed by session %s (v%d)",
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
                self._evaluate()  # θ_0's loss, measured before any round can wait on it
        elif isinstance(msg, Global):
            self._on_global(msg)
        elif isinstance(msg, RoundStart):
            if msg.secagg.get("attempt", 0) > 0:
                self._remask(msg)  # a re-run after a dropout: no training, mask again
            else:
                self._pending.append(msg)
        elif isinstance(msg, RoundCancel):
            self._cancelled.update(msg.round_ids)
            if self._awaiting_result in msg.round_ids:
                self._awaiting_result = None  # its result will never come
            log.warning(
                "[site=%s] rounds %s cancelled: %s", self.site_id, msg.round_ids, msg.reason
            )
        elif isinstance(msg, Error):
            return self._on_error(msg)
        elif isinstance(msg, Shutdown):
            log.info("[site=%s] shutdown: %s", self.site_id, msg.reason)
            self.save_checkpoint()
            self._write_site_status()
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
                # The rounds planned by a coordinator that forgot us (it restarted, or timed us
                # out) are void, the one being trained included: its result will never come.
                self._cancelled.update(r.round_id for r in self._pending)
                self._pending.clear()
                self._awaiting_result = None
                self._join()
            return None
        if code is ErrorCode.MODEL_MISMATCH:
            log.error("[site=%s] %s", self.site_id, msg.detail)
            return EXIT_FATAL
        if code is ErrorCode.UNAUTHENTICATED:
            return self._on_refused(msg.detail)
        log.warning(
            "[site=%s] coordinator rejected: %s (%s)",
            self.site_id,
            msg.detail,
            ERROR_MEANINGS[code],
        )
        return None

    def _on_refused(self, detail: str) -> int | None:
        """The coordinator refused our credentials: exit when that is final (revoked, expired,
        or refusals that persisted); otherwise warn once per run of refusals."""
        why = self.auth.refused(detail, self.clock())
        if why is not None:
            log.error(
                "[site=%s] the coordinator refuses this site's credentials (%s): %s; exiting "
                "with status %d (not restarted: renew or re-issue the site's kit)",
                self.site_id,
                why,
                detail,
                EXIT_AUTH_REFUSED,
            )
            return EXIT_AUTH_REFUSED
        if self.auth.refusals == 1:
            log.warning("[site=%s] coordinator refused our credentials: %s", self.site_id, detail)
        return None

    def _fragment_names(self, num_fragments: int) -> list[list[str]]:
        if self._layout[0] != num_fragments:
            self._layout = (num_fragments, fragments(list(self.global_params), num_fragments))
        return self._layout[1]

    def _signature_ok(self, msg: Global) -> bool:
        if self.kit is None:
            return True
        data = global_signed_bytes(
            msg.global_version, msg.base_version, msg.fragment, msg.state_hash
        )
        try:
            verify_blob(
                self.kit.coordinator_sign_public, data, bytes(msg.signature), context="global"
            )
        except AuthError as exc:
            self.metrics.rejected("bad_signature")
            log.error("[site=%s] global v%d not loaded: %s", self.site_id, msg.global_version, exc)
            return False
        return True

    def _on_global(self, msg: Global) -> None:
        if not self._signature_ok(msg):
            return
        spec = spec_of(self.global_params)
        try:
            if msg.is_full:
                decoded = decode_tensors(msg.payload, spec)
                new = {k: np.array(v, dtype=np.float32) for k, v in decoded.items()}
                names = list(new)
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
                names = [enc.name for enc in msg.payload]
                delta = decode_tensors(msg.payload, {k: spec[k] for k in names if k in spec})
                new = dict(self.global_params)
                for k in names:
                    new[k] = self.global_params[k] + delta[k]
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
        merge_delay = ""
        if msg.is_full:
            # A full download replaces everything: local progress and in-flight sends are void.
            local = {k: v.copy() for k, v in new.items()}
            self._sent.clear()
        else:
            local = self.trainer.parameters_numpy()
            sent = self._sent.pop(msg.fragment, None)
            if sent is not None:
                delay = self._steps_done - sent.at_step
                self.metrics.merge_delay(delay)
                merge_delay = f", {delay} inner steps after the send"
            for k in names:
                ref = (
                    sent.local[k] if sent is not None and k in sent.local else self.global_params[k]
                )
                local[k] = local[k] + (new[k] - ref)
        self.global_params = new
        self.global_version = msg.global_version
        self.trainer.load_parameters(local)
        self.save_checkpoint()
        self.metrics.global_version(self.global_version)
        log.info(
            "[site=%s] now at v%d (%s%s)",
            self.site_id,
            self.global_version,
            "full" if msg.is_full else f"fragment {msg.fragment}",
            merge_delay,
        )
        if msg.evaluate:
            self._evaluate()

    def _evaluate(self) -> None:
        """Validation loss of the global model (not of the local replica)."""
        t0 = time.monotonic()
        local = self.trainer.parameters_numpy()
        self.trainer.load_parameters(self.global_params)
        loss = self.trainer.evaluate(self.val_batches)
        self.trainer.load_parameters(local)
        self._eval_s += time.monotonic() - t0
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

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        """Serve rounds until the coordinator says Shutdown; return the process exit code."""
        assert self.link is not None, "start() first"
        self._join()
        while True:
            code = self._drain()
            if code is not None:
                return code
            # Drop plans that can no longer be met on time: cancelled rounds, and rounds that
            # already closed without us (the global moved past them). Progress is not lost: it
            # goes out with the next update.
            while self._pending and (
                self._pending[0].round_id in self._cancelled
                or self._pending[0].round_id <= self.global_version
            ):
                self._pending.popleft()
            # A cancel follows its round's RoundStart on the link: one for no plan we hold
            # has nothing left to stop.
            planned = {p.round_id for p in self._pending}
            self._cancelled &= planned
            waiting = (
                self._awaiting_result is not None and self.global_version < self._awaiting_result
            )
            if not self._pending or waiting:
                code = self._wait(0.5)
                if code is not None:
                    return code
                continue
            self._awaiting_result = None
            code = self._round(self._pending[0])
            if code is not None:
                return code

    def _round(self, rs: RoundStart) -> int | None:
        if self._first_round_at is None:
            self._first_round_at = time.monotonic()
        if rs.evaluate and self.global_version == rs.global_version:
            self._evaluate()
        stats, code = self._train_slot(rs.num_inner_steps)
        if code is not None:
            return code
        for f in range(rs.num_fragments):
            self._tokens[f] = self._tokens.get(f, 0) + stats.tokens
        # The plan: this fragment's previous result must be applied before we send on top of it.
        while self.global_version < rs.fragment_base_version and rs.round_id not in self._cancelled:
            code = self._wait(0.5)
            if code is not None:
                return code
        if self._pending and self._pending[0] is rs:  # a rejoin may have replaced the plan
            self._pending.popleft()
        if rs.round_id in self._cancelled:
            return None  # the progress stays local and goes out with the next update
        self._send_update(rs, stats)
        if not rs.overlap:
            self._awaiting_result = rs.round_id
        return None

    def _train_slot(self, num_steps: int) -> tuple[TrainStats, int | None]:
        """Train ``num_steps`` inner steps, applying results that land in between."""
        steps = tokens = 0
        loss_sum = seconds = last = 0.0
        while steps < num_steps:
            n = min(self.cfg.steps_per_poll, num_steps - steps)
            s = self.trainer.train_steps(n)
            if self.cfg.fault_slow_step_s:
                # A deliberately slow accelerator: its extra time counts as compute.
                time.sleep(self.cfg.fault_slow_step_s * s.steps)
                s = replace(
                    s, compute_seconds=s.compute_seconds + self.cfg.fault_slow_step_s * s.steps
                )
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

    def _send_update(self, rs: RoundStart, stats: TrainStats) -> None:
        names = self._fragment_names(rs.num_fragments)[rs.fragment]
        local = self.trainer.parameters_numpy()
        delta = {k: self.global_params[k] - local[k] for k in names}
        if not np.isfinite(stats.loss_mean) or not all(
            np.isfinite(v).all() for v in delta.values()
        ):
            # Never send a corrupt update: drop the local progress and start over from global.
            self.metrics.rejected("non_finite_local")
            log.error(
                "[site=%s round=%d] local training diverged (NaN/Inf): resetting",
                self.site_id,
                rs.round_id,
            )
            self.trainer.load_parameters(self.global_params)
            self._sent.clear()
            return
        if self.cfg.secure_aggregation is not None:
            # Masked sums are plain means: every site's weight is the same (and hidden).
            if self._send_masked(rs, delta, stats):
                self._tokens.pop(rs.fragment, None)
                self._sent[rs.fragment] = _Sent({k: local[k] for k in names}, self._steps_done)
            # else nothing went out: the progress stays local and goes out with the next update
            return
        if self.cfg.privacy is not None and self.accountant is not None:
            # Clip and noise the pseudo-gradient before anything leaves the site; the noise is
            # fresh each round, and the accountant tracks the (epsilon, delta) spent.
            delta, norm = privatize(delta, self.cfg.privacy, self._noise)
            self.accountant.step()
            self.metrics.dp_epsilon(self.accountant.epsilon())
            log.info(
                "[site=%s round=%d] DP: norm %.3g clipped to %.3g, epsilon spent %.3f (delta %g)",
                self.site_id,
                rs.round_id,
                norm,
                self.cfg.privacy.clip_norm,
                self.accountant.epsilon(),
                self.cfg.privacy.delta,
            )
        try:
            codec = get_codec(rs.codec)
            snapshot = {k: r for k, r in self.feedback.state_dict().items() if k in delta}
            payload = tuple(self.feedback.compress(k, v, codec) for k, v in delta.items())
        except NonFiniteError as exc:
            self.metrics.rejected("non_finite_local")
            log.error("[site=%s round=%d] not sending: %s", self.site_id, rs.round_id, exc)
            self.feedback.load_state_dict({**self.feedback.state_dict(), **snapshot})
            return
        except ValueError as exc:
            log.error(
                "[site=%s round=%d] cannot encode with %r: %s",
                self.site_id,
                rs.round_id,
                rs.codec,
                exc,
            )
            return
        assert self.link is not None
        self._sent[rs.fragment] = _Sent({k: local[k] for k in names}, self._steps_done)
        weight = float(self._tokens.pop(rs.fragment, 0) or stats.tokens)
        self._send_update_message(rs, stats, payload, weight)
        self.metrics.ef_norm(self.feedback.residual_norm())
        log.info(
            "[site=%s round=%d] sent fragment %d/%d (%s): %d steps loss=%.4f %.1fs compute",
            self.site_id,
            rs.round_id,
            rs.fragment,
            rs.num_fragments,
            rs.codec,
            stats.steps,
            stats.loss_mean,
            stats.compute_seconds,
        )

    def _send_update_message(
        self, rs: RoundStart, stats: TrainStats, payload: tuple[EncodedTensor, ...], weight: float
    ) -> None:
        """Send one round's update with this site's measurements, and account for it."""
        assert self.link is not None
        self._send(
            Update(
                site_id=self.site_id,
                round_id=rs.round_id,
                global_version=self.global_version,
                fragment=rs.fragment,
                weight=weight,
                train_loss=stats.loss_mean,
                compute_seconds=stats.compute_seconds,
                step_seconds=stats.compute_seconds / max(1, stats.steps),
                link_rtt_s=self.link.stats.rtt_s,
                link_goodput_bps=self.link.stats.goodput_bps,
                payload=payload,
            )
        )
        self._rounds_sent += 1
        self.metrics.round_sent()
        self._last_send_at = time.monotonic()
        self.metrics.utilization(self.status()["compute_utilization"])
        self._write_site_status()

    def _send_masked(self, rs: RoundStart, delta: dict[str, np.ndarray], stats: TrainStats) -> bool:
        """Secure aggregation: clip to the fixed-point range, mask, send; keep for a re-run.
        False when the round's masking plan is unusable and nothing was sent."""
        assert self.cfg.secure_aggregation is not None
        bound = self.cfg.secure_aggregation.clip_bound
        if self.cfg.privacy is not None and self.accountant is not None:
            delta, _norm = privatize(delta, self.cfg.privacy, self._noise)
            self.accountant.step()
            self.metrics.dp_epsilon(self.accountant.epsilon())
        clipped = sum(int((np.abs(v) > bound).sum()) for v in delta.values())
        if clipped:
            log.warning(
                "[site=%s round=%d] %d values clipped to +-%g for masking",
                self.site_id,
                rs.round_id,
                clipped,
                bound,
            )
        delta = {k: np.clip(v, -bound, bound) for k, v in delta.items()}
        self._unmasked = {rs.round_id: (rs.fragment, delta, 1.0, stats)}
        if self._mask_and_send(rs, delta, stats):
            return True
        self._unmasked.clear()  # a re-run must not send what stays local
        return False

    def _remask(self, rs: RoundStart) -> None:
        kept = self._unmasked.get(rs.round_id)
        if kept is None:
            log.warning(
                "[site=%s round=%d] re-run for an update I do not hold", self.site_id, rs.round_id
            )
            return
        log.info(
            "[site=%s round=%d] secure aggregation re-run, attempt %d",
            self.site_id,
            rs.round_id,
            rs.secagg["attempt"],
        )
        self._mask_and_send(rs, kept[1], kept[3])

    def _mask_and_send(
        self, rs: RoundStart, delta: dict[str, np.ndarray], stats: TrainStats
    ) -> bool:
        assert self.secagg is not None and self.link is not None
        attempt = int(rs.secagg.get("attempt", 0))
        try:
            peers = {
                site: Peer(
                    session_public=bytes.fromhex(keys[0]),
                    static_public=keys[1].encode() if keys[1] else None,
                )
                for site, keys in rs.secagg["peers"].items()
            }
            masked = self.secagg.mask(
                delta, round_id=rs.round_id, participants=peers, attempt=attempt
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            self.metrics.rejected("secagg_plan")
            log.error("[site=%s round=%d] not masking: %s", self.site_id, rs.round_id, exc)
            return False
        if rs.round_id == self.cfg.fault_exit_before_send_round and attempt == 0:
            log.error(
                "[site=%s round=%d] fault drill: exiting after masking", self.site_id, rs.round_id
            )
            logging.shutdown()
            os._exit(17)
        payload = tuple(
            EncodedTensor(
                name=name,
                shape=tuple(arr.shape),
                codec="secagg",
                meta={"attempt": attempt},
                buffers=(arr.reshape(-1),),
            )
            for name, arr in masked.items()
        )
        self._send_update_message(rs, stats, payload, float(stats.tokens))
        log.info(
            "[site=%s round=%d] sent masked fragment %d (attempt %d)",
            self.site_id,
            rs.round_id,
            rs.fragment,
            attempt,
        )
        return True

    def _publish_link_metrics(self) -> None:
        if self.link is None:
            return
        if self.link.stats.echoes_received != self._echoes_seen:
            self._echoes_seen = self.link.stats.echoes_received
            self.auth.accepted()  # the coordinator echoes only a member's heartbeats
        sent, received = self.link.stats.bytes_sent, self.link.stats.bytes_received
        self.metrics.wire(sent - self._bytes_seen[0], received - self._bytes_seen[1])
        self._bytes_seen = (sent, received)
        self.metrics.link(self.link.stats.rtt_s, self.link.stats.goodput_bps)

    def leave(self, reason: str) -> None:
        self._send(Leave(site_id=self.site_id, reason=reason))

    def status(self) -> dict[str, Any]:
        # Utilization counts the training period: the first round's start to the last send.
        end = self._last_send_at or time.monotonic()
        wall = end - self._first_round_at if self._first_round_at else 0.0
        return {
            "site_id": self.site_id,
            "session_id": self.session_id,
            "global_version": self.global_version,
            "rounds_sent": self._rounds_sent,
            "compute_seconds": self._compute_s,
            "stall_seconds": self._stall_s,
            "eval_seconds": self._eval_s,
            "wall_seconds": wall,
            "compute_utilization": self._compute_s / wall if wall else 0.0,
            "val_loss": self._last_val,
            "dp_epsilon": self.accountant.epsilon() if self.accountant else None,
            "link_rtt_s": self.link.stats.rtt_s if self.link else 0.0,
            "link_goodput_bps": self.link.stats.goodput_bps if self.link else 0.0,
        }

    def _write_site_status(self) -> None:
        body = json.dumps(self.status(), sort_keys=True).encode()
        path = self.cfg.state_path / "status.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(body)
        os.replace(tmp, path)


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


def under_torchrun() -> bool:
    """True in a process torchrun started (it sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_argv(cfg: SiteConfig, agent_argv: list[str]) -> list[str]:
    """The torchrun command that runs this site as ``stages x replicas`` processes."""
    import sys

    world = cfg.stages * cfg.replicas
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "crossdc",
        *agent_argv,
    ]


def run_pipeline_site(cfg: SiteConfig) -> int:
    """Entry point of every rank of a pipelined site (launched by torchrun).

    Rank 0 is the site leader: it runs the agent, whose trainer drives the other ranks through
    torch.distributed. Only rank 0 ever opens a WAN socket; the workers run ``worker_loop``.
    """
    import torch.distributed as dist

    from site_agent.pipeline.runtime import (
        PipelineConfig,
        PipelineJob,
        PipelineTrainer,
        init_from_torchrun_env,
        worker_loop,
    )

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    env = init_from_torchrun_env()
    if env.world_size != cfg.stages * cfg.replicas:
        raise ValueError(
            f"torchrun started {env.world_size} processes but site.stages x site.replicas = "
            f"{cfg.stages * cfg.replicas}"
        )
    data = load_site_data(cfg)
    job = PipelineJob(
        model=cfg.model,
        optim=cfg.optim,
        pipeline=PipelineConfig(
            num_stages=cfg.stages,
            num_replicas=cfg.replicas,
            num_microbatches=cfg.microbatches,
            schedule=cfg.schedule,
        ),
        model_seed=cfg.seed,
        data_seed=sampler_seed(cfg.seed, cfg.data.shard_index),
        site_id=cfg.site_id,
    )
    try:
        if env.rank != 0:
            worker_loop(job, data.train, device=env.device)
            return EXIT_OK
        val = eval_batches(data.val, cfg.eval_batches, cfg.eval_batch_size, cfg.model.context_len)
        with PipelineTrainer.start(job, data.train, device=env.device) as trainer:
            agent = SiteAgent(cfg, trainer=trainer, val_batches=val)
            agent.start()
            try:
                return agent.run()
            finally:
                agent.close()
    finally:
        dist.destroy_process_group()
