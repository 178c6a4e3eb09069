"""The planner: what the coordinator has measured of each site, and the plan of each new round.

:class:`Planner` keeps each site's latest view (step time and link, from its updates) and how
early each on-time update of the latest closed round landed before its last one, and turns them
into the round plan through the pure :func:`~coordinator.scheduler.plan_round`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from coordinator.scheduler import RoundPlan, SchedulePolicy, SiteView, plan_round


class Planner:
    """Site views and arrival alignment; ``plan`` for a new round."""

    def __init__(self, policy: SchedulePolicy) -> None:
        """``policy``: the scheduler's, less the model's size (given with each plan)."""
        self._policy = policy
        self.views: dict[str, SiteView] = {}
        # How early each site's update landed in the latest closed round (``_early_round``)
        # before its last one, and the extra steps it had there.
        self._early_s: dict[str, float] = {}
        self._early_extra: dict[str, int] = {}
        self._early_round = 0

    def observe(self, view: SiteView) -> None:
        self.views[view.site_id] = view

    def forget(self, site_id: str) -> None:
        self.views.pop(site_id, None)

    def measured(
        self, round_id: int, arrived: Mapping[str, float], merged: Iterable[str], plan: RoundPlan
    ) -> None:
        """How early each on-time update of the closed round landed before its last one."""
        on_time = {s: arrived[s] for s in merged if s in arrived}
        if not on_time:
            return
        last = max(on_time.values())
        self._early_s = {s: last - t for s, t in on_time.items()}
        self._early_extra = {s: plan.extra_steps.get(s, 0) for s in self._early_s}
        self._early_round = round_id

    def plan(
        self,
        now: float,
        participants: Iterable[str],
        model_numel: int,
        open_plans: Iterable[tuple[int, RoundPlan]],
    ) -> tuple[RoundPlan, str]:
        policy = replace(self._policy, model_numel=model_numel)
        plans = list(open_plans)
        views = [self._aligned(s, plans) for s in participants]
        return plan_round(now, views, policy)

    def _aligned(self, site_id: str, open_plans: list[tuple[int, RoundPlan]]) -> SiteView:
        """The site's measured view, with how early its update would land in the round being
        planned if it trained no extra steps there, judged from the latest closed round.

        Blocking rounds all start from the same result, so a round's earliness is its own: the
        measured one plus what that round's extra steps took. With overlap a site's slots follow
        each other, so earliness carries over: the measured one less what the extra steps of the
        rounds opened since will take."""
        view = self.views.get(site_id, SiteView(site_id))
        if site_id not in self._early_s or view.step_seconds <= 0:
            return view
        early = self._early_s[site_id]
        if not self._policy.overlap:
            early += self._early_extra.get(site_id, 0) * view.step_seconds
            return replace(view, early_s=max(0.0, early))
        planned = sum(
            plan.extra_steps.get(site_id, 0)
            for round_id, plan in open_plans
            if round_id > self._early_round
        )
        return replace(view, early_s=max(0.0, early - planned * view.step_seconds))
