"""Assembling and launching a site: its job and trainer, the agent, and the torchrun processes
of a site that spans several devices."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from comm.durable import atomic_write
from site_agent.agent import SiteAgent
from site_agent.config import SiteConfig, resolve_device
from site_agent.exits import EXIT_CANNOT_START, EXIT_OK
from site_agent.jobs.contract import Job, JobContext, build_job
from site_agent.metrics import SiteMetrics
from site_agent.trainer import JobTrainer

log = logging.getLogger("crossdc.site")


def build_site_job(
    cfg: SiteConfig, device: torch.device, *, rank: int = 0, world_size: int = 1
) -> Job:
    """The site's job, built by its factory for this process (rank ``rank`` of the site)."""
    context = JobContext(
        site_id=cfg.site_id,
        seed=cfg.seed,
        device=device,
        options=cfg.job.options,
        rank=rank,
        world_size=world_size,
        state_dir=cfg.state_path,
    )
    return build_job(cfg.job.factory, context, cfg.job.python_path)


def build_job_trainer(cfg: SiteConfig, metrics: SiteMetrics | None = None) -> JobTrainer:
    """The site's job, built by its factory, in a trainer; checked on one batch and θ0 before
    anything connects (:class:`~site_agent.jobs.contract.JobError` says what is wrong)."""
    device = torch.device(resolve_device(cfg.device))
    trainer = JobTrainer(
        build_site_job(cfg, device),
        grad_clip=cfg.job.grad_clip,
        device=device,
        max_nonfinite_steps=cfg.job.max_nonfinite_steps,
        on_skipped=metrics.nonfinite_step if metrics is not None else None,
        where=f"the job from {cfg.job.factory!r}",
    )
    trainer.preflight()
    return trainer


def build_agent(cfg: SiteConfig) -> SiteAgent:
    """Assemble a single-process site from its config (its job in a trainer, the agent)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    metrics = SiteMetrics(cfg.site_id)
    trainer = build_job_trainer(cfg, metrics)
    return SiteAgent(cfg, trainer=trainer, metrics=metrics)


def under_torchrun() -> bool:
    """True in a process torchrun started (it sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_argv(cfg: SiteConfig, agent_argv: list[str]) -> list[str]:
    """The torchrun command that runs this site as ``stages x replicas`` processes."""
    import sys

    world = cfg.stages * cfg.replicas
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "crossdc",
        *agent_argv,
    ]


def pipeline_config(cfg: SiteConfig) -> Any:
    """How every rank of the pipelined site pipelines its job, from the site's config."""
    from site_agent.pipeline.engine import PipelineConfig

    return PipelineConfig(
        site_id=cfg.site_id,
        num_stages=cfg.stages,
        num_replicas=cfg.replicas,
        num_microbatches=cfg.microbatches,
        schedule=cfg.schedule,
        data_parallel=cfg.data_parallel,
        grad_clip=cfg.job.grad_clip,
        # Each rank syncs its own tensors, unless the site needs what only the gathered model
        # does yet (differential privacy, secure aggregation).
        sync_shards=not cfg.not_for_sharded_sites(),
        error_feedback_decay=cfg.error_feedback_decay,
        rank_timeout_s=cfg.rank_timeout_s,
        # A restart cuts as the last start did: each rank finds its optimizer state's tensors.
        cut_record=str(cfg.state_path / "pipeline-cut.json"),
    )


def run_pipeline_site(cfg: SiteConfig) -> int:
    """Entry point of every rank of a pipelined site (launched by torchrun).

    Rank 0 is the site leader: it runs the agent, whose trainer drives the other ranks through
    torch.distributed. Only rank 0 ever opens a WAN socket; the workers run
    ``worker_loop``. Any job with ``split`` and ``output_loss`` runs so, the byte GPT too.
    """
    import torch.distributed as dist

    from site_agent.pipeline.procgroup import init_from_torchrun_env
    from site_agent.pipeline.rank import StartRefused, worker_loop

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    env = init_from_torchrun_env()
    if env.world_size != cfg.stages * cfg.replicas:
        raise ValueError(
            f"torchrun started {env.world_size} processes but site.stages x site.replicas = "
            f"{cfg.stages * cfg.replicas}"
        )
    try:
        # Every rank builds the job; if one cannot, the site stops with the leader's status
        # and one line naming why, not with a rank's traceback (which torchrun reports first).
        refused: str | None = None
        try:  # JobError is a ValueError
            job = build_site_job(cfg, env.device, rank=env.rank, world_size=env.world_size)
        except (ValueError, OSError) as exc:
            refused = str(exc) if env.rank == 0 else f"rank {env.rank}: {exc}"
        refusals: list[Any] = [None] * env.world_size
        dist.all_gather_object(refusals, refused)
        if any(r is not None for r in refusals):
            if env.rank == 0:
                _cannot_start(cfg, next(r for r in refusals if r is not None))
            return EXIT_CANNOT_START
        if env.rank == 0:
            return _lead_pipeline_site(cfg, job, env.device)
        # A stop is the leader's to carry out, between steps (it then releases us): a worker
        # that died on SIGTERM would leave the leader inside a collective.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            worker_loop(job, pipeline_config(cfg), env.device)
        except StartRefused:
            return EXIT_CANNOT_START  # the leader says why
        return EXIT_OK
    finally:
        dist.destroy_process_group()


def _cannot_start(cfg: SiteConfig, exc: Exception | str) -> int:
    """As a site of one process: the reason on one line, and a status a supervisor does not
    restart (torchrun then stops the workers)."""
    print(f"crossdc agent: cannot start: {exc}", file=sys.stderr)
    write_leader_exit(cfg, EXIT_CANNOT_START)
    return EXIT_CANNOT_START


def _lead_pipeline_site(cfg: SiteConfig, job: Job, device: torch.device) -> int:
    """Rank 0: the pipeline over every rank, and the agent over it; returns the exit status."""
    from site_agent.pipeline.leader import PipelineTrainer

    where = f"the job from {cfg.job.factory!r}"
    try:  # the job's pipeline check and its cut
        pipeline = PipelineTrainer(job, pipeline_config(cfg), device, where=where)
    except (ValueError, OSError) as exc:
        return _cannot_start(cfg, exc)
    with pipeline:
        try:
            agent = SiteAgent(cfg, trainer=pipeline)  # reads the site's key kit
        except (ValueError, OSError) as exc:
            return _cannot_start(cfg, exc)
        signal.signal(signal.SIGTERM, lambda *_: agent.request_stop("stopped by signal"))
        agent.start()
        try:
            code = agent.run()
        finally:
            agent.close()
        write_leader_exit(cfg, code)
        return code


def leader_exit_path(cfg: SiteConfig) -> Path:
    """Where a pipelined site's leader leaves its exit code: torchrun reports only "a worker
    failed", and the supervisor's restart rules need the code itself."""
    return cfg.state_path / "leader-exit.json"


def write_leader_exit(cfg: SiteConfig, code: int) -> None:
    path = leader_exit_path(cfg)
    atomic_write(path, json.dumps({"exit_code": code}).encode(), mode=0o644)


def read_leader_exit(cfg: SiteConfig) -> int | None:
    """The code the leader of the last run left, if it got that far."""
    try:
        code = json.loads(leader_exit_path(cfg).read_text())["exit_code"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, int) else None
