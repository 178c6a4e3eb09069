"""Opening rounds and undoing them: the plan for each site, the RoundStart, a secure-aggregation
re-run with the survivors, and an abort that cancels every open round.

The lifecycle has decided and applied each transition already; :class:`Opening` carries it out.
A round's id is durable before any site hears of the round.
"""

from __future__ import annotations

import logging

from comm.security.secagg import MaskingPlan, decide_attempt, plan_message
from comm.wire.schema import RoundCancel, RoundStart
from coordinator.config import CoordinatorConfig
from coordinator.decisions import Abort, Open, Rerun
from coordinator.global_model import GlobalModel
from coordinator.ledger import RoundLedger
from coordinator.lifecycle import Lifecycle
from coordinator.masking_keys import MaskingKeys
from coordinator.metrics import CoordinatorMetrics
from coordinator.planner import Planner
from coordinator.post import PostOffice

log = logging.getLogger("crossdc.coordinator")


class Opening:
    """``open``, ``rerun_or_abandon`` and ``abort``: decisions that start or undo rounds."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        *,
        book: Lifecycle,
        model: GlobalModel,
        ledger: RoundLedger,
        planner: Planner,
        keys: MaskingKeys,
        post: PostOffice,
        metrics: CoordinatorMetrics,
    ) -> None:
        self._cfg = cfg
        self._book = book
        self._model = model
        self._ledger = ledger
        self._planner = planner
        self._keys = keys
        self._post = post
        self._metrics = metrics

    def open(self, now: float, decision: Open) -> None:
        st = self._model.state
        assert st is not None
        round_id, participants = decision.round_id, decision.participants
        self._model.issue_round(round_id)  # durable before announced: never reused
        plan, plan_why = self._planner.plan(
            now, participants, self._model.numel, self._ledger.plans()
        )
        for site_id, steps in plan.extra_steps.items():
            self._metrics.extra_steps.labels(site=site_id).inc(steps)
        masking = self._masking(round_id, participants)
        record = self._ledger.open(round_id, plan, masking)
        secagg = plan_message(masking) if masking is not None else {}
        evaluate_base = not st.history and st.global_version not in st.val_losses
        # Logged once the id is durable, like the announcement that follows: a round whose id a
        # crash lost was never opened for anyone, and the next incarnation issues that id again.
        self._post.later(
            lambda: log.info(
                "[coordinator round=%d] open: %s; fragment %d/%d on v%d; plan: %s",
                round_id,
                decision.why,
                decision.fragment,
                self._cfg.num_fragments,
                decision.base_version,
                plan_why,
            )
        )
        for i, site_id in enumerate(participants):
            record.starts[site_id] = RoundStart(
                round_id=round_id,
                global_version=st.global_version,
                fragment_base_version=decision.base_version,
                fragment=decision.fragment,
                num_fragments=self._cfg.num_fragments,
                num_inner_steps=plan.site_steps(site_id),
                overlap=plan.overlap,
                codec=plan.uplink[site_id],
                deadline_s=self._cfg.round_deadline_s,
                participants=participants,
                evaluate=evaluate_base and i == 0 and len(self._book.open_rounds) == 1,
                reason=plan_why,
                secagg=secagg,
            )
            self._post.send(self._book.members[site_id].peer, record.starts[site_id])
        self._post.later(lambda: self._cfg.faults.point("open", round_id))

    def _masking(self, round_id: int, participants: tuple[str, ...]) -> MaskingPlan | None:
        """Secure aggregation: the round's first masking attempt over the sites with keys."""
        if self._cfg.secure_aggregation is None:
            return None
        peers = self._keys.peers
        missing = [s for s in participants if s not in peers]
        if missing:
            log.warning("[coordinator round=%d] no masking keys from %s", round_id, missing)
        return MaskingPlan(
            round_id=round_id,
            attempt=0,
            participants={s: peers[s] for s in participants if s not in missing},
        )

    def rerun_or_abandon(self, now: float, decision: Rerun) -> None:
        """Secure aggregation with missing vectors: re-run with the survivors, or abandon."""
        st, secagg = self._model.state, self._cfg.secure_aggregation
        assert secagg is not None and st is not None
        r = decision.round
        record = self._ledger[r.round_id]
        assert record.masking is not None
        verdict, why = decide_attempt(record.masking, decision.received, secagg)
        if verdict.action != "rerun" or verdict.plan is None:
            self.abort(self._book.abort(f"secure aggregation: {why}"))
            return
        rerun = verdict.plan
        record = self._ledger.restart(r.round_id, rerun)
        survivors = tuple(sorted(rerun.participants))
        self._book.rerun(now, r.round_id, survivors)
        log.warning("[coordinator round=%d] secure aggregation: %s", r.round_id, why)
        if self._cfg.faults.lose_rerun_plan == r.round_id:
            log.error(
                "[coordinator round=%d] fault injection: the re-run plan to %s is lost after "
                "the socket accepts it",
                r.round_id,
                survivors[0],
            )
            self._post.lose_next(self._book.members[survivors[0]].peer, RoundStart)
        for site_id in survivors:
            self._post.send(
                self._book.members[site_id].peer,
                RoundStart(
                    round_id=r.round_id,
                    global_version=st.global_version,
                    fragment_base_version=r.base_version,
                    fragment=r.fragment,
                    num_fragments=self._cfg.num_fragments,
                    num_inner_steps=0,
                    overlap=record.plan.overlap,
                    codec="secagg",
                    deadline_s=self._cfg.round_deadline_s,
                    participants=survivors,
                    evaluate=False,
                    reason=why,
                    secagg=plan_message(rerun),
                ),
            )

    def abort(self, decision: Abort) -> None:
        """Every open round was cancelled: drop what they gathered and tell every member."""
        ids = decision.round_ids
        log.warning("[coordinator round=%d] aborted: %s; cancelling %s", ids[0], decision.why, ids)
        self._metrics.rounds_aborted.inc()
        self._ledger.drop(ids)
        for m in self._book.members.values():
            self._post.send(m.peer, RoundCancel(round_ids=ids, reason=decision.why))
