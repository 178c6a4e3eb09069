"""The byte GPT's trainer for benchmarks, baselines and tests, built from its pieces (a model, a
sampler, an optimizer config) rather than from a job factory; and, for the data-parallel baseline
(``crossdc.ddp``), the same trainer and data built from a site's config, so that the baseline
trains on the same batches of the same model as the site would."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from site_agent.config import SiteConfig, resolve_device
from site_agent.jobs.bytegpt import ByteGPTJob, ByteGPTOptions, mean_loss
from site_agent.jobs.bytegpt.data import BatchSampler, SiteData, load_corpora, sampler_seed
from site_agent.jobs.bytegpt.model import build_model
from site_agent.jobs.bytegpt.optim import InnerOptimConfig
from site_agent.jobs.contract import parse_options
from site_agent.trainer import JobTrainer

Batch = tuple[torch.Tensor, torch.Tensor]


class LocalTrainer(JobTrainer):
    """The byte GPT's trainer, built from its pieces (benchmarks and tests build it so); its
    ``evaluate`` takes the batches to score."""

    def __init__(
        self,
        *,
        model: nn.Module,
        sampler: BatchSampler,
        optim_cfg: InnerOptimConfig,
        grad_clip: float = 1.0,
        device: str | torch.device = "cpu",
    ) -> None:
        model = model.to(torch.device(device))
        super().__init__(
            ByteGPTJob(model=model, sampler=sampler, optim_cfg=optim_cfg),
            grad_clip=grad_clip,
            device=device,
        )
        self.sampler = sampler
        self.optim_cfg = optim_cfg

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> float:
        """Mean loss over ``batches`` in eval mode."""
        was_training = self.model.training
        self.model.eval()
        try:
            return mean_loss(self.model, batches)
        finally:
            self.model.train(was_training)


def bytegpt_options(cfg: SiteConfig) -> ByteGPTOptions:
    """The byte GPT job's options of a site that runs it (``[site.job.options]``)."""
    return parse_options(ByteGPTOptions, cfg.job.options)


def load_site_data(cfg: SiteConfig) -> SiteData:
    """The byte GPT job's training corpus and validation corpus (never trained on)."""
    return load_corpora(bytegpt_options(cfg).data)


def build_local_trainer(cfg: SiteConfig, data: SiteData) -> LocalTrainer:
    """The site's byte GPT (its model, seed, shard and optimizer) in a :class:`LocalTrainer`."""
    opts = bytegpt_options(cfg)
    device = resolve_device(cfg.device)
    model = build_model(opts.model, cfg.seed, device=device)
    sampler = BatchSampler(
        data.train,
        batch_size=opts.optim.batch_size,
        context_len=opts.model.context_len,
        seed=sampler_seed(cfg.seed, opts.data.shard_index),
    )
    return LocalTrainer(
        model=model,
        sampler=sampler,
        optim_cfg=opts.optim,
        grad_clip=cfg.job.grad_clip,
        device=device,
    )
