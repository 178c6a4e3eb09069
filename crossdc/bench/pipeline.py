"""Pipeline benchmark: the executor's measured bubble and bottleneck against the simulator.

For every schedule (GPipe, 1F1B), stage count and micro-batch count it starts a site of
``stages`` spawned CPU processes (gloo, one thread each) running a real ``PipelineTrainer``,
partitioned by profiling, and trains a few inner steps. From the executor's per-op timestamps of
each measured step:

- ``step_seconds``: the pipeline's op window, from the earliest rank's step start to the last op's
  end (the gradient all-reduce and optimizer step after it are not part of a schedule; the whole
  step is ``step_seconds_with_update``);
- ``bubble_measured``: ``1 - busy / (stages * step_seconds)``, busy = the cost of every op: its
  compute plus the executor work right after it (posting its send with the next receive), time
  the stage is occupied rather than waiting for a neighbour;
- ``bottleneck_measured``: the slowest stage's mean forward + backward seconds per micro-batch;
- ``bubble_simulated``: ``simulate`` on the same schedule fed the measured per-stage forward and
  backward means and the measured transfer: the median delay from an op's end to the start of
  the op on the neighbouring stage that was waiting for its output (``transfer_s``; a ping-pong
  between two stages, ``transfer_pingpong_s``, is reported beside it);
- ``bottleneck_predicted``: the partition plan's bottleneck from the leader's profile;
- ``bubble_replayed``: the simulator's timing model replayed with every op's own measured time
  instead of per-stage means: it separates idle time the executor adds (measured above replayed)
  from op-time variation the means cannot carry (replayed above simulated).

Figures are medians over the measured steps; op times are means. Timestamps of different ranks
are compared directly (``time.perf_counter``, one host). The simulator assumes every stage runs
in parallel: with fewer cores than stages, ranks share cores, op times stretch while others run
and the comparison says more about the scheduler than the schedule (``cpu_count`` is reported).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

from crossdc.progress import SILENT, Progress, add_progress_argument, open_progress
from site_agent.data import ByteCorpus
from site_agent.model import ModelConfig
from site_agent.pipeline.executor import StepTrace
from site_agent.pipeline.runtime import (
    LocalProcessGroup,
    PipelineConfig,
    PipelineJob,
    PipelineTrainer,
    worker_loop,
)
from site_agent.pipeline.schedule import Op, make_schedule
from site_agent.pipeline.simulate import simulate
from site_agent.trainer import InnerOptimConfig

BENCH_MODEL = ModelConfig(context_len=64, num_layers=8, d_model=128, num_heads=4)
"""Ten layers (embedding, 8 blocks, head): splits evenly into 2 and nearly evenly into 4 stages."""
TARGET_REL_ERROR = 0.10
CORPUS_MODULES = ("argparse", "textwrap", "typing")


@dataclasses.dataclass(frozen=True)
class _Case:
    schedule: str
    stages: int
    microbatches: int


def analyze(
    steps: Sequence[Sequence[StepTrace]],
    *,
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    transfer_s: float,
) -> dict[str, Any]:
    """Measured and simulated figures of one case from per-step traces of one replica's ranks.

    ``steps[k][s]`` is stage s's trace of the k-th measured step; ``transfer_s`` is the ping-pong
    estimate, used when no op of the steps ever waited for its input.
    """
    bubbles, windows, totals, delays, replayed = [], [], [], [], []
    forward: list[list[float]] = [[] for _ in range(num_stages)]
    backward: list[list[float]] = [[] for _ in range(num_stages)]
    for traces in steps:
        assert [t.stage for t in traces] == list(range(num_stages))
        start = min(t.start_s for t in traces)
        end = max(r.end_s for t in traces for r in t.ops)
        window = end - start
        busy = math.fsum(math.fsum(_op_costs(t)) for t in traces)
        windows.append(window)
        totals.append(max(t.end_s for t in traces) - start)
        bubbles.append(1.0 - busy / (num_stages * window))
        for t in traces:
            costs = _op_costs(t)
            for kind, out in (("F", forward), ("B", backward)):
                mine = [c for c, r in zip(costs, t.ops, strict=True) if r.op.kind == kind]
                out[t.stage].append(math.fsum(mine) / len(mine) if mine else 0.0)
        delays.extend(_input_delays(traces))
    fwd = [statistics.fmean(v) for v in forward]
    bwd = [statistics.fmean(v) for v in backward]
    effective_transfer_s = statistics.median(delays) if delays else transfer_s
    for traces in steps:
        replayed.append(_replay_bubble(traces, effective_transfer_s))
    sim = simulate(
        make_schedule(schedule, num_stages, num_microbatches), fwd, bwd, effective_transfer_s
    )
    measured = statistics.median(bubbles)
    return {
        "bubble_measured": measured,
        "bubble_simulated": sim.bubble_fraction,
        "bubble_rel_error": abs(measured - sim.bubble_fraction) / sim.bubble_fraction
        if sim.bubble_fraction > 0
        else abs(measured),
        "bubble_ideal": (num_stages - 1) / (num_microbatches + num_stages - 1),
        "bubble_replayed": statistics.median(replayed),
        "step_seconds": statistics.median(windows),
        "step_seconds_simulated": sim.step_time_s,
        "step_seconds_with_update": statistics.median(totals),
        "bottleneck_measured": max(f + b for f, b in zip(fwd, bwd, strict=True)),
        "stage_forward_s": fwd,
        "stage_backward_s": bwd,
        "transfer_s": effective_transfer_s,
        "transfer_pingpong_s": transfer_s,
    }


def _op_costs(trace: StepTrace) -> list[float]:
    """Each op's cost on its stage: its compute plus the executor work that follows it (posting
    its send, and with the grouped exchange the next op's receive) and, for the first op, the
    step's setup before it: time the stage is occupied, not waiting for a neighbour."""
    ops = trace.ops
    costs = []
    for i, r in enumerate(ops):
        follow = ops[i + 1].wait_start_s if i + 1 < len(ops) else r.end_s
        costs.append(r.compute_s + max(0.0, follow - r.end_s))
    if ops:
        # The step's own setup before its first op (e.g. drawing the micro-batches) is work too.
        costs[0] += max(0.0, ops[0].wait_start_s - trace.start_s)
    return costs


