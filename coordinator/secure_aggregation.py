"""Secure aggregation on the coordinator: the masked sum, as an aggregator, and its key relay.

Each site masks its update with pairwise masks that cancel in the sum (``comm.security``), so
the coordinator learns only the sum. :class:`MaskedSumAggregator` is the
:class:`~coordinator.aggregate.Aggregator` that does so:

- keys: a join must announce a usable session key (``BAD_KEY`` otherwise, and the site never
  enters a masking set); each member's key, and the certificate its connection authenticated
  with, are relayed to its round's participants in the RoundStart (``secagg``);
- folding: a masked update is checked for shape and attempt only (its values are hidden) and
  added to the attempt's modular sum (:class:`MaskedSum`): only the sum is kept, and only the
  sum is ever unmasked;
- rounds are whole: the masks cancel only over the attempt's full set, so a round lacking some
  vectors is re-run with the survivors (``retry``) or abandoned, and no update is merged late;
  a re-run's survivors mask the update they already trained, so when a masked update lands
  times no training and arrival alignment plans nothing from it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from comm.codecs.base import EncodedTensor
from comm.security.masking import WEIGHT_KEY, Peer, SecAggConfig, check_x25519_public, to_signed
from comm.security.secagg import MaskingPlan, decide_attempt, plan_message
from comm.wire.schema import ErrorCode, Join
from coordinator.aggregate import (
    Arrays,
    Fold,
    Late,
    MeanResult,
    Refused,
    RoundResult,
    Shapes,
    refuse_slices,
)
from coordinator.post import PostOffice
from coordinator.strategies.base import Revealed

log = logging.getLogger("crossdc.coordinator")

SESSION_KEY = "secagg_session_public"
"""The join capability that carries a site's session key (64 hex digits)."""


def announced_session_key(msg: Join) -> bytes:
    """The session key a join announces; ValueError naming the site unless it is a 32-byte
    X25519 public key of large order (:func:`check_x25519_public`): the all-zero key or another
    point of small order would make every honest site's key exchange with it fail."""
    announced = msg.capabilities.get(SESSION_KEY)
    where = f"site {msg.site_id!r}: secure aggregation is on and the join's session key"
    if not isinstance(announced, str):
        raise ValueError(f"{where} is missing")
    try:
        public = bytes.fromhex(announced)
        check_x25519_public(public)
    except ValueError as exc:
        raise ValueError(f"{where} is unusable: {exc}") from None
    return public


class MaskedSum:
    """The modular sum of one masking attempt's vectors, per tensor, and who sent them.

    Integer addition modulo 2^k is exact and order-free, so the result is the same as summing the
    kept vectors at the end; a site's vectors may be freed as soon as they are added."""

    def __init__(self, config: SecAggConfig) -> None:
        self._config = config
        self._sum: dict[str, npt.NDArray[np.unsignedinteger[Any]]] = {}
        self.senders: set[str] = set()

    def add(
        self, site_id: str, vectors: Mapping[str, npt.NDArray[np.unsignedinteger[Any]]]
    ) -> None:
        if site_id in self.senders:
            raise ValueError(f"secagg: site {site_id!r} already sent its vectors")
        if self._sum and {n: a.shape for n, a in vectors.items()} != {
            n: a.shape for n, a in self._sum.items()
        }:
            raise ValueError(f"secagg: site {site_id!r} sent other tensor names or shapes")
        for name, arr in vectors.items():
            if arr.dtype != self._config.dtype:
                raise ValueError(
                    f"secagg: site {site_id!r} tensor {name!r} is {arr.dtype}, "
                    f"not {self._config.dtype}"
                )
            acc = self._sum.get(name)
            if acc is None:
                self._sum[name] = np.array(arr, dtype=self._config.dtype, copy=True)
            else:
                np.add(acc, arr, out=acc)
        self.senders.add(site_id)

    def mean(self, participants: Collection[str]) -> tuple[Arrays, float]:
        """The weighted mean and the total weight, once exactly ``participants`` have added
        their vectors (otherwise the masks do not cancel: ValueError)."""
        if self.senders != set(participants):
            raise ValueError(
                f"secagg: vectors from {sorted(self.senders)} do not match the masking set "
                f"{sorted(participants)}"
            )
        if WEIGHT_KEY not in self._sum:
            raise ValueError(f"secagg: vectors lack the weight entry {WEIGHT_KEY!r}")
        frac = -self._config.frac_bits
        sums = {
            n: np.ldexp(to_signed(a, self._config).astype(np.float64), frac)
            for n, a in self._sum.items()
        }
        total = float(sums.pop(WEIGHT_KEY)[0])
        if total <= 0:
            raise ValueError("secagg: the total weight is 0: no site contributed")
        return {n: (v / total).astype(np.float32) for n, v in sums.items()}, total

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._sum.values())


