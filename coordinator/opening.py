"""Opening rounds and undoing them: the plan for each site, the RoundStart, a retry of a whole
round with those that remain, and an abort that cancels every open round.

The lifecycle has decided and applied each transition already; :class:`Opening` carries it out.
A round's id is durable before any site hears of the round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from comm.wire.schema import RoundCancel, RoundStart
from coordinator.config import RoundsConfig
from coordinator.decisions import Abort, Open, Retry
from coordinator.faults import FaultPlan
from coordinator.global_model import GlobalModel
from coordinator.lifecycle import Lifecycle
from coordinator.membership import Membership
from coordinator.metrics import CoordinatorMetrics
from coordinator.planner import Planner
from coordinator.post import PostOffice

log = logging.getLogger("crossdc.coordinator")


class Opening:
    """``open``, ``retry_or_abandon`` and ``abort``: decisions that start or undo rounds."""

    def __init__(
        self,
        rounds: RoundsConfig,
        faults: FaultPlan,
        *,
        book: Lifecycle,
        members: Membership,
        model: GlobalModel,
        planner: Planner,
        post: PostOffice,
        metrics: CoordinatorMetrics,
    ) -> None:
        self._rounds = rounds
        self._faults = faults
        self._book = book
        self._members = members
        self._model = model
        self._planner = planner
        self._post = post
        self._metrics = metrics
        self.release: Callable[[int, Callable[[], None]], None] | None = None
        """A coordinator of several shards: ``release(round_id, send)`` sends the round's plans
        (``send()``) once every shard opened it; None (one process): sent at once."""

    def open(self, now: float, decision: Open) -> None:
        st = self._model.state
        assert st is not None
        r = decision.round
        round_id, participants = r.round_id, r.participants
        self._model.issue_round(round_id)  # durable before announced: never reused
        open_plans = [(o.round_id, o.plan) for o in self._book.open_rounds if o.plan is not None]
        plan, plan_why = self._planner.plan(now, participants, self._model.numel, open_plans)
        for site_id, steps in plan.extra_steps.items():
            self._metrics.extra_steps.labels(site=site_id).inc(steps)
        r.plan = plan
        r.tensors = {n: tuple(st.params[n].shape) for n in self._model.fragment_names[r.fragment]}
        assert r.fold is not None
        extra = r.fold.start_fields
        evaluate_base = not st.history and st.global_version not in st.val_losses
        # Logged once the id is durable, like the announcement that follows: a round whose id a
        # crash lost was never opened for anyone, and the next incarnation issues that id again.
        self._post.later(
            lambda: log.info(
                "[coordinator round=%d] open: %s; fragment %d/%d on v%d; plan: %s",
                round_id,
                decision.why,
                decision.fragment,
                self._rounds.num_fragments,
                decision.base_version,
                plan_why,
            )
        )
        starts: list[tuple[str, RoundStart]] = []
        for i, site_id in enumerate(participants):
            start = RoundStart(
                round_id=round_id,
                global_version=st.global_version,
                fragment_base_version=decision.base_version,
                fragment=decision.fragment,
                num_fragments=self._rounds.num_fragments,
                num_inner_steps=plan.site_steps(site_id),
                overlap=plan.overlap,
                codec=plan.uplink[site_id],
                deadline_s=self._rounds.round_deadline_s,
                participants=participants,
                evaluate=evaluate_base and i == 0 and len(self._book.open_rounds) == 1,
                reason=plan_why,
                **extra,
            )
            starts.append((site_id, start))

        def send() -> None:
            # Sent and not kept: under some aggregations it carries every peer's keys. Each
            # site's connection is looked up now: with a release hook the plans go out later,
            # and a site may have joined again on another connection in between.
            for site_id, start in starts:
                member = self._members.get(site_id)
                if member is not None:
                    self._post.send(member.peer, start)

        if self.release is None:
            send()
        else:
            self.release(round_id, send)
        self._post.later(lambda: self._faults.point("open", round_id))

    def retry_or_abandon(self, now: float, decision: Retry) -> None:
        """A whole round lacking updates: retried with those that remain, or abandoned."""
        st = self._model.state
        assert st is not None
        r = decision.round
        assert r.fold is not None and r.plan is not None
        name = r.aggregator.name
        attempt, why = r.aggregator.retry(r.round_id, r.fold, decision.received)
        if attempt is None:
            self.abort(self._book.abort(f"{name}: {why}"))
            return
        survivors, fold = attempt
        self._book.retry(now, r, survivors, fold)
        log.warning("[coordinator round=%d] %s: %s", r.round_id, name, why)
        if self._faults.lose_rerun_plan == r.round_id:
            log.error(
                "[coordinator round=%d] fault injection: the re-run plan to %s is lost after "
                "the socket accepts it",
                r.round_id,
                survivors[0],
            )
            self._post.lose_next(self._members[survivors[0]].peer, RoundStart)
        fields: dict[str, Any] = {
            "round_id": r.round_id,
            "global_version": st.global_version,
            "fragment_base_version": r.base_version,
            "fragment": r.fragment,
            "num_fragments": self._rounds.num_fragments,
            "num_inner_steps": 0,  # the update already trained is sent again
            "overlap": r.plan.overlap,
            "deadline_s": self._rounds.round_deadline_s,
            "participants": survivors,
            "evaluate": False,
            "reason": why,
        }
        for site_id in survivors:
            # The site's codec, unless the aggregator's retry asks for another.
            msg = {"codec": r.plan.uplink[site_id], **fields, **fold.start_fields}
            self._post.send(self._members[site_id].peer, RoundStart(**msg))

    def abort(self, decision: Abort) -> None:
        """Every open round was cancelled: drop what they gathered and tell every member."""
        ids = decision.round_ids
        log.warning("[coordinator round=%d] aborted: %s; cancelling %s", ids[0], decision.why, ids)
        self._metrics.rounds_aborted.inc()
        for m in self._members.values():
            self._post.send(m.peer, RoundCancel(round_ids=ids, reason=decision.why))