def _replay_bubble(traces: Sequence[StepTrace], transfer_s: float) -> float:
    """The simulator's timing model applied to each op's own measured compute time.

    Every op starts when its stage is free and its input has arrived (producer end + transfer),
    as in ``simulate``, but lasts exactly as long as it did. Where this agrees with the measured
    bubble and ``bubble_simulated`` does not, the gap is op-time variation that per-stage means
    cannot carry, not idle time the executor added.
    """
    num_stages = len(traces)
    costs = {t.stage: _op_costs(t) for t in traces}
    ends: dict[tuple[int, Op], float] = {}
    free_at = [0.0] * num_stages
    position = [0] * num_stages
    busy = 0.0
    progress = True
    while progress:
        progress = False
        for t in traces:
            s = t.stage
            if position[s] == len(t.ops):
                continue
            record = t.ops[position[s]]
            producer = s - 1 if record.op.kind == "F" else s + 1
            ready = free_at[s]
            if 0 <= producer < num_stages:
                if (producer, record.op) not in ends:
                    continue
                ready = max(ready, ends[(producer, record.op)] + transfer_s)
            cost = costs[s][position[s]]
            ends[(s, record.op)] = free_at[s] = ready + cost
            busy += cost
            position[s] += 1
            progress = True
    assert all(position[t.stage] == len(t.ops) for t in traces), "the traces ran to the end"
    return 1.0 - busy / (num_stages * max(free_at))


def _input_delays(traces: Sequence[StepTrace]) -> list[float]:
    """Producer send posted to consumer compute start, for every op that was already waiting for
    its input then: the transfer as the executor experiences it (copy and wake-up included)."""
    # An output is on its way once its op ended and its send was posted.
    ends = {
        (t.stage, r.op): r.start_s + cost
        for t in traces
        for r, cost in zip(t.ops, _op_costs(t), strict=True)
    }
    delays = []
    for t in traces:
        for r in t.ops:
            producer = t.stage - 1 if r.op.kind == "F" else t.stage + 1
            end = ends.get((producer, r.op))
            if end is not None and r.wait_start_s <= end:
                delays.append(max(0.0, r.start_s - end))
    return delays


def _job(case: _Case, model: ModelConfig, microbatch_size: int) -> PipelineJob:
    return PipelineJob(
        model=model,
        optim=InnerOptimConfig(batch_size=microbatch_size * case.microbatches, warmup_steps=0),
        pipeline=PipelineConfig(
            num_stages=case.stages,
            num_microbatches=case.microbatches,
            schedule=case.schedule,
            profile_steps=5,
        ),
        site_id="bench",
    )


def _bench_rank(
    rank: int,
    world: int,
    cases: list[_Case],
    corpus: ByteCorpus,
    model: ModelConfig,
    microbatch_size: int,
    warmup_steps: int,
    measure_steps: int,
) -> list[dict[str, Any]] | None:
    results = []
    for case in cases:
        job = _job(case, model, microbatch_size)
        if rank != 0:
            worker_loop(job, corpus, device="cpu")
            continue
        with PipelineTrainer.start(job, corpus, device="cpu") as trainer:
            trainer.train_steps(warmup_steps)
            transfer_s = trainer.measure_transfer_s()
            steps = []
            for _ in range(measure_steps):
                trainer.train_steps(1)
                steps.append(trainer.last_step_traces())
            plan = trainer.plan
        results.append(
            {
                "case": case,
                "steps": steps,
                "transfer_s": transfer_s,
                "boundaries": list(plan.boundaries),
                "bottleneck_predicted": plan.bottleneck,
                "lower_bound": plan.lower_bound,
            }
        )
    return results if rank == 0 else None