class MaskedFold:
    """One masking attempt of a round: its plan and the modular sum of its vectors."""

    def __init__(self, config: SecAggConfig, plan: MaskingPlan) -> None:
        self._config = config
        self.plan = plan
        self.sum = MaskedSum(config)
        self.start_fields: Mapping[str, Any] = {"secagg": plan_message(plan)}
        if plan.attempt:
            # A re-run: the survivors mask the update they already trained, with no new steps.
            self.start_fields = {**self.start_fields, "codec": "secagg", "num_inner_steps": 0}

    def add(
        self, site_id: str, weight: float, payload: Sequence[EncodedTensor], shapes: Shapes
    ) -> Refused | str:
        """Checked for shape and attempt only (the values are hidden), then folded."""
        refused = refuse_slices(payload, "masked updates are of whole tensors")
        if refused is not None:
            return refused
        plan, dtype = self.plan, self._config.dtype
        expected = {n: tuple(s) for n, s in shapes.items()}
        expected[WEIGHT_KEY] = (1,)
        got = {enc.name: enc for enc in payload}
        problem = ""
        if set(got) != set(expected):
            problem = f"masked tensors {sorted(got)[:3]}... do not match the fragment"
        elif any(
            e.meta.get("attempt") != plan.attempt or e.codec != "secagg" for e in got.values()
        ):
            problem = f"not masked for attempt {plan.attempt}"
        elif site_id not in plan.participants:
            problem = f"not in the masking set of attempt {plan.attempt}"
        else:
            for name, enc in got.items():
                if len(enc.buffers) != 1 or enc.buffers[0].dtype != dtype:
                    problem = f"{name!r} is not one {dtype} buffer"
                elif tuple(enc.shape) != expected[name] or enc.buffers[0].size != int(
                    np.prod(expected[name])
                ):
                    problem = f"{name!r} has shape {enc.shape}, expected {expected[name]}"
                if problem:
                    break
        if problem:
            return Refused(ErrorCode.BAD_PAYLOAD, problem)
        self.sum.add(
            site_id,
            {name: np.asarray(enc.buffers[0]).reshape(expected[name]) for name, enc in got.items()},
        )
        return f"(masked update accepted, attempt {plan.attempt})"

    def result(self, label: str, late: Sequence[Late]) -> RoundResult:
        """Only the unmasked weighted mean: the sites' updates are never seen."""
        assert not late, "masked updates are never merged late"
        mean, total = self.sum.mean(self.plan.participants)
        return MeanResult([("secure-aggregate", total, mean)])

    def squared_norm(self, site_id: str) -> float:
        raise ValueError("a masked update's values are hidden: it has no norm to report")

    def leave_out(self, site_id: str) -> None:
        raise ValueError("a masked sum cannot leave an update out: the masks would not cancel")

    @property
    def nbytes(self) -> int:
        return self.sum.nbytes


class MaskedSumAggregator:
    """Secure aggregation: see the module docstring."""

    whole_rounds = True
    late_refusal = "masked updates cannot be merged late"
    arrivals_time_training = False
    holds_updates = False  # a masked update is added to the masked sum as it arrives
    name = "secure aggregation"
    reveals = Revealed.SUM

    def __init__(self, config: SecAggConfig, post: PostOffice) -> None:
        self.config = config
        self._post = post  # the connection's certified identity, and the registry
        self.peers: dict[str, Peer] = {}
        """The masking keys of the members that announced one."""

    # ---- keys ----------------------------------------------------------------------------------

    def check_join(self, msg: Join) -> None:
        """Refuse (ValueError naming the site) a join whose session key no site could mask
        with."""
        announced_session_key(msg)

    def joined(self, peer: bytes, msg: Join) -> None:
        """A joining site's masking keys (checked by :meth:`check_join`): its session key, and
        the certificate its connection authenticated with, which the sites verify themselves."""
        certificate = None
        registry = self._post.registry
        if registry is not None:
            identity = self._post.identity(peer)
            cert = registry.certificate(identity.serial) if identity else None
            certificate = cert.to_pem() if cert is not None else None
        self.peers[msg.site_id] = Peer(
            session_public=announced_session_key(msg), certificate=certificate
        )

    def forget(self, site_id: str) -> None:
        self.peers.pop(site_id, None)

    # ---- rounds --------------------------------------------------------------------------------

    def fold(self, round_id: int, participants: Sequence[str]) -> Fold:
        """The round's first masking attempt over the participants with keys."""
        missing = [s for s in participants if s not in self.peers]
        if missing:
            log.warning("[coordinator round=%d] no masking keys from %s", round_id, missing)
        plan = MaskingPlan(
            round_id=round_id,
            attempt=0,
            participants={s: self.peers[s] for s in participants if s not in missing},
        )
        return MaskedFold(self.config, plan)

    def late_fold(self) -> Fold:
        raise AssertionError("masked updates are never merged late")

    def retry(
        self, round_id: int, fold: Fold, received: Sequence[str]
    ) -> tuple[tuple[tuple[str, ...], Fold] | None, str]:
        """The next attempt with the survivors, or None when too few remain."""
        assert isinstance(fold, MaskedFold)
        verdict, why = decide_attempt(fold.plan, received, self.config)
        if verdict.action != "rerun" or verdict.plan is None:
            return None, why
        survivors = tuple(sorted(verdict.plan.participants))
        return (survivors, MaskedFold(self.config, verdict.plan)), why
