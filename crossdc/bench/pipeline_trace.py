"""Reading a pipeline benchmark's traces: each rank's timed actions of every measured step,
measured against the simulator's replay of them (the figures ``crossdc.bench.pipeline``
reports; its docstring says what each means).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from crossdc.bench.pipeline_sim import Action, SimResult, executed_order, simulate


@dataclass(frozen=True)
class _Run:
    """One action as a rank ran it: when its rank was free for it, when the output it consumes
    from another rank was made (``None``: no such input), and its compute span."""

    rank: int
    action: Action
    free: float
    produced: float | None
    start: float
    end: float

    @property
    def waited(self) -> bool:
        """Whether the rank was free before its input existed: the gap is waiting."""
        return self.produced is not None and self.produced > self.free


def _runs(ranks: Sequence[dict[str, Any]], rank_of: dict[int, int]) -> list[_Run]:
    """Every action of one step, the last stage's loss merged into the forward before it."""
    merged: list[list[list[Any]]] = []
    for r in ranks:
        events: list[list[Any]] = []
        for e in r["events"]:
            if e[1] == "L" and events and events[-1][:3] == [e[0], "F", e[2]]:
                events[-1][4] = e[4]
            else:
                events.append(list(e))
        merged.append(events)
    ended = {Action(*e[:3]): e[4] for events in merged for e in events}
    runs = []
    for rank, (r, events) in enumerate(zip(ranks, merged, strict=True)):
        free = r["start"]
        for stage, kind, mb, t0, t1 in events:
            a = Action(stage, kind, mb)
            runs.append(_Run(rank, a, free, _produced(a, ended, rank_of, rank), t0, t1))
            free = t1
    return runs


def _costs(runs: Sequence[_Run], count_work: bool) -> tuple[dict[tuple[int, str], float], ...]:
    """Per (stage, kind) over ``runs``: the mean cost (compute, and with ``count_work`` the
    schedule's own work before the action) and that mean work alone."""
    compute: dict[tuple[int, str], list[float]] = defaultdict(list)
    overhead: dict[tuple[int, str], list[float]] = defaultdict(list)
    for run in runs:
        key = (run.action.stage, run.action.kind)
        compute[key].append(run.end - run.start)
        if not run.waited and count_work:
            overhead[key].append(run.start - run.free)
    extra = {key: statistics.fmean(overhead[key]) if overhead[key] else 0.0 for key in compute}
    return {key: statistics.fmean(v) + extra[key] for key, v in compute.items()}, extra


def _compare(
    order: dict[int, list[Action]],
    steps: list[list[_Run]],
    traced: list[dict[int, list[Action]]],
    starts: list[float],
    *,
    count_work: bool,
) -> dict[str, Any]:
    """Measured against simulated bubble, busy time being compute and, with ``count_work``,
    the schedule's own work before each action (see the module); without it, compute only.

    Both sides pool the measured steps: the measured bubble is the idle share of all of them,
    the simulated one that of every step simulated from its own mean costs, so a step slower
    than the others (another process took a core) is slower on both sides."""
    per_step = [_costs(runs, count_work) for runs in steps]

    def work_before(run: _Run, extra: dict[tuple[int, str], float]) -> float:
        """Where the rank waited, its action's kind's mean work, at most the time since its
        input was made; elsewhere the whole gap before it."""
        if not count_work:
            return 0.0
        if run.waited and run.produced is not None:
            return min(extra[(run.action.stage, run.action.kind)], run.start - run.produced)
        return run.start - run.free

    delays = [
        max(0.0, run.start - run.produced - work_before(run, extra))
        for runs, (_, extra) in zip(steps, per_step, strict=True)
        for run in runs
        if run.waited and run.produced is not None
    ]
    transfer_s = statistics.median(delays) if delays else 0.0
    windows, busy = [], 0.0
    sims: dict[str, list[SimResult]] = {"own": [], "mean": []}
    for runs, ran, start, (durations, extra) in zip(steps, traced, starts, per_step, strict=True):
        windows.append(max(run.end for run in runs) - start)
        own = {run.action: run.end - run.start + work_before(run, extra) for run in runs}
        busy += math.fsum(own.values())
        sims["own"].append(simulate(ran, own, transfer_s))  # the order it ran
        sims["mean"].append(simulate(order, durations, transfer_s))
    measured = 1.0 - busy / (len(order) * math.fsum(windows))

    def bubble(results: list[SimResult]) -> float:
        step_s = math.fsum(r.step_time_s for r in results)
        return 1.0 - math.fsum(b for r in results for b in r.busy_s) / (len(order) * step_s)

    def rel_error(simulated: float) -> float:
        return abs(measured / simulated - 1.0) if simulated > 0 else abs(measured)

    simulated, from_means = bubble(sims["own"]), bubble(sims["mean"])
    return {
        "measured": measured,
        "simulated": simulated,
        "rel_error": rel_error(simulated),
        "from_mean_costs": {"simulated": from_means, "rel_error": rel_error(from_means)},
        "step_seconds": statistics.fmean(windows),
        "step_seconds_simulated": statistics.fmean(r.step_time_s for r in sims["own"]),
        "transfer_s": transfer_s,
        "durations": _costs([run for runs in steps for run in runs], count_work)[0],
    }