def _run_figures(result: dict[str, Any]) -> dict[str, Any]:
    """One case's entry in the report, from what its leader rank measured."""
    case = result["case"]
    figures = analyze(
        result["steps"],
        schedule=case.schedule,
        num_stages=case.stages,
        num_microbatches=case.microbatches,
        transfer_s=result["transfer_s"],
    )
    return {
        "schedule": case.schedule,
        "stages": case.stages,
        "microbatches": case.microbatches,
        "bubble_measured": figures.pop("bubble_measured"),
        "bubble_simulated": figures.pop("bubble_simulated"),
        "step_seconds": figures.pop("step_seconds"),
        "bottleneck_predicted": result["bottleneck_predicted"],
        "bottleneck_measured": figures.pop("bottleneck_measured"),
        **figures,
        "within_target": figures["bubble_rel_error"] <= TARGET_REL_ERROR,
        "boundaries": result["boundaries"],
        "lower_bound": result["lower_bound"],
    }


def run(
    *,
    schedules: Sequence[str] = ("gpipe", "1f1b"),
    stages: Sequence[int] = (2, 4),
    microbatches: Sequence[int] = (4, 8),
    model: ModelConfig = BENCH_MODEL,
    microbatch_size: int = 16,
    warmup_steps: int = 2,
    measure_steps: int = 10,
    timeout_s: float = 600.0,
    progress: Progress = SILENT,
) -> dict[str, Any]:
    """Run every (schedule, stages, microbatches) case; one spawned site per stage count."""
    if warmup_steps < 1 or measure_steps < 1 or microbatch_size < 1:
        raise ValueError("warmup_steps, measure_steps and microbatch_size must be >= 1")
    for case in (_Case(s, p, m) for s in schedules for p in stages for m in microbatches):
        _job(case, model, microbatch_size)  # ValueError here rather than in a spawned rank
    corpus = ByteCorpus.from_stdlib_modules(CORPUS_MODULES, max_bytes=400_000)
    runs: list[dict[str, Any]] = []
    with LocalProcessGroup(max(stages), timeout_s=timeout_s) as group:
        for i, p in enumerate(stages, 1):
            cases = [_Case(s, p, m) for s in schedules for m in microbatches]
            n = len(cases)
            progress.phase(f"{n} case{'s' * (n != 1)} with {p} stages", i, len(stages))
            results = group.run(
                _bench_rank,
                cases,
                corpus,
                model,
                microbatch_size,
                warmup_steps,
                measure_steps,
                world_size=p,
            )[0]
            runs += [_run_figures(result) for result in results]
    return {
        "runs": runs,
        "model": dataclasses.asdict(model),
        "microbatch_size": microbatch_size,
        "measure_steps": measure_steps,
        "cpu_count": os.cpu_count(),
        "target_rel_error": TARGET_REL_ERROR,
        "all_within_target": all(r["within_target"] for r in runs),
    }


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"cpu_count={report['cpu_count']} microbatch_size={report['microbatch_size']} "
        f"target: |measured - simulated| / simulated <= {report['target_rel_error']}",
        f"{'schedule':>8} {'p':>2} {'m':>2} {'bubble':>7} {'sim':>7} {'ideal':>7} {'rel.err':>7} "
        f"{'step_s':>7} {'bneck_pred':>10} {'bneck_meas':>10}",
    ]
    for r in report["runs"]:
        lines.append(
            f"{r['schedule']:>8} {r['stages']:>2} {r['microbatches']:>2} "
            f"{r['bubble_measured']:7.3f} {r['bubble_simulated']:7.3f} {r['bubble_ideal']:7.3f} "
            f"{r['bubble_rel_error']:7.3f} {r['step_seconds']:7.3f} "
            f"{r['bottleneck_predicted']:10.4f} {r['bottleneck_measured']:10.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crossdc bench pipeline", description=__doc__)
    parser.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated names")
    parser.add_argument("--stages", default="2,4", help="comma-separated stage counts")
    parser.add_argument("--microbatches", default="4,8", help="comma-separated counts")
    parser.add_argument("--microbatch-size", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--measure-steps", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_progress_argument(parser)
    args = parser.parse_args(argv)
    with open_progress("crossdc bench pipeline", no_progress=args.no_progress) as progress:
        report = run(
            schedules=args.schedules.split(","),
            stages=[int(v) for v in args.stages.split(",")],
            microbatches=[int(v) for v in args.microbatches.split(",")],
            microbatch_size=args.microbatch_size,
            warmup_steps=args.warmup_steps,
            measure_steps=args.measure_steps,
            progress=progress,
        )
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
