"""The global model a sharded site holds, as its agent sees it: the version, never the values.

:class:`ShardedReplica` stands where :class:`site_agent.replica.Replica` stands for a site of
one process, with the same calls the agent makes, but it holds no parameters: every rank holds
θ, its residuals and the reference of what it sent for its own rows (``site_agent.shardsync``),
and the replica syncs through the trainer's :class:`~site_agent.shardsync.LeaderSync`:

- an update is the ranks' encoded slices (:meth:`ShardedReplica.take_update`); a non-finite
  local value on any rank means the local training diverged, as for one process: nothing is
  sent and every rank starts over from θ;
- a result's encoded tensors go to the ranks as they came, each rank decodes and applies its
  rows, and the state hash of the whole candidate model is checked before any rank takes it;
- the checkpoint is ``torch.distributed.checkpoint`` (every rank its shards) in a directory per
  save under the state dir, named by ``checkpoint.json`` (written last, atomically): a restart
  resumes from the last one named, in another layout too.

Not yet for a sharded site: differential privacy, secure aggregation (refused when the site is
assembled) and the sparse broadcast (its results are not applied: the site asks for the model).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from comm.durable import atomic_write
from comm.security.rolekits import SiteKit
from comm.wire.schema import Global, RoundStart
from comm.wire.tensors import decode_tensors, fragments
from site_agent.config import SiteConfig
from site_agent.metrics import SiteMetrics
from site_agent.payload import Payload
from site_agent.replica import GlobalOutcome, ModelRequests, signature_ok
from site_agent.rounds import SiteRounds
from site_agent.shardsync import LeaderSync
from site_agent.trainer import TrainStats

log = logging.getLogger("crossdc.site")


def check_sharded_config(cfg: SiteConfig) -> None:
    """ValueError for what a sharded site does not do yet."""
    missing = cfg.not_for_sharded_sites()
    if missing:
        raise ValueError(f"{missing} is not available to a site whose model is sharded yet")


class ShardedReplica:
    """The version a sharded site holds and its sync through the ranks (module docstring)."""

    def __init__(
        self,
        *,
        site_id: str,
        sync: LeaderSync,
        rounds: SiteRounds,
        state_path: Path,
        metrics: SiteMetrics,
        verify_key: Ed25519PublicKey | None = None,
    ) -> None:
        self.site_id = site_id
        self._sync = sync
        self._rounds = rounds
        self._state_path = state_path
        self._metrics = metrics
        self._verify_key = verify_key
        self.global_version = -1
        self._hash: tuple[int, str] | None = None  # (the version, its state hash)
        self._names = list(sync.spec())
        self._sent_at: dict[int, int] = {}  # per fragment in flight: the inner step of its send
        self._layout: tuple[int, list[list[str]]] = (0, [])
        self._model_requests = ModelRequests(self.site_id, self._metrics)
        self._saves = 0

    @classmethod
    def for_site(
        cls,
        cfg: SiteConfig,
        *,
        sync: LeaderSync,
        rounds: SiteRounds,
        metrics: SiteMetrics,
        kit: SiteKit | None,
    ) -> ShardedReplica:
        check_sharded_config(cfg)
        return cls(
            site_id=cfg.site_id,
            sync=sync,
            rounds=rounds,
            state_path=cfg.state_path,
            metrics=metrics,
            verify_key=kit.coordinator_sign_public if kit is not None else None,
        )

    def adopt(self, version: int) -> None:
        self.global_version = version
        self._rounds.global_applied(version)

    def num_parameters(self) -> int:
        return self._sync.num_parameters()

    def state_hash(self) -> str:
        """The state hash of θ over every rank, computed once per version held. ``/status``
        asks from another thread: it gets the hash last computed (a collective call belongs to
        the agent's thread)."""
        return self._hash[1] if self._hash is not None else ""

    def _rehash(self) -> str:
        digest = self._sync.state_hash()
        self._hash = (self.global_version, digest)
        return digest

    def initial_params(self) -> dict[str, np.ndarray]:
        """θ0 for a coordinator that holds no model yet, which takes it whole: the ranks' fp32
        slices put together on the leader (the one time a sharded site's leader holds the whole
        model: when it seeds the federation)."""
        return decode_tensors(self._sync.initial_payload(), self._sync.spec(), slices=True)

    # ---- checkpoint ------------------------------------------------------------------------

    @property
    def _meta_path(self) -> Path:
        return self._state_path / "checkpoint.json"

    def _named_dir(self) -> str | None:
        """The directory ``checkpoint.json`` names now (None: none, or unreadable)."""
        try:
            return str(json.loads(self._meta_path.read_text())["dir"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def load_checkpoint(self) -> None:
        if not self._meta_path.exists():
            self._rehash()
            return
        meta = json.loads(self._meta_path.read_text())
        self._sync.load(str(self._state_path / meta["dir"]))
        self.adopt(int(meta["global_version"]))
        self._rehash()
        log.info("[site=%s] resumed from checkpoint at v%d", self.site_id, self.global_version)

    def save_checkpoint(self) -> None:
        """Every rank's shards into a new directory, then ``checkpoint.json`` names it, then the
        older directories go. The new one is never the one named now, nor any left on disk (a
        save that stopped part way): a process restarted at the same version counts its saves
        from 1 again, and writing into the named directory would lose the only checkpoint to a
        crash during the save."""
        named = self._named_dir()
        version = max(self.global_version, 0)
        while True:
            self._saves += 1
            name = f"checkpoint-v{version}-{self._saves}"
            if name != named and not (self._state_path / name).exists():
                break
        self._sync.save(str(self._state_path / name))
        meta = {"global_version": self.global_version, "dir": name}
        atomic_write(self._meta_path, json.dumps(meta).encode())
        for old in self._state_path.glob("checkpoint-v*"):
            if old.name != name and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    # ---- sending ---------------------------------------------------------------------------

    def fragment_names(self, num_fragments: int) -> list[list[str]]:
        if self._layout[0] != num_fragments:
            self._layout = (num_fragments, fragments(self._names, num_fragments))
        return self._layout[1]

    def take_update(
        self, rs: RoundStart, stats: TrainStats, *, tokens: int, at_step: int
    ) -> Payload | None:
        """Round ``rs``'s update: the ranks' encoded slices of its fragment. None when nothing
        may go out: the local training diverged (every rank starts over from θ) or the codec
        refused (every residual owes what it owed before)."""
        if stats.loss_reported and not math.isfinite(stats.loss_mean):
            self._diverged(rs)
            return None
        names = self.fragment_names(rs.num_fragments)[rs.fragment]
        # Without overlap nothing is trained before the result: no copy of the local rows.
        result = self._sync.update(rs.fragment, names, rs.codec, keep_reference=rs.overlap)
        if result.non_finite:
            self._diverged(rs)
            return None
        if result.error:
            log.error(
                "[site=%s round=%d] cannot encode with %r: %s",
                self.site_id,
                rs.round_id,
                rs.codec,
                result.error,
            )
            return None
        self._sent_at[rs.fragment] = at_step
        self._metrics.ef_norm(math.sqrt(result.residual_sq_norm))
        return Payload(
            tensors=result.tensors,
            weight=float(tokens or stats.tokens),
            stats=stats,
            label=f"{rs.codec}, {len(result.tensors)} tensors and slices",
        )

    def _diverged(self, rs: RoundStart) -> None:
        self._metrics.rejected("non_finite_local")
        log.error(
            "[site=%s round=%d] local training diverged (NaN/Inf): resetting",
            self.site_id,
            rs.round_id,
        )
        self._sync.reset_local()
        self._sent_at.clear()

    @property
    def in_flight(self) -> bool:
        return bool(self._sent_at)

    # ---- receiving -------------------------------------------------------------------------

    def catch_up_needed(self, version: int) -> bool:
        return self._model_requests.needed(version, self.global_version)

    def apply_global(self, msg: Global, *, at_step: int) -> GlobalOutcome:
        """Verify ``msg`` and have every rank apply its rows of it (see the module docstring)."""
        if not signature_ok(msg, self._verify_key, metrics=self._metrics, site_id=self.site_id):
            return GlobalOutcome.IGNORED
        if msg.part_weights:
            log.warning(
                "[site=%s] a sparse broadcast does not apply to a sharded site: asking for "
                "the model",
                self.site_id,
            )
            return GlobalOutcome.ASK_FOR_MODEL
        if not msg.is_full and msg.base_version != self.global_version:
            log.warning(
                "[site=%s] delta from v%d but I hold v%d: asking for the model",
                self.site_id,
                msg.base_version,
                self.global_version,
            )
            return GlobalOutcome.ASK_FOR_MODEL
        outcome = self._sync.result(
            msg.payload,
            full=msg.is_full,
            fragment=None if msg.is_full else msg.fragment,
            state_hash=msg.state_hash,
        )
        if not outcome.applied:
            self._metrics.rejected(outcome.rejected)
            log.warning(
                "[site=%s] global v%d not applied (%s): asking for the model",
                self.site_id,
                msg.global_version,
                outcome.detail,
            )
            return GlobalOutcome.ASK_FOR_MODEL
        merge_delay = ""
        if msg.is_full:
            self._sent_at.clear()
        elif (sent_at := self._sent_at.pop(msg.fragment, None)) is not None:
            self._metrics.merge_delay(at_step - sent_at)
            merge_delay = f", {at_step - sent_at} inner steps after the send"
        self.adopt(msg.global_version)
        self._hash = (msg.global_version, msg.state_hash)
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

    def validate_global(self) -> dict[str, float] | None:
        """The site's validation of θ (every rank takes part)."""
        return self._sync.validate()

    def status(self) -> dict[str, Any]:
        return {"global_version": self.global_version, "state_hash": self.state_hash()}
