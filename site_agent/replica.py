"""The global model this site holds, and how the coordinator's results reach the local replica.

:class:`Replica` owns the global version and parameters the site holds, the fragments it sent
whose results have not come back (the reference each result is merged against), the site's
checkpoint, and catching up when a result was lost. Applying a global model is one explicit
call that verifies it (signature, base version, state hash), merges it into the trainer's local
progress, checkpoints, and tells the round lifecycle (``site_agent.rounds``). It sends nothing:
where a result does not apply here it says so, and the agent asks the coordinator for the whole
model.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from comm.codecs.broadcast import sparse_step
from comm.codecs.feedback import ErrorFeedback
from comm.durable import atomic_write
from comm.security.common import AuthError
from comm.security.rolekits import SiteKit
from comm.security.signing import verify_blob
from comm.wire.frames import WireError
from comm.wire.schema import Global, RoundStart
from comm.wire.tensors import (
    decode_parts,
    decode_tensors,
    fragments,
    global_signed_bytes,
    spec_of,
    state_hash,
)
from site_agent.config import SiteConfig
from site_agent.metrics import SiteMetrics
from site_agent.rounds import SiteRounds
from site_agent.trainer import SiteTrainer, TrainStats

log = logging.getLogger("crossdc.site")

Params = dict[str, np.ndarray]


@dataclass(frozen=True)
class SentFragment:
    """One fragment's last send: its local values (the reference for merging the result) and the
    inner-step count then (the merge delay is counted from it)."""

    local: Params
    at_step: int


class GlobalOutcome(enum.Enum):
    """What became of a global model the coordinator sent."""

    APPLIED = "applied"
    IGNORED = "ignored"
    """Not loaded (its signature does not verify): nothing else to do."""
    ASK_FOR_MODEL = "ask_for_model"
    """It does not apply to what this site holds: ask for the whole model."""


class ModelRequests:
    """When a replica asks for the whole model: the coordinator names a version newer than the
    one held, and it was not asked for already (once per version)."""

    def __init__(self, site_id: str, metrics: SiteMetrics) -> None:
        self._site_id = site_id
        self._metrics = metrics
        self._asked = -1
        """The newest version the whole model was asked for."""

    def needed(self, version: int, held: int) -> bool:
        if version <= held or version <= self._asked:
            return False
        log.warning(
            "[site=%s] coordinator is at v%d, I hold v%d: asking for the model",
            self._site_id,
            version,
            held,
        )
        self._asked = version
        self._metrics.rejected("missed_global")
        return True


class Replica:
    """The held global model and its merge into the local replica (see the module docstring)."""

    def __init__(
        self,
        *,
        site_id: str,
        seed: int,
        trainer: SiteTrainer,
        rounds: SiteRounds,
        feedback: ErrorFeedback,
        checkpoint_path: Path,
        metrics: SiteMetrics,
        verify_key: Ed25519PublicKey | None = None,
    ) -> None:
        """``feedback``: the uplink's residuals, checkpointed with the model. ``verify_key``:
        the coordinator's signing key from the site's kit (None: globals are not signed)."""
        self.site_id = site_id
        self._seed = seed
        self._trainer = trainer
        self._rounds = rounds
        self._feedback = feedback
        self.checkpoint_path = checkpoint_path
        self._metrics = metrics
        self._verify_key = verify_key
        self.global_version = -1
        self._hashed: tuple[Params, str] | None = None  # (the parameters, their state hash)
        self.global_params = {k: v.copy() for k, v in trainer.parameters_numpy().items()}
        self._sent: dict[int, SentFragment] = {}
        self._layout: tuple[int, list[list[str]]] = (0, [])
        self._model_requests = ModelRequests(self.site_id, self._metrics)

    @classmethod
    def for_site(
        cls,
        cfg: SiteConfig,
        *,
        trainer: SiteTrainer,
        rounds: SiteRounds,
        feedback: ErrorFeedback,
        metrics: SiteMetrics,
        kit: SiteKit | None,
    ) -> Replica:
        return cls(
            site_id=cfg.site_id,
            seed=cfg.seed,
            trainer=trainer,
            rounds=rounds,
            feedback=feedback,
            checkpoint_path=cfg.state_path / "checkpoint.pt",
            metrics=metrics,
            verify_key=kit.coordinator_sign_public if kit is not None else None,
        )

    def adopt(self, version: int) -> None:
        """The parameters held are the global model at ``version`` (θ0 as this site's factory
        built it, or as it sent it to a coordinator that had none): hold that version and tell
        the round lifecycle."""
        self.global_version = version
        self._rounds.global_applied(version)

    # ---- checkpoint ------------------------------------------------------------------------

    def load_checkpoint(self) -> None:
        if not self.checkpoint_path.exists():
            return
        ckpt = torch.load(self.checkpoint_path, weights_only=True)
        self._trainer.load_state_dict(ckpt["trainer"])
        self.global_params = {k: v.numpy().copy() for k, v in ckpt["global_params"].items()}
        self.adopt(int(ckpt["global_version"]))
        self._feedback.load_state_dict({k: v.numpy() for k, v in ckpt["feedback"].items()})
        # Progress not yet synced when the process stopped is not trusted: restart from the
        # global model (the optimizer state and data cursor are kept).
        self._trainer.load_parameters(self.global_params)
        log.info("[site=%s] resumed from checkpoint at v%d", self.site_id, self.global_version)

    def save_checkpoint(self) -> None:
        ckpt = {
            "global_version": self.global_version,
            "global_params": {k: torch.from_numpy(v.copy()) for k, v in self.global_params.items()},
            "trainer": self._trainer.state_dict(),
            "feedback": {k: torch.from_numpy(v) for k, v in self._feedback.state_dict().items()},
        }
        atomic_write(self.checkpoint_path, lambda fh: torch.save(ckpt, fh))

    # ---- sending -----------------------------------------------------------------------------

    def fragment_names(self, num_fragments: int) -> list[list[str]]:
        if self._layout[0] != num_fragments:
            self._layout = (num_fragments, fragments(list(self.global_params), num_fragments))
        return self._layout[1]

    @property
    def global_params(self) -> Params:
        """The global model this site holds (replaced whole, never changed in place)."""
        return self._global_params

    @global_params.setter
    def global_params(self, params: Params) -> None:
        self._global_params = params
        self._hashed = None

    def state_hash(self) -> str:
        """The state hash of ``global_params``, computed once per model held (``/status`` asks
        for it from another thread: a hash is kept only with the parameters it is of)."""
        params, hashed = self._global_params, self._hashed
        if hashed is not None and hashed[0] is params:
            return hashed[1]
        digest = state_hash(params)
        self._hashed = (params, digest)
        return digest

    def take_pseudo_gradient(
        self, rs: RoundStart, stats: TrainStats
    ) -> tuple[Params, Params] | None:
        """Round ``rs``'s pseudo-gradient Δ = θ_global − θ_local over its fragment, and the local
        values it comes from (what its result will be merged against). None when the local
        training diverged (a reported loss or a Δ not finite): never send a corrupt update; the local
        progress is dropped and training starts over from the global model."""
        names = self.fragment_names(rs.num_fragments)[rs.fragment]
        local = self._trainer.parameters_numpy()
        delta = {k: self.global_params[k] - local[k] for k in names}
        loss_ok = not stats.loss_reported or np.isfinite(stats.loss_mean)
        if loss_ok and all(np.isfinite(v).all() for v in delta.values()):
            return delta, {k: local[k] for k in names}
        self._metrics.rejected("non_finite_local")
        log.error(
            "[site=%s round=%d] local training diverged (NaN/Inf): resetting",
            self.site_id,
            rs.round_id,
        )
        self._trainer.load_parameters(self.global_params)
        self._sent.clear()
        return None

    def sent(self, fragment: int, local: Params, at_step: int) -> None:
        """``fragment``'s update went out, computed from ``local`` at inner step ``at_step``."""
        self._sent[fragment] = SentFragment(local, at_step)

    @property
    def in_flight(self) -> bool:
        """Whether an update of this site awaits its result."""
        return bool(self._sent)

    # ---- receiving -----------------------------------------------------------------------------

    def catch_up_needed(self, version: int) -> bool:
        """The coordinator names ``version`` as its global, but we hold an older one: a result was
        lost on the way (a link cut drops what was in flight, and the coordinator cannot tell).
        Results and plans travel in order on one connection, so the gap is real: the whole
        model is to be asked for, once per version."""
        return self._model_requests.needed(version, self.global_version)

    def apply_global(self, msg: Global, *, at_step: int) -> GlobalOutcome:
        """Verify ``msg``, merge it into the local progress (the trainer has taken ``at_step``
        inner steps so far), checkpoint, and tell the round lifecycle."""
        if not self._signature_ok(msg):
            return GlobalOutcome.IGNORED
        decoded = self._decode(msg)
        if decoded is None:
            return GlobalOutcome.ASK_FOR_MODEL
        new, names = decoded
        if msg.is_full and msg.global_version == 0 == self.global_version:
            # We hold θ0 as our factory built it from the seed, and it is not the federation's.
            self._metrics.rejected("initial_model_differs")
            log.warning(
                "[site=%s] the federation's initial model differs from the one this site's job "
                "built from seed %d: the job's factory is not deterministic in its seed (or the "
                "sites' seeds differ); training from the federation's",
                self.site_id,
                self._seed,
            )
        local, merge_delay = self._merged(msg, new, names, at_step)
        self.global_params = new
        self.adopt(msg.global_version)
        self._trainer.load_parameters(local)
        self.save_checkpoint()
        self._metrics.global_version(self.global_version)
        log.info(
            "[site=%s] now at v%d (%s%s)",
            self.site_id,
            self.global_version,
            "full" if msg.is_full else f"fragment {msg.fragment}",
            merge_delay,
        )
        return GlobalOutcome.APPLIED

    def _merged(
        self, msg: Global, new: Params, names: list[str], at_step: int
    ) -> tuple[Params, str]:
        """The local replica with ``new`` merged in, keeping the local progress made since the
        fragment was sent: θ_local[f] ← θ_local[f] + (θ_global_new[f] − θ_local_at_send[f])."""
        if msg.is_full:
            # A full download replaces everything: local progress and in-flight sends are void.
            self._sent.clear()
            return {k: v.copy() for k, v in new.items()}, ""
        local = self._trainer.parameters_numpy()
        sent = self._sent.pop(msg.fragment, None)
        merge_delay = ""
        if sent is not None:
            delay = at_step - sent.at_step
            self._metrics.merge_delay(delay)
            merge_delay = f", {delay} inner steps after the send"
        for k in names:
            ref = sent.local[k] if sent is not None and k in sent.local else self.global_params[k]
            local[k] = local[k] + (new[k] - ref)
        return local, merge_delay

    def _signature_ok(self, msg: Global) -> bool:
        return signature_ok(msg, self._verify_key, metrics=self._metrics, site_id=self.site_id)

    def _decode(self, msg: Global) -> tuple[Params, list[str]] | None:
        """The parameters ``msg`` describes and the names it changed; None when it does not apply
        here (wrong base, undecodable, wrong hash)."""
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
                    return None
                new, names = self._applied(msg, spec)
        except WireError as exc:
            self._metrics.rejected(exc.code.name.lower())
            log.warning("[site=%s] bad global model: %s", self.site_id, exc)
            return None
        digest = state_hash(new)
        if digest != msg.state_hash:
            self._metrics.rejected("hash_mismatch")
            log.warning(
                "[site=%s] state hash %s != coordinator %s at v%d: asking for the model",
                self.site_id,
                digest,
                msg.state_hash,
                msg.global_version,
            )
            return None
        return new, names

    def _applied(self, msg: Global, spec: dict[str, tuple[int, ...]]) -> tuple[Params, list[str]]:
        """The parameters after a delta, or after a sparse broadcast: the coordinator's step over
        the round's updates, in its order, which lands on its parameters bit for bit."""
        new = dict(self.global_params)
        if msg.part_weights:
            parts = decode_parts(msg.payload, msg.part_weights, spec)
            names = list(parts[0][1])
            new.update(
                sparse_step(
                    {k: self.global_params[k] for k in names},
                    parts,
                    lr=msg.outer_lr,
                    averaged=self._trainer.buffer_names(),
                )
            )
            return new, names
        names = [enc.name for enc in msg.payload]
        delta = decode_tensors(msg.payload, {k: spec[k] for k in names if k in spec})
        for k in names:
            new[k] = self.global_params[k] + delta[k]
        return new, names

    def status(self) -> dict[str, Any]:
        return {"global_version": self.global_version, "state_hash": self.state_hash()}

    def num_parameters(self) -> int:
        return sum(v.size for v in self.global_params.values())

    def initial_params(self) -> Params:
        """θ0 for a coordinator that holds no model yet."""
        return self.global_params


def signature_ok(
    msg: Global, verify_key: Ed25519PublicKey | None, *, metrics: SiteMetrics, site_id: str
) -> bool:
    """Whether ``msg`` is signed by the coordinator's key (True without a key: globals are not
    signed); a bad signature is counted and logged."""
    if verify_key is None:
        return True
    data = global_signed_bytes(msg.global_version, msg.base_version, msg.fragment, msg.state_hash)
    try:
        verify_blob(verify_key, data, bytes(msg.signature), context="global")
    except AuthError as exc:
        metrics.rejected("bad_signature")
        log.error("[site=%s] global v%d not loaded: %s", site_id, msg.global_version, exc)
        return False
    return True
