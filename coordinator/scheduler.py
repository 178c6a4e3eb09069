"""The WAN scheduler: a pure function from measured links to a round plan.

``plan_round(now, sites, policy)`` chooses, per site, the codec of its pseudo-gradient, and for
the round the downlink codec, the inner steps per sync slot and the fragment count, so that a
sync fits inside the compute it overlaps (docs/architecture.md, "WAN awareness").

Bytes first: bytes are what users pay for, so the round gets the measured combination of an
uplink and a downlink codec on the ladder with the fewest bytes whose loss cost (``loss_costs``,
from ``crossdc bench convergence``) is within ``loss_budget``, on any link; its sync is then the
shortest too, and the slot is lengthened (more inner steps, up to a bound) only when even that
sync does not fit. Without a measured codec
within the budget, the ladder is walked from least to most compressed and a site gets the first
codec whose sync fits its budget. The reason says which constraint bound.

Arrival alignment: a round closes when its last update lands, so a site whose update arrived
early waits for the others (blocking), or trains on while its result is pending and merges it
late (overlapped). Such a site gets extra inner steps in the round being planned, enough to fill
most of the time it would be early: its update then lands with the others', it computes instead
of waiting, and its merges are fresher. Updates are weighted by tokens, so the extra steps count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from comm.codecs.registry import get_codec


@dataclass(frozen=True)
class SiteView:
    """What the coordinator knows of one site's link and speed (0 = not measured yet)."""

    site_id: str
    step_seconds: float = 0.0
    rtt_s: float = 0.0
    goodput_bps: float = 0.0
    early_s: float = 0.0
    """How early this site's update would land in the round being planned without extra steps,
    judged from the latest closed round (see ``coordinator.planner.Planner``)."""


@dataclass(frozen=True, kw_only=True)
class SchedulePolicy:
    num_inner_steps: int
    """H: inner steps between two syncs of the same fragment."""
    num_fragments: int = 1
    overlap: bool = True
    target_utilization: float = 0.95
    ladder: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")
    """Codecs from least to most compressed."""
    loss_costs: Mapping[str, float] = field(default_factory=dict)
    """Measured loss cost relative to fp32 (``bench convergence``) of each codec used both ways
    (key ``C``) or of an uplink codec with a downlink codec (key ``U/D``)."""
    loss_budget: float = 0.005
    """Bytes first: the measured pair with the fewest bytes whose loss cost is within this."""
    fixed_uplink: Mapping[str, str] = field(default_factory=dict)
    """Sites whose uplink codec is fixed by configuration."""
    default_uplink: str | None = None
    """Fixed uplink codec for every site (None: the scheduler chooses)."""
    fixed_downlink: str | None = None
    """Fixed downlink codec (None: the scheduler chooses)."""
    unmeasured_codec: str = "int8"
    """What a site gets before its link has been measured."""
    max_inner_steps: int = 2000
    model_numel: int = 0
    margin: float = 0.8
    """Fraction of the compute budget a sync may use (headroom for jitter and stragglers); a
    sync longer than that lengthens the slot."""
    sync_fraction: float = 0.25
    """With overlap, the codec is the least compressed whose sync takes at most this fraction of
    the slot's compute, else the most compressed: a result is merged that far into the next slot,
    and a staler merge costs more loss than a coarser codec with error feedback does."""
    align_arrivals: bool = True
    """Give a site that was early extra inner steps (see the module docstring)."""
    align_fraction: float = 0.8
    """Fraction of a site's earliness filled with extra steps (short of all: it must not become
    the last)."""


@dataclass(frozen=True)
class RoundPlan:
    num_inner_steps: int
    """Inner steps of this round's slot (H / fragments)."""
    num_fragments: int
    overlap: bool
    uplink: dict[str, str]
    downlink: str
    extra_steps: dict[str, int] = field(default_factory=dict)
    """Inner steps a site trains on top of ``num_inner_steps`` this round (absent: none)."""

    def site_steps(self, site_id: str) -> int:
        """The inner steps ``site_id`` trains in this round's slot."""
        return self.num_inner_steps + self.extra_steps.get(site_id, 0)


def _bytes(codec: str, numel: int) -> int:
    return get_codec(codec).encoded_size(numel)


def _sync_seconds(view: SiteView, up: str, down: str, numel: int) -> float:
    bits = 8 * (_bytes(up, numel) + _bytes(down, numel))
    return view.rtt_s + bits / view.goodput_bps


