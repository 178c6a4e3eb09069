"""Closing rounds: ``round.result()`` (its updates, and the late ones of its fragment,
down-weighted) -> the strategy's step -> ``model.advance()`` (the new state persisted), and,
once it is durable, the result broadcast to every member; and the end of the federation.

Between the save and the broadcast a coordinator of several shards commits the round on every
shard (``coordinator.shard_plane``: each shard saved its version, then shard 0 commits): the
optional gate (:data:`CloseGate`) is handed the saved round (:class:`Saved`) and announces it
when the commit says so, with the state hash of the whole model. Without a gate (one
coordinator process) the result is announced as soon as its state is durable.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from comm.wire.schema import Global, Shutdown
from coordinator.aggregate import OuterStep
from coordinator.config import EvaluationConfig
from coordinator.decisions import Close
from coordinator.faults import FaultPlan
from coordinator.global_model import GlobalModel
from coordinator.membership import Membership
from coordinator.metrics import CoordinatorMetrics
from coordinator.planner import Planner
from coordinator.post import PostOffice
from coordinator.round import Accepted
from coordinator.strategies.base import Strategy

log = logging.getLogger("crossdc.coordinator")


@dataclass(frozen=True)
class Saved:
    """A closed round whose new state is durable, not yet announced (see the module doc)."""

    round_id: int
    version: int
    digests: Callable[[], dict[str, bytes]]
    """Each tensor's digest of the new state (``GlobalModel.digests``)."""
    announce: Callable[[str, bytes], None]
    """Announce the result with this state hash and signature (the whole model's)."""


CloseGate = Callable[[Saved], None]
"""What runs once a round's new state is durable, in place of announcing it at once."""


@dataclass(frozen=True)
class Announcement:
    """A closed round's result, waiting for its state to be durable before it is sent."""

    decision: Close
    step: OuterStep
    base_version: int
    entry: dict[str, Any]
    late: list[Accepted]
    digest: str
    """The new state's hash."""
    signature: bytes
    """The coordinator's signature of the result (empty without a signing key)."""