def analyze(record: dict[str, Any]) -> dict[str, Any]:
    """Measured and simulated figures of one case from its ranks' traces (see the module)."""
    p, m, schedule = record["ranks"], record["microbatches"], record["schedule"]
    written = record.get("pipeline_order")  # JSON: rank numbers as strings
    torch_order = {int(r): a for r, a in written.items()} if written else None
    order = executed_order(schedule, p, m, torch_order)
    rank_of = {a.stage: r for r, actions in order.items() for a in actions}
    steps = [_runs(ranks, rank_of) for ranks in record["traces"]]
    starts = [min(r["start"] for r in ranks) for ranks in record["traces"]]
    traced = [{r: [run.action for run in runs if run.rank == r] for r in order} for runs in steps]
    figures = _compare(order, steps, traced, starts, count_work=True)
    compute_only = _compare(order, steps, traced, starts, count_work=False)
    durations = figures["durations"]
    stages = sorted({s for s, _ in durations})
    per_stage = [
        durations[(s, "F")]
        + durations.get((s, "B"), 0.0)
        + durations.get((s, "I"), 0.0)
        + durations.get((s, "W"), 0.0)
        for s in stages
    ]
    return {
        "job": record["job"],
        "schedule": schedule,
        "ranks": p,
        "stages": len(stages),
        "microbatches": m,
        "bubble_measured": figures["measured"],
        "bubble_simulated": figures["simulated"],
        "bubble_rel_error": figures["rel_error"],
        "bubble_ideal": (p - 1) / (m + p - 1),
        "within_target": False,  # set below
        "order_matches": all(t == order for t in traced),
        "step_seconds": figures["step_seconds"],
        "step_seconds_simulated": figures["step_seconds_simulated"],
        "transfer_s": figures["transfer_s"],
        "bubble_from_mean_costs": figures["from_mean_costs"],
        "compute_only": {
            k: v for k, v in compute_only.items() if k not in ("durations", "from_mean_costs")
        },
        "bottleneck_predicted": record["bottleneck_predicted"],
        "bottleneck_measured": max(per_stage),
        "lower_bound": record["lower_bound"],
        "stage_seconds": {f"{s}{k}": v for (s, k), v in sorted(durations.items())},
        "units": record["units"],
        "boundaries": record["boundaries"],
    }


def _produced(
    a: Action, ended: dict[Action, float], rank_of: dict[int, int], rank: int
) -> float | None:
    """When the action on another rank whose output ``a`` consumes ended, if there is one."""
    if a.kind == "F" and a.stage > 0:
        sources = [Action(a.stage - 1, "F", a.microbatch)]
    elif a.kind in ("B", "I"):
        sources = [Action(a.stage + 1, k, a.microbatch) for k in ("B", "I")]
    else:
        return None
    for s in sources:
        if s in ended and rank_of.get(s.stage) != rank:
            return ended[s]
    return None