def _lengthened_slot(
    v: SiteView, need: float, slot: int, policy: SchedulePolicy, reasons: list[str]
) -> int:
    """The slot, lengthened so that ``v``'s sync of ``need`` seconds fits (up to the bound)."""
    frags = policy.num_fragments
    per_step = v.step_seconds * (policy.margin if policy.overlap else 1.0)
    wanted = math.ceil(need / per_step)
    if not policy.overlap:
        wanted = math.ceil(wanted * policy.target_utilization / (1 - policy.target_utilization))
    new_slot = min(policy.max_inner_steps // frags, max(slot, wanted))
    if new_slot > slot:
        reasons.append(f"slot {slot}->{new_slot} steps so {v.site_id}'s sync fits")
        return new_slot
    return slot


def directions(key: str) -> tuple[str, str]:
    """``(uplink, downlink)`` a loss-cost key names: ``U/D`` is uplink U with downlink D, any
    other key one codec both ways. ValueError for a malformed pair."""
    up, sep, down = key.partition("/")
    if not sep:
        return key, key
    if not up or not down or "/" in down:
        raise ValueError(f'a pair is UPLINK/DOWNLINK, e.g. "int3+zstd/int4+zstd", got {key!r}')
    return up, down


def measured_pairs(policy: SchedulePolicy) -> list[tuple[str, str, float]]:
    """``(uplink, downlink, cost)`` of every measured combination of ladder codecs (keys as
    :func:`directions` reads them)."""
    out = []
    for key, cost in policy.loss_costs.items():
        up, down = directions(key)
        if up in policy.ladder and down in policy.ladder:
            out.append((up, down, float(cost)))
    return out


def fewest_bytes_pair(
    policy: SchedulePolicy, *, uplink: str | None = None, downlink: str | None = None
) -> tuple[str, str, float] | None:
    """Bytes first: the measured ``(uplink, downlink, cost)`` within the loss budget with the
    fewest bytes, optionally with one direction fixed; None when none is within it.

    Fewest bytes is the most compressed by ladder position, both directions together (every
    site sends one update and receives one broadcast a round); on a tie, the lower measured
    cost, then the pair that compresses the uplink more (the coordinator averages the sites'
    coding errors)."""
    ladder = policy.ladder
    fits = [
        (up, down, cost)
        for up, down, cost in measured_pairs(policy)
        if cost <= policy.loss_budget
        and (uplink is None or up == uplink)
        and (downlink is None or down == downlink)
    ]
    if not fits:
        return None
    return max(
        fits, key=lambda p: (ladder.index(p[0]) + ladder.index(p[1]), -p[2], ladder.index(p[0]))
    )


def _fewest_bytes(
    v: SiteView,
    pair: tuple[str, str, float],
    slot: int,
    numel: int,
    policy: SchedulePolicy,
    reasons: list[str],
) -> int:
    """Bytes first: ``pair`` has the fewest bytes within the loss budget, so its sync is the
    shortest too; the slot is lengthened only when even that sync does not fit it."""
    codec, down, cost = pair
    what = codec if down == codec else f"{codec} up, {down} down"
    if not (v.step_seconds > 0 and v.goodput_bps > 0):
        reasons.append(f"{v.site_id}: {codec} (fewest bytes within loss {cost:+.2%}: {what})")
        return slot
    compute_s = slot * v.step_seconds
    if policy.overlap:
        limit = policy.margin * compute_s
    else:
        limit = compute_s * (1 - policy.target_utilization) / policy.target_utilization
    need = _sync_seconds(v, codec, down, numel)
    reasons.append(
        f"{v.site_id}: {codec} (fewest bytes within loss {cost:+.2%}: {what}; sync "
        f"{need:.2f}s vs {limit:.2f}s)"
    )
    return _lengthened_slot(v, need, slot, policy, reasons) if need > limit else slot


def _choose_uplink(
    v: SiteView,
    slot: int,
    numel: int,
    policy: SchedulePolicy,
    pair: tuple[str, str, float] | None,
    reasons: list[str],
) -> tuple[str, int, int]:
    """Site ``v``'s uplink codec, its level on the ladder, and the slot (lengthened when even
    the most compressed codec's sync does not fit); ``pair`` is the round's bytes-first pair."""
    ladder = policy.ladder
    fixed = policy.fixed_uplink.get(v.site_id, policy.default_uplink)
    if fixed is not None:
        reasons.append(f"{v.site_id}: {fixed} (configured)")
        return fixed, ladder.index(fixed) if fixed in ladder else 0, slot
    if pair is not None:
        codec = pair[0]
        return codec, ladder.index(codec), _fewest_bytes(v, pair, slot, numel, policy, reasons)
    if not (v.step_seconds > 0 and v.goodput_bps > 0):
        reasons.append(f"{v.site_id}: {policy.unmeasured_codec} (link not measured yet)")
        return policy.unmeasured_codec, ladder.index(policy.unmeasured_codec), slot
    compute_s = slot * v.step_seconds
    if policy.overlap:
        # The codec keeps merges fresh; the slot only has to hide the sync.
        budget, limit = policy.sync_fraction * compute_s, policy.margin * compute_s
    else:
        budget = compute_s * (1 - policy.target_utilization) / policy.target_utilization
        limit = budget
    level, codec, need = 0, ladder[0], 0.0
    for level, codec in enumerate(ladder):  # noqa: B007 (level is used after the loop)
        need = _sync_seconds(v, codec, codec, numel)
        if need <= budget:
            break
    reasons.append(f"{v.site_id}: {codec} (sync {need:.2f}s vs budget {budget:.2f}s)")
    if need > limit:
        # Even the most compressed codec does not fit: lengthen the slot for everyone.
        slot = _lengthened_slot(v, need, slot, policy, reasons)
    return codec, level, slot


def _extra_steps(
    sites: Sequence[SiteView], slot: int, policy: SchedulePolicy, reasons: list[str]
) -> dict[str, int]:
    """Arrival alignment: extra inner steps for the sites that would land early."""
    frags = policy.num_fragments
    extra: dict[str, int] = {}
    most = min(slot, policy.max_inner_steps // frags - slot)  # at most a second slot
    for v in sorted(sites, key=lambda s: s.site_id):
        if v.step_seconds > 0 and v.early_s > 0:
            n = min(most, math.floor(policy.align_fraction * v.early_s / v.step_seconds))
            if n > 0:
                extra[v.site_id] = n
                reasons.append(f"{v.site_id}: +{n} steps ({v.early_s:.2f}s early)")
    # Only the sites' offsets matter: the site with the fewest extra steps trains the slot
    # as planned, so the round does not grow longer for everyone.
    fewest = min((extra.get(v.site_id, 0) for v in sites), default=0)
    if fewest > 0:
        extra = {s: n - fewest for s, n in extra.items() if n > fewest}
        reasons.append(f"every site's extra steps less {fewest}")
    return extra


def plan_round(
    now: float, sites: Sequence[SiteView], policy: SchedulePolicy
) -> tuple[RoundPlan, str]:
    """The plan for the next round and why."""
    del now  # the plan depends on measurements only; kept for the decision signature
    frags = policy.num_fragments
    slot = max(1, policy.num_inner_steps // frags)
    numel = max(1, math.ceil(policy.model_numel / frags))
    reasons: list[str] = []
    uplink: dict[str, str] = {}
    levels: dict[str, int] = {}
    # A configured direction: the best pair measured with it, else the best pair's other side.
    best = fewest_bytes_pair(policy)
    up_pair = fewest_bytes_pair(policy, downlink=policy.fixed_downlink) or best
    for v in sorted(sites, key=lambda s: s.site_id):
        uplink[v.site_id], levels[v.site_id], slot = _choose_uplink(
            v, slot, numel, policy, up_pair, reasons
        )
    pair = fewest_bytes_pair(policy, uplink=policy.default_uplink) or best
    if policy.fixed_downlink is not None:
        downlink = policy.fixed_downlink
    elif pair is not None:
        downlink = pair[1]
    elif levels:
        downlink = policy.ladder[max(levels.values())]
    else:
        downlink = policy.unmeasured_codec
    reasons.append(f"downlink {downlink}")
    extra = _extra_steps(sites, slot, policy, reasons) if policy.align_arrivals else {}
    plan = RoundPlan(
        num_inner_steps=slot,
        num_fragments=frags,
        overlap=policy.overlap,
        uplink=uplink,
        downlink=downlink,
        extra_steps=extra,
    )
    return plan, "; ".join(reasons)
