"""Secure aggregation test helpers: two configurations, sites' sessions, a first masking plan,
every participant's masked update, and random updates up to a bound."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from comm.security.masking import SecAggConfig
from comm.security.secagg import MaskingPlan, SecAggSession

CFG = SecAggConfig(clip_bound=8.0)
CFG32 = SecAggConfig(clip_bound=4.0, frac_bits=16, word_bits=32, max_sites=8)

Arrays = dict[str, npt.NDArray[np.float32]]


def make_sessions(site_ids: list[str], cfg: SecAggConfig) -> dict[str, SecAggSession]:
    return {s: SecAggSession(site_id=s, session_id="sess-1", config=cfg) for s in site_ids}


def make_plan(sessions: Mapping[str, SecAggSession], round_id: int = 1) -> MaskingPlan:
    return MaskingPlan(
        round_id=round_id,
        attempt=0,
        participants={s: x.peer() for s, x in sessions.items()},
    )


def mask_all(
    sessions: Mapping[str, SecAggSession],
    plan: MaskingPlan,
    updates: Mapping[str, Arrays],
    weights: Mapping[str, float] | None = None,
) -> dict[str, dict[str, Any]]:
    return {
        s: sessions[s].mask(
            updates[s],
            round_id=plan.round_id,
            attempt=plan.attempt,
            participants=plan.participants,
            weight=1.0 if weights is None else weights[s],
        )
        for s in plan.participants
    }


def random_updates(
    rng: np.random.Generator, sites: list[str], shapes: list[tuple[int, ...]], bound: float
) -> dict[str, Arrays]:
    updates: dict[str, Arrays] = {}
    for s in sites:
        arrays: Arrays = {}
        for i, shape in enumerate(shapes):
            a = rng.uniform(-bound, bound, size=shape).astype(np.float32)
            if a.size:  # the boundary itself is allowed
                a.flat[0] = bound * rng.choice([-1.0, 1.0])
            arrays[f"layers.{i}.weight"] = a
        updates[s] = arrays
    return updates
