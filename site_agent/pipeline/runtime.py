"""A site's pipelined trainer across its torchrun ranks: the public entry points and a launch check.

This module is where the rest of crossdc gets a pipelined site from (it re-exports the names a
site needs: ``PipelineConfig``, ``PipelineJob``, ``PipelineTrainer``, ``worker_loop``,
``init_from_torchrun_env``, ``LocalProcessGroup``), and it owns the launch check (``python -m
site_agent.pipeline.runtime``, see ``main``). The pieces live beside it:

- ``job``: ``PipelineConfig`` and ``PipelineJob``, what every rank agrees on; ``replica_seed``.
- ``procgroup``: joining torchrun's process group (``init_from_torchrun_env``) and
  ``LocalProcessGroup``, spawned CPU processes in a gloo group for tests and benchmarks.
- ``setup``: the collective rank setup (profile, partition, broadcast the plan, slice the model).
- ``rank``: one rank's share and its part in each command.
- ``worker``: the control channel and ``worker_loop``, which every rank but 0 runs.
- ``leader``: ``PipelineTrainer``, rank 0's handle with ``LocalTrainer``'s surface.
- ``checkpoint``: the site's state in ``LocalTrainer``'s format, and each rank's share of it.

Layout: ``num_stages x num_replicas`` ranks, rank = ``replica * num_stages + stage``
(``PipelineLayout``). Stage 0 of replica 0 is the leader. Each replica is one pipeline; the ranks
holding the same stage in every replica form that stage's data-parallel group.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from site_agent.data import ByteCorpus
from site_agent.model import ModelConfig
from site_agent.pipeline.job import PipelineConfig, PipelineJob
from site_agent.pipeline.leader import PipelineTrainer
from site_agent.pipeline.procgroup import LocalProcessGroup, init_from_torchrun_env
from site_agent.pipeline.schedule import SCHEDULES
from site_agent.pipeline.worker import worker_loop
from site_agent.trainer import InnerOptimConfig

__all__ = [
    "LAUNCH_CHECK_MODEL",
    "LAUNCH_CHECK_MODULES",
    "LocalProcessGroup",
    "PipelineConfig",
    "PipelineJob",
    "PipelineTrainer",
    "init_from_torchrun_env",
    "launch_check_job",
    "main",
    "worker_loop",
]

# -- launch check ----------------------------------------------------------------------------

LAUNCH_CHECK_MODEL = ModelConfig(context_len=32, num_layers=4, d_model=64, num_heads=4)
LAUNCH_CHECK_MODULES = ("textwrap",)


def launch_check_job(
    *, stages: int, replicas: int, microbatches: int, schedule: str, batch_size: int
) -> PipelineJob:
    """The job ``main`` trains: a small model on one stdlib module, fixed seeds."""
    return PipelineJob(
        model=LAUNCH_CHECK_MODEL,
        optim=InnerOptimConfig(batch_size=batch_size, warmup_steps=0),
        pipeline=PipelineConfig(
            num_stages=stages,
            num_replicas=replicas,
            num_microbatches=microbatches,
            schedule=schedule,
            profile_steps=1,
        ),
        site_id="launch-check",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Launch check: ``torchrun --nproc-per-node S*R -m site_agent.pipeline.runtime --stages S
    --replicas R`` trains a few steps of a small model; rank 0 prints a JSON line."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="site_agent.pipeline.runtime", description=main.__doc__)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    job = launch_check_job(
        stages=args.stages,
        replicas=args.replicas,
        microbatches=args.microbatches,
        schedule=args.schedule,
        batch_size=args.batch_size,
    )
    env = init_from_torchrun_env()
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING)
    torch.set_num_threads(1)
    corpus = ByteCorpus.from_stdlib_modules(LAUNCH_CHECK_MODULES, max_bytes=50_000)
    try:
        if env.rank != 0:
            worker_loop(job, corpus, device=env.device)
            return 0
        with PipelineTrainer.start(job, corpus, device=env.device) as trainer:
            stats = trainer.train_steps(args.steps)
            report = {
                "world_size": env.world_size,
                "backend": env.backend,
                "boundaries": list(trainer.plan.boundaries),
                "steps": trainer.step,
                "loss_mean": stats.loss_mean,
                "loss_last": stats.loss_last,
                "num_parameters": sum(a.size for a in trainer.parameters_numpy().values()),
            }
        print(json.dumps(report), flush=True)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
