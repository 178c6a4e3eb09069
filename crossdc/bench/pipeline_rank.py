"""One rank of ``crossdc bench pipeline``: run under torchrun, one process per pipeline rank.

For every case given (schedule, micro-batches) it builds the job's pipelined site exactly as a
site agent does (``SiteRank``: the job from its factory, profiled and cut on rank 0, one
``PipelineStage`` per stage, torch's schedule), times every compute action torch's schedule
runs on each of its stages (``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk`` and the last stage's loss) and the schedule's ``step`` itself,
trains some warm-up steps and then the measured ones, and gathers the traces on rank 0, which
writes them with the plan and torch's ``pipeline_order`` to ``--out`` as JSON.

Times are ``time.perf_counter`` (CLOCK_MONOTONIC, comparable across the processes of one host).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

Event = tuple[int, str, int, float, float]
"""(stage, kind, micro-batch, start, end); kind F, B, I, W or L (the last stage's loss)."""


class ActionTracer:
    """Records the start and end of every compute action on this rank's stages."""

    def __init__(self, stages: list[Any], schedule: Any) -> None:
        self.events: list[Event] = []
        self.steps: list[tuple[float, float]] = []
        for stage in stages:
            self._wrap(stage, "forward_one_chunk", "F")
            self._wrap(stage, "backward_one_chunk", "B")
            self._wrap(stage, "backward_weight_one_chunk", "W")
        self._wrap(schedule, "_maybe_compute_loss", "L")
        self._wrap(schedule, "step", "")

    def _wrap(self, owner: Any, name: str, kind: str) -> None:
        """Time ``owner.name``: as an action of ``owner`` (a stage) for F, B and W (B is I when
        called with ``full_backward=False``), of its first argument (the stage) for the loss,
        and as the step's window for ``""``."""
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                end = time.perf_counter()
                if kind == "":
                    self.steps.append((start, end))
                elif kind == "L":
                    if args[0].is_last:
                        self.events.append((args[0].stage_index, "L", int(args[3]), start, end))
                else:
                    split = kind == "B" and not kwargs.get("full_backward", True)
                    mb = int(args[0])
                    self.events.append((owner.stage_index, "I" if split else kind, mb, start, end))

        setattr(owner, name, timed)

    def take_step(self) -> dict[str, Any]:
        """The last step's window and events; clears both."""
        (start, end), events = self.steps[-1], self.events
        self.steps, self.events = [], []
        return {"start": start, "end": end, "events": events}


def _pipeline_order(schedule: Any) -> dict[int, list[str]] | None:
    order = getattr(schedule, "pipeline_order", None)
    if not order or not hasattr(schedule, "_stages"):
        return None  # gpipe and 1f1b: their pipeline_order is not what they run
    return {int(r): [str(a) if a is not None else "" for a in acts] for r, acts in order.items()}


def run_case(case: dict[str, Any], common: dict[str, Any]) -> dict[str, Any] | None:
    """Build the site for ``case``, train, and return rank 0's record of it."""
    from site_agent.jobs.contract import JobContext, build_job
    from site_agent.pipeline.engine import PipelineConfig
    from site_agent.pipeline.rank import SiteRank

    device = torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    context = JobContext(
        site_id="bench",
        seed=0,
        device=device,
        options=case["options"],
        rank=rank,
        world_size=world,
        state_dir=Path(common["state_dir"]),
    )
    cfg = PipelineConfig(
        num_stages=world,
        num_microbatches=case["microbatches"],
        schedule=case["schedule"],
        profile_steps=common["profile_steps"],
        site_id="bench",
    )
    site = SiteRank(build_job(common["factory"], context), cfg, device)
    schedule = site.pipeline.schedule
    tracer = ActionTracer(site.pipeline.stages, schedule)
    site.train(common["warmup_steps"])
    tracer.take_step()
    steps = []
    for _ in range(common["measure_steps"]):
        site.train(1)
        steps.append(tracer.take_step())
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(steps, parts, dst=0, group=site.control)
    if parts is None:
        return None
    plan = site.pipeline.plan.partition
    return {
        **{k: v for k, v in case.items() if k != "options"},
        "ranks": len(parts),
        "traces": [[parts[r][k] for r in range(len(parts))] for k in range(len(steps))],
        "pipeline_order": _pipeline_order(schedule),
        "units": list(site.pipeline.plan.cut.units.names),
        "boundaries": list(plan.boundaries),
        "bottleneck_predicted": plan.bottleneck,
        "lower_bound": plan.lower_bound,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("spec", type=Path, help="JSON: {common: {...}, cases: [...]}")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        records = [run_case(case, spec["common"]) for case in spec["cases"]]
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(records))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # skip finalization, where gloo's threads can abort a finished process


if __name__ == "__main__":
    raise SystemExit(main())
