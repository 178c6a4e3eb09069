"""Opening rounds and undoing them: the plan for each site, the RoundStart, a secure-aggregation
re-run with the survivors, and an abort that cancels every open round.

Functions over the running :class:`~coordinator.service.Coordinator`; the lifecycle has decided
and applied each transition already, these carry it out (the round counter is persisted before
any site hears of the round).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from comm.security.secagg import MaskingPlan, decide_attempt
from comm.wire.schema import RoundCancel, RoundStart
from coordinator.decisions import (
    Abort,
    Open,
)
from coordinator.rounds import OpenRound
from coordinator.scheduler import RoundPlan, SchedulePolicy, SiteView, plan_round

if TYPE_CHECKING:
    from coordinator.service import Coordinator

log = logging.getLogger("crossdc.coordinator")


def secagg_plan_message(c: Coordinator, plan: MaskingPlan) -> dict[str, Any]:
    return {
        "attempt": plan.attempt,
        "peers": {
            s: [p.session_public.hex(), p.static_public.decode() if p.static_public else ""]
            for s, p in sorted(plan.participants.items())
        },
    }


def rerun_or_abandon(c: Coordinator, now: float, r: OpenRound, received: tuple[str, ...]) -> None:
    """Secure aggregation with missing vectors: re-run with the survivors, or abandon."""
    assert c.cfg.secure_aggregation is not None and c.state is not None
    plan = c._masking[r.round_id]
    decision, why = decide_attempt(plan, received, c.cfg.secure_aggregation)
    if decision.action != "rerun" or decision.plan is None:
        abort(c, c.book.abort(f"secure aggregation: {why}"))
        return
    rerun = decision.plan
    c._masking[r.round_id] = rerun
    c._masked.pop(r.round_id, None)
    c._accepted.pop(r.round_id, None)
    c._sums.pop(r.round_id, None)
    survivors = tuple(sorted(rerun.participants))
    c.book.rerun(now, r.round_id, survivors)
    c._round_starts.pop(r.round_id, None)  # the re-run's plans are not sent again
    log.warning("[coordinator round=%d] secure aggregation: %s", r.round_id, why)
    prev = c._round_plan[r.round_id]
    for site_id in survivors:
        c._send(
            c.book.members[site_id].peer,
            RoundStart(
                round_id=r.round_id,
                global_version=c.state.global_version,
                fragment_base_version=r.base_version,
                fragment=r.fragment,
                num_fragments=c.cfg.num_fragments,
                num_inner_steps=0,
                overlap=prev.overlap,
                codec="secagg",
                deadline_s=c.cfg.round_deadline_s,
                participants=survivors,
                evaluate=False,
                reason=why,
                secagg=secagg_plan_message(c, rerun),
            ),
        )


def abort(c: Coordinator, decision: Abort) -> None:
    """Every open round was cancelled: drop what they gathered and tell every member."""
    ids = decision.round_ids
    log.warning("[coordinator round=%d] aborted: %s; cancelling %s", ids[0], decision.why, ids)
    c.metrics.rounds_aborted.inc()
    for round_id in ids:
        c._accepted.pop(round_id, None)
        c._sums.pop(round_id, None)
        c._arrived.pop(round_id, None)
        c._masking.pop(round_id, None)
        c._masked.pop(round_id, None)
        c._round_plan.pop(round_id, None)
        c._round_starts.pop(round_id, None)
    for m in c.book.members.values():
        c._send(m.peer, RoundCancel(round_ids=ids, reason=decision.why))


def schedule(c: Coordinator, now: float, participants: tuple[str, ...]) -> tuple[RoundPlan, str]:
    assert c.state is not None
    cfg = c.cfg
    policy = SchedulePolicy(
        num_inner_steps=cfg.num_inner_steps,
        num_fragments=cfg.num_fragments,
        overlap=cfg.overlap,
        target_utilization=cfg.target_utilization,
        sync_fraction=cfg.sync_fraction,
        ladder=cfg.codec_ladder,
        loss_costs=cfg.codec_loss_costs,
        loss_budget=cfg.codec_loss_budget,
        fixed_uplink=cfg.site_uplink_codecs,
        default_uplink=None if cfg.uplink_codec == "auto" else cfg.uplink_codec,
        fixed_downlink=None if cfg.downlink_codec == "auto" else cfg.downlink_codec,
        unmeasured_codec=cfg.unmeasured_codec,
        max_inner_steps=cfg.max_inner_steps,
        model_numel=sum(int(v.size) for v in c.state.params.values()),
        align_arrivals=cfg.align_arrivals,
    )
    views = [aligned_view(c, s) for s in participants]
    return plan_round(now, views, policy)


def aligned_view(c: Coordinator, site_id: str) -> SiteView:
    """The site's measured view, with how early its update would land in the round being
    planned if it trained no extra steps there, judged from the latest closed round.

    Blocking rounds all start from the same result, so a round's earliness is its own: the
    measured one plus what that round's extra steps took. With overlap a site's slots follow
    each other, so earliness carries over: the measured one less what the extra steps of the
    rounds opened since will take."""
    view = c._views.get(site_id, SiteView(site_id))
    if site_id not in c._early_s or view.step_seconds <= 0:
        return view
    early = c._early_s[site_id]
    if not c.cfg.overlap:
        early += c._early_extra.get(site_id, 0) * view.step_seconds
        return replace(view, early_s=max(0.0, early))
    planned = sum(
        plan.extra_steps.get(site_id, 0)
        for round_id, plan in c._round_plan.items()
        if round_id > c._early_round
    )
    return replace(view, early_s=max(0.0, early - planned * view.step_seconds))


def open(c: Coordinator, now: float, decision: Open) -> None:
    assert c.state is not None and c.chan is not None
    round_id, participants, why = decision.round_id, decision.participants, decision.why
    fragment, base = decision.fragment, decision.base_version
    c.state = replace(c.state, round_counter=round_id)
    c._persist(c.state, counter_only=True)  # durable before announced: never reused
    plan, plan_why = schedule(c, now, participants)
    c._round_plan[round_id] = plan
    for site_id, steps in plan.extra_steps.items():
        c.metrics.extra_steps.labels(site=site_id).inc(steps)
    secagg: dict[str, Any] = {}
    if c.cfg.secure_aggregation is not None:
        missing = [s for s in participants if s not in c._secagg_peers]
        if missing:
            log.warning("[coordinator round=%d] no masking keys from %s", round_id, missing)
        masking = MaskingPlan(
            round_id=round_id,
            attempt=0,
            participants={s: c._secagg_peers[s] for s in participants if s not in missing},
        )
        c._masking[round_id] = masking
        secagg = secagg_plan_message(c, masking)
    evaluate_base = not c.state.history and c.state.global_version not in c.state.val_losses
    # Logged once the id is durable, like the announcement that follows: a round whose id a
    # crash lost was never opened for anyone, and the next incarnation issues that id again.
    c._later(
        lambda: log.info(
            "[coordinator round=%d] open: %s; fragment %d/%d on v%d; plan: %s",
            round_id,
            why,
            fragment,
            c.cfg.num_fragments,
            base,
            plan_why,
        )
    )
    starts = c._round_starts[round_id] = {}
    for i, site_id in enumerate(participants):
        starts[site_id] = RoundStart(
            round_id=round_id,
            global_version=c.state.global_version,
            fragment_base_version=base,
            fragment=fragment,
            num_fragments=c.cfg.num_fragments,
            num_inner_steps=plan.site_steps(site_id),
            overlap=plan.overlap,
            codec=plan.uplink[site_id],
            deadline_s=c.cfg.round_deadline_s,
            participants=participants,
            evaluate=evaluate_base and i == 0 and len(c.book.open_rounds) == 1,
            reason=plan_why,
            secagg=secagg,
        )
        c._send(c.book.members[site_id].peer, starts[site_id])
    c._later(lambda: c.cfg.faults.point("open", round_id))
