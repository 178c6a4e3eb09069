"""Pipeline benchmark: torch's schedules as a site runs them, measured against the simulator.

For each job (the byte GPT, and the Hugging Face Llama where ``transformers`` is installed) it
starts one torchrun of ``ranks`` CPU processes (gloo, one thread each) and, for every schedule and
micro-batch count, builds the pipelined site exactly as a site agent does (the job from its
factory, profiled and cut by the partitioner, ``PipelineStage`` per stage, torch's schedule),
trains warm-up steps, then times every compute action of the measured steps
(``crossdc.bench.pipeline_rank``). Per case:

- ``bubble_measured``: the share of the ranks' time spent waiting for a neighbour, over all the
  measured steps (``1 - busy / (ranks * step time)``, pooled). A step runs from the earliest
  rank's ``schedule.step`` call to the last action's end (the optimizer step after it is not part
  of a schedule). Busy is every compute action (forward with the last stage's loss, backward, or
  the split backward's input and weight parts) plus the schedule's own work before it (posting
  sends and receives): the gap before an action whose input was already there, and that step's
  mean such gap for the (stage, kind) where the rank waited for its input.
- ``bubble_simulated``: each measured step replayed by the simulator on the order it ran
  (the order torch runs, ``executed_order``, when ``order_matches``), every action
  lasting its own measured cost counted as above, with the measured hand-off (``transfer_s``: the
  median delay from the end of an action on one rank to the start of the action on another that
  was waiting for its output, less that action's own work), pooled over the steps as the
  measurement is. Busy time is then the same on both sides: what differs is when the simulator's
  model of the order, the dependencies and the hand-off lets each action start.
- ``bubble_from_mean_costs``: the same from that step's mean cost per (stage, kind), as a
  prediction from a profile has it (per-action spread lengthens a real step, not the means').
- ``compute_only``: the replay with compute alone as busy and the hand-off a pure delay.
- ``bubble_ideal``: ``(p - 1) / (m + p - 1)`` for p pipeline ranks and m micro-batches.
- ``bottleneck_predicted`` (the partition plan's, from rank 0's profile) and
  ``bottleneck_measured`` (the slowest stage's mean forward + backward per micro-batch).

The simulator assumes every rank runs in parallel: with fewer cores than ranks the processes
share cores and the comparison says more about the OS scheduler than the schedule
(``cpu_count`` is reported).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crossdc.bench.pipeline_trace import analyze
from crossdc.progress import SILENT, Progress, add_progress_argument, open_progress

TARGET_REL_ERROR = 0.10
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv")
CORPUS = {"source": "stdlib", "max_bytes": 400_000}
JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    "bytegpt": (
        "site_agent.jobs.bytegpt:make_job",
        {
            "model": {"context_len": 64, "num_layers": 8, "d_model": 128, "num_heads": 4},
            "data": CORPUS,
        },
    ),
    "hf": (
        "site_agent.jobs.hf:make_job",
        {
            "model_type": "llama",
            "config": {
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 8,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
            },
            "context_len": 64,
            "data": CORPUS,
        },
    ),
}
"""Job name -> (factory, options); ten units each (embedding, 8 blocks, head)."""


def _batch_options(job: str, batch: int) -> dict[str, Any]:
    return (
        {"optim": {"batch_size": batch, "warmup_steps": 0}}
        if job == "bytegpt"
        else {
            "batch_size": batch,
            "warmup_steps": 0,
        }
    )


def _launch(
    job: str, cases: list[dict[str, Any]], ranks: int, common: dict[str, Any], timeout_s: float
) -> list[dict[str, Any]]:
    """One torchrun of ``ranks`` processes running every case of ``job``."""
    with tempfile.TemporaryDirectory(prefix="crossdc-bench-pipeline-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        common = {**common, "state_dir": tmp}
        spec.write_text(json.dumps({"common": common, "cases": cases}))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += [f"--nproc-per-node={ranks}", "-m", "crossdc.bench.pipeline_rank"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [*argv, str(spec), "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"the {job} pipeline ranks failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
            )
        records: list[dict[str, Any]] = json.loads(out.read_text())
    for record in records:
        record["job"] = job
    return records


def run(
    *,
    jobs: Sequence[str] = ("bytegpt", "hf"),
    schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved_1f1b"),
    ranks: int = 2,
    microbatches: Sequence[int] = (4, 8),
    microbatch_size: int = 16,
    warmup_steps: int = 2,
    measure_steps: int = 10,
    profile_steps: int = 3,
    timeout_s: float = 900.0,
    progress: Progress = SILENT,
) -> dict[str, Any]:
    """Every (job, schedule, micro-batches) case; one torchrun per job."""
    if min(ranks, microbatch_size, warmup_steps, measure_steps, profile_steps) < 1:
        raise ValueError("ranks, microbatch_size and the step counts must be >= 1")
    if not microbatches or min(microbatches) < 1:
        raise ValueError(f"microbatches must be >= 1, got {list(microbatches)}")
    unknown = [s for s in schedules if s not in SCHEDULES] + [j for j in jobs if j not in JOBS]
    if unknown:
        raise ValueError(f"unknown schedule or job {unknown}; schedules: {', '.join(SCHEDULES)}")
    skipped = []
    if "hf" in jobs and importlib.util.find_spec("transformers") is None:
        skipped.append("hf (transformers is not installed: pip install crossdc[hf])")
        jobs = [j for j in jobs if j != "hf"]
    runs: list[dict[str, Any]] = []
    for i, job in enumerate(jobs, 1):
        factory, options = JOBS[job]
        progress.phase(f"{job}: {len(schedules) * len(microbatches)} cases", i, len(jobs))
        cases = [
            {
                "schedule": s,
                "microbatches": m,
                "options": {**options, **_batch_options(job, m * microbatch_size)},
            }
            for s in schedules
            for m in microbatches
        ]
        common = {
            "factory": factory,
            "warmup_steps": warmup_steps,
            "measure_steps": measure_steps,
            "profile_steps": profile_steps,
        }
        for record in _launch(job, cases, ranks, common, timeout_s):
            figures = analyze(record)
            figures["within_target"] = figures["bubble_rel_error"] <= TARGET_REL_ERROR
            runs.append(figures)
    return {
        "runs": runs,
        "skipped": skipped,
        "microbatch_size": microbatch_size,
        "measure_steps": measure_steps,
        "cpu_count": os.cpu_count(),
        "target_rel_error": TARGET_REL_ERROR,
        "all_within_target": bool(runs) and all(r["within_target"] for r in runs),
    }


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"cpu_count={report['cpu_count']} microbatch_size={report['microbatch_size']} "
        f"target: |measured / simulated - 1| <= {report['target_rel_error']}",
        f"{'job':>7} {'schedule':>16} {'p':>2} {'m':>2} {'bubble':>7} {'sim':>7} {'ideal':>7} "
        f"{'rel.err':>7} {'order':>5} {'step_s':>7} {'bneck_pred':>10} {'bneck_meas':>10}",
    ]
    for r in report["runs"]:
        lines.append(
            f"{r['job']:>7} {r['schedule']:>16} {r['ranks']:>2} {r['microbatches']:>2} "
            f"{r['bubble_measured']:7.3f} {r['bubble_simulated']:7.3f} {r['bubble_ideal']:7.3f} "
            f"{r['bubble_rel_error']:7.3f} {str(r['order_matches']):>5} {r['step_seconds']:7.3f} "
            f"{r['bottleneck_predicted']:10.4f} {r['bottleneck_measured']:10.4f}"
        )
    lines += [f"skipped: {s}" for s in report["skipped"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crossdc bench pipeline", description=__doc__)
    parser.add_argument("--jobs", default="bytegpt,hf", help="comma-separated: bytegpt, hf")
    parser.add_argument(
        "--schedules", default="gpipe,1f1b,interleaved_1f1b", help=f"of {', '.join(SCHEDULES)}"
    )
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks (processes)")
    parser.add_argument("--microbatches", default="4,8", help="comma-separated counts")
    parser.add_argument("--microbatch-size", type=int, default=16, help="samples per micro-batch")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--measure-steps", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_progress_argument(parser)
    args = parser.parse_args(argv)
    with open_progress("crossdc bench pipeline", no_progress=args.no_progress) as progress:
        report = run(
            jobs=args.jobs.split(","),
            schedules=args.schedules.split(","),
            ranks=args.ranks,
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
