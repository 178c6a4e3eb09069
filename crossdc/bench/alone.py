"""A job trained alone: one site's job, on its own share, without a federation, for a given
number of inner steps on the CPU. Its validation metrics are the baseline a federation of such
sites must beat (docs/jobs.md, the digits job)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from site_agent.jobs.contract import JobContext, build_job
from site_agent.trainer import JobTrainer

DIGITS_FACTORY = "site_agent.jobs.digits:make_job"


def train_alone(
    options: Mapping[str, Any],
    seed: int,
    steps: int,
    factory: str = DIGITS_FACTORY,
    site_id: str = "alone",
) -> dict[str, float]:
    """The validation metrics of the job ``factory`` with ``options`` trained alone for
    ``steps`` inner steps (on the CPU); the digits job by default."""
    ctx = JobContext(site_id=site_id, seed=seed, device=torch.device("cpu"), options=options)
    trainer = JobTrainer(build_job(factory, ctx), where=f"the job from {factory!r} alone")
    trainer.train_steps(steps)
    return trainer.validate()
