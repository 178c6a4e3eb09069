"""Joining and catching up: the Join message, checkpoints, verifying and applying the global
model the coordinator broadcasts (merging it into local progress), and evaluating it.

Functions of a :class:`~site_agent.agent.SiteAgent`, bound onto it as its methods.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from comm.security.common import AuthError
from comm.security.masking import x25519_public_bytes
from comm.security.signing import verify_blob
from comm.wire.frames import WireError
from comm.wire.schema import Eval, Global, Join, SyncRequest
from comm.wire.tensors import decode_tensors, fragments, global_signed_bytes, spec_of, state_hash
from site_agent.launch import _atomic_torch_save, resolve_device

if TYPE_CHECKING:
    from site_agent.agent import SiteAgent

log = logging.getLogger("crossdc.site")


def join(self: SiteAgent) -> None:
    self._last_join = time.monotonic()
    self._send(
        Join(
            site_id=self.site_id,
            model_fingerprint=self.fingerprint,
            global_version=self.global_version,
            state_hash=state_hash(self.global_params),
            capabilities={
                "job": self.cfg.job.factory,
                "state_spec": [
                    [name, list(shape), dtype] for name, shape, dtype in self.state_spec
                ],
                "averaged": self.trainer.buffer_names(),
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


def load_checkpoint(self: SiteAgent) -> None:
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


def save_checkpoint(self: SiteAgent) -> None:
    ckpt = {
        "global_version": self.global_version,
        "global_params": {k: torch.from_numpy(v.copy()) for k, v in self.global_params.items()},
        "trainer": self.trainer.state_dict(),
        "feedback": {k: torch.from_numpy(v) for k, v in self.feedback.state_dict().items()},
    }
    _atomic_torch_save(ckpt, self.checkpoint_path)


def fragment_names(self: SiteAgent, num_fragments: int) -> list[list[str]]:
    if self._layout[0] != num_fragments:
        self._layout = (num_fragments, fragments(list(self.global_params), num_fragments))
    return self._layout[1]


def signature_ok(self: SiteAgent, msg: Global) -> bool:
    if self.kit is None:
        return True
    data = global_signed_bytes(msg.global_version, msg.base_version, msg.fragment, msg.state_hash)
    try:
        verify_blob(self.kit.coordinator_sign_public, data, bytes(msg.signature), context="global")
    except AuthError as exc:
        self.metrics.rejected("bad_signature")
        log.error("[site=%s] global v%d not loaded: %s", self.site_id, msg.global_version, exc)
        return False
    return True


def on_global(self: SiteAgent, msg: Global) -> None:
    if not self._signature_ok(msg):
        return
    decoded = decode_global(self, msg)
    if decoded is None:
        return  # asked for the whole model instead
    new, names = decoded
    merge_delay = ""
    if msg.is_full and msg.global_version == 0 == self.global_version:
        # We hold θ0 as our factory built it from the seed, and it is not the federation's.
        self.metrics.rejected("initial_model_differs")
        log.warning(
            "[site=%s] the federation's initial model differs from the one this site's job "
            "built from seed %d: the job's factory is not deterministic in its seed (or the "
            "sites' seeds differ); training from the federation's",
            self.site_id,
            self.cfg.seed,
        )
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
            ref = sent.local[k] if sent is not None and k in sent.local else self.global_params[k]
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


def catch_up_to(self: SiteAgent, version: int) -> None:
    """The coordinator names ``version`` as its global, but we hold an older one: a result was
    lost on the way (a link cut drops what was in flight, and the coordinator cannot tell).
    Results and plans travel in order on one connection, so the gap is real: ask for the whole
    model, once per version."""
    if version <= self.global_version or version <= self._sync_asked:
        return
    log.warning(
        "[site=%s] coordinator is at v%d, I hold v%d: asking for the model",
        self.site_id,
        version,
        self.global_version,
    )
    self._sync_asked = version
    self.metrics.rejected("missed_global")
    self._send(SyncRequest(site_id=self.site_id, global_version=self.global_version))


def decode_global(self: SiteAgent, msg: Global) -> tuple[dict[str, np.ndarray], list[str]] | None:
    """The parameters ``msg`` describes and the names it changed; None when it does not apply
    here (wrong base, undecodable, wrong hash): then the whole model is asked for."""
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
                self._send(SyncRequest(site_id=self.site_id, global_version=self.global_version))
                return None
            names = [enc.name for enc in msg.payload]
            delta = decode_tensors(msg.payload, {k: spec[k] for k in names if k in spec})
            new = dict(self.global_params)
            for k in names:
                new[k] = self.global_params[k] + delta[k]
    except WireError as exc:
        self.metrics.rejected(exc.code.name.lower())
        log.warning("[site=%s] bad global model: %s", self.site_id, exc)
        self._send(SyncRequest(site_id=self.site_id, global_version=self.global_version))
        return None
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
        return None
    return new, names


def evaluate(self: SiteAgent) -> None:
    """The job's validation metrics of the global model (not of the local replica)."""
    t0 = time.monotonic()
    local = self.trainer.parameters_numpy()
    self.trainer.load_parameters(self.global_params)
    metrics = self.trainer.validate()
    self.trainer.load_parameters(local)
    if metrics is None:
        return  # the trainer has no validation (a script that gave none)
    if not np.isfinite(metrics["loss"]):
        self.metrics.rejected("non_finite_eval")
        log.warning(
            "[site=%s] the validation loss of v%d is not finite (%s): not reported",
            self.site_id,
            self.global_version,
            metrics["loss"],
        )
        return
    self._eval_s += time.monotonic() - t0
    loss = metrics.pop("loss")
    self._last_val, self._last_metrics = loss, metrics
    self.metrics.val_loss(loss)
    self.metrics.val_metrics(metrics)
    self._send(
        Eval(
            site_id=self.site_id,
            global_version=self.global_version,
            val_loss=loss,
            metrics=metrics,
        )
    )
    shown = "".join(f" {k}={v:.4f}" for k, v in sorted(metrics.items()))
    log.info("[site=%s] val_loss=%.4f%s at v%d", self.site_id, loss, shown, self.global_version)