class Closing:
    """``close`` a round the lifecycle closed; ``maybe_finish`` the federation."""

    def __init__(
        self,
        evaluation: EvaluationConfig,
        faults: FaultPlan,
        *,
        final_mean: bool,
        members: Membership,
        model: GlobalModel,
        planner: Planner,
        strategy: Strategy,
        post: PostOffice,
        metrics: CoordinatorMetrics,
        on_changed: Callable[[], None],
        gate: CloseGate | None = None,
    ) -> None:
        """``gate``: see the module doc (None: announce once durable)."""
        self._evaluation = evaluation
        self._faults = faults
        self._saves = 0
        """Round results saved under a gate since this process started (a crash point)."""
        self._final_mean = final_mean
        self._members = members
        self._model = model
        self._planner = planner
        self._strategy = strategy
        self._post = post
        self._metrics = metrics
        self._on_changed = on_changed
        self.gate = gate
        """See the module doc; a coordinator of several shards sets it before its start."""
        # The socket's byte counters when the latest round's result went out: a round's bytes
        # are those since (two rounds in flight overlap in time, their bytes must not).
        self._bytes_mark = (0, 0)

    def close(self, now: float, decision: Close) -> None:
        """Merge the round's updates, persist the new state, and announce it once durable."""
        st = self._model.state
        assert st is not None
        r = decision.round
        assert r.plan is not None
        fresh = [r.accepted[s] for s in decision.merged]
        result, late = r.result(decision.late)
        # Inner steps behind the model this round produces: every completed slot and this one.
        inner_steps = sum(int(h["num_inner_steps"]) for h in st.history)
        inner_steps += r.plan.num_inner_steps
        # The run's last round: no round will start from what it produces. Only with one
        # fragment: with several, aborts shift which round is a fragment's last.
        final = self._final_mean and r.num_fragments == 1 and decision.final
        spec = self._model.spec
        # The step overwrites the state's arrays tensor by tensor (no second model is held):
        # once it has checked what it can, the model first makes every queued save durable and
        # runs what waited on them; a step failing after that gets the durable state back.
        with self._model.changing() as prepare:
            step = result.step(
                self._strategy,
                st,
                list(r.tensors),
                downlink=r.plan.downlink,
                inner_steps=inner_steps,
                final=final,
                averaged=spec.averaged if spec is not None else (),
                prepare=prepare,
            )
        # The step folded the held updates tensor by tensor as it read their mean: fold work,
        # counted as the intake counts its checks.
        self._metrics.fold_cpu_seconds.inc(result.fold_cpu_seconds)
        entry = self._history_entry(now, decision, step, fresh, late, inner_steps)
        new_state = replace(step.state, global_version=r.round_id, history=(*st.history, entry))
        step = replace(step, state=new_state)
        self._planner.measured(r.round_id, r.arrived, decision.merged, r.plan)

        def announce(digest: str, signature: bytes) -> None:
            self._announce(
                Announcement(decision, step, st.global_version, entry, late, digest, signature)
            )

        gate = self.gate

        def saved(_digest: str, _signature: bytes) -> None:
            assert gate is not None
            # A shard's crash points lie between its save and the commit (before it reports).
            self._faults.point("close", r.round_id)
            self._saves += 1
            self._faults.saved(self._saves, r.round_id)
            digests = self._model.digests
            gate(Saved(r.round_id, r.round_id, lambda: digests(new_state), announce))

        # Durable before announced: the announcement runs once the new state's save is (and,
        # with a gate, once every shard saved and shard 0 committed).
        then = announce if gate is None else saved
        self._model.advance(new_state, base=st.global_version, fragment=r.fragment, then=then)

    def _history_entry(
        self,
        now: float,
        decision: Close,
        step: OuterStep,
        fresh: list[Accepted],
        late: list[Accepted],
        inner_steps: int,
    ) -> dict[str, Any]:
        """The closed round's summary, as the durable history keeps it."""
        st = self._model.state
        assert st is not None
        r, merged, plan = decision.round, decision.merged, decision.round.plan
        assert plan is not None
        return {
            "round_id": r.round_id,
            "global_version": r.round_id,
            "base_version": st.global_version,
            "fragment": r.fragment,
            "num_fragments": r.num_fragments,
            "num_inner_steps": plan.num_inner_steps,
            "extra_steps": {s: n for s, n in plan.extra_steps.items() if s in merged},
            "inner_steps_total": inner_steps,
            "outer_rule": step.rule,
            "participants": list(r.participants),
            "merged": list(merged),
            "late_merged": [[u.site_id, u.round_id] for u in late],
            "train_loss": mean_train_loss(fresh),
            "tokens": sum(u.weight for u in fresh),
            "outer_grad_norm": step.outer_grad_norm,
            "uplink_codecs": {s: plan.uplink[s] for s in merged},
            "downlink_codec": step.downlink,
            "update_bytes": sum(u.nbytes for u in fresh + late),
            "update_bytes_by_site": _bytes_by_site(fresh + late),
            "compute_seconds_max": max((u.compute_seconds for u in fresh), default=0.0),
            "duration_s": now - r.opened_at,
            "finished_unix": time.time(),
        }

    def _announce(self, a: Announcement) -> None:
        """Send a closed round's result (its state is durable) and account for it."""
        chan = self._post.chan
        assert chan is not None
        r, entry, m = a.decision.round, a.entry, self._metrics
        self._faults.point("close", r.round_id)
        out_before = chan.stats.bytes_sent
        in_sync = self._broadcast(a)
        # Everything on the socket since the previous round's result went out (the first round:
        # since the start), joins, control and heartbeats included: the rounds' figures add up
        # to the socket's totals.
        received, sent = chan.stats.bytes_received, chan.stats.bytes_sent
        entry["wire_bytes_in"] = received - self._bytes_mark[0]
        entry["wire_bytes_out"] = sent - self._bytes_mark[1]
        self._bytes_mark = (received, sent)
        entry["broadcast_bytes"] = sent - out_before
        payload_bytes = sum(enc.nbytes for enc in a.step.encoded)
        raw_bytes = 4 * a.step.numel
        m.payload_bytes.labels(direction="out").inc(payload_bytes * len(in_sync))
        m.payload_raw_bytes.labels(direction="out").inc(raw_bytes * len(in_sync))
        m.rounds.inc()
        m.round_duration.observe(entry["duration_s"])
        m.quorum_size.set(len(a.decision.merged))
        m.outer_grad_norm.set(a.step.outer_grad_norm)
        if entry["train_loss"] is not None:
            m.train_loss.set(entry["train_loss"])
        m.global_version.set(r.round_id)
        log.info(
            "[coordinator round=%d] closed: %s; merged=%s late=%d loss=%s outer_norm=%.4g "
            "outer=%s %.1fs",
            r.round_id,
            a.decision.why,
            a.decision.merged,
            len(a.late),
            "-" if entry["train_loss"] is None else f"{entry['train_loss']:.4f}",
            a.step.outer_grad_norm,
            a.step.rule,
            entry["duration_s"],
        )
        self._on_changed()

    def _broadcast(self, a: Announcement) -> list[str]:
        """The result to every member: the compressed delta to those holding the round's base,
        the whole model to the others; one site on time is asked to evaluate. Returns the sites
        that held the base (they got the delta)."""
        r, merged, state = a.decision.round, a.decision.merged, a.step.state
        digest = a.digest
        in_sync = self._members.in_sync(a.base_version)
        wants_eval = r.round_id % self._evaluation.every_rounds == 0 or a.decision.final
        # Ask a site that can and was on time: evaluating costs the evaluator some compute.
        able = [s for s in in_sync if self._members[s].evaluates]
        candidates = [s for s in able if s in merged] or able
        evaluator = candidates[0] if candidates and wants_eval else None
        merged_all = tuple(merged) + tuple(f"{u.site_id}@{u.round_id}" for u in a.late)
        delta = Global(
            round_id=r.round_id,
            base_version=a.base_version,
            global_version=r.round_id,
            fragment=r.fragment,
            merged=merged_all,
            is_full=False,
            state_hash=digest,
            signature=a.signature,
            evaluate=False,
            payload=a.step.encoded,
            part_weights=a.step.part_weights,
            outer_lr=a.step.outer_lr,
        )
        self._model.deltas.record(delta)  # for sites that rejoin behind
        for site_id, m in sorted(self._members.items()):
            if site_id in in_sync:
                msg = replace(delta, evaluate=site_id == evaluator)
            else:
                asked = wants_eval and evaluator is None and m.evaluates
                msg = self._model.full_global(state, r.round_id, asked)
            ok = self._post.send(m.peer, msg)
            # The channel holds a result until the site acknowledges it and sends it again when
            # it is lost or the site was away (comm.transport.reliable): sent is delivered. A
            # send the channel refused leaves the site out of sync, to be brought up to date
            # when it asks (SyncRequest) or rejoins.
            self._members.holds(site_id, r.round_id if ok else m.global_version, in_sync=ok)
        return in_sync

    def maybe_finish(self, now: float, started_at: float) -> bool:
        """Once the final model's validation is in (or no longer awaited): Shutdown to every
        member. True when the federation finished."""
        st = self._model.state
        assert st is not None
        have_final = st.global_version in st.val_losses
        can_evaluate = any(m.evaluates for m in self._members.values())
        if not have_final and can_evaluate and now - started_at < self._evaluation.final_wait_s:
            return False
        for m in self._members.values():
            self._post.send(m.peer, Shutdown(reason=f"completed {len(st.history)} rounds"))
        log.info("[coordinator] finished at v%d", st.global_version)
        return True


def mean_train_loss(updates: list[Accepted]) -> float | None:
    """The weighted mean of the train losses the sites reported (a site that reports none sends
    NaN: a training loop that never called ``record_loss``); ``None`` when none did."""
    reported = [u for u in updates if not math.isnan(u.train_loss)]
    weight = sum(u.weight for u in reported)
    return sum(u.weight * u.train_loss for u in reported) / weight if reported else None


def _bytes_by_site(updates: list[Accepted]) -> dict[str, int]:
    out: dict[str, int] = {}
    for u in updates:
        out[u.site_id] = out.get(u.site_id, 0) + u.nbytes
    return out
