"""The byte GPT job itself: its options, the job object crossdc drives, and its factory."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from site_agent.jobs.bytegpt.data import (
    BatchSampler,
    DataConfig,
    eval_batches,
    load_corpora,
    sampler_seed,
)
from site_agent.jobs.bytegpt.model import ModelConfig, build_model, lm_loss
from site_agent.jobs.bytegpt.optim import InnerOptimConfig, WarmupSchedule, adamw
from site_agent.jobs.contract import (
    OPTIONS_TABLE,
    CheckedOptions,
    JobContext,
    checks_options,
    parse_options,
)

Batch = tuple[torch.Tensor, torch.Tensor]


class ByteGPTJob:
    """The byte GPT as a job: random windows of the site's corpus, next-byte cross entropy, and
    the validation loss over a fixed list of held-out batches. A batch weighs its tokens."""

    def __init__(
        self,
        *,
        model: nn.Module,
        sampler: BatchSampler,
        optim_cfg: InnerOptimConfig,
        val_batches: Sequence[Batch] = (),
    ) -> None:
        if sampler.batch_size != optim_cfg.batch_size:
            raise ValueError(
                f"sampler batch_size={sampler.batch_size} differs from "
                f"inner_optim.batch_size={optim_cfg.batch_size}"
            )
        self.model = model
        # What must agree beside the shapes (heads, say): the model's config when it has one.
        cfg = getattr(model, "cfg", None)
        self.architecture = dataclasses.asdict(cfg) if isinstance(cfg, ModelConfig) else {}
        self.sampler = sampler
        self.optimizer = adamw(model, optim_cfg)
        self.scheduler = WarmupSchedule(self.optimizer, optim_cfg)
        self.val_batches = list(val_batches)

    def batches(self) -> Iterator[Batch]:
        while True:
            yield self.sampler.next_batch()

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return lm_loss(model(x), y)

    def split(self, batch: Batch) -> Batch:
        return batch  # (token ids, next-token targets)

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return lm_loss(output, target)

    def weight(self, batch: Batch) -> int:
        return int(batch[1].numel())

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"loss": mean_loss(model, self.val_batches)}

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


def mean_loss(model: nn.Module, batches: Sequence[Batch]) -> float:
    """Mean next-byte loss over ``batches`` (equal-sized batches make it a per-token mean)."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in batches:
        total += lm_loss(model(x.to(device)), y.to(device)).double()
    return float(total.cpu()) / len(batches)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ByteGPTOptions:
    """The byte GPT job's options (``[site.job.options]``; a site's legacy ``[site.model]``,
    ``[site.data]``, ``[site.optim]`` and ``site.eval_*`` are read into them too)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """``[site.job.options.model]``: the model's shape, the same at every site."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """``[site.job.options.data]``: this site's text (its shard of the standard library, or a
    directory)."""
    optim: InnerOptimConfig = dataclasses.field(default_factory=InnerOptimConfig)
    """``[site.job.options.optim]``: AdamW, its warm-up and the batch size."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    eval_batch_size: int = 16
    """Sequences per validation batch."""

    def __post_init__(self) -> None:
        if self.eval_batches < 1 or self.eval_batch_size < 1:
            raise ValueError("eval_batches and eval_batch_size must be >= 1")


def check_options(options: Mapping[str, Any], where: str = OPTIONS_TABLE) -> CheckedOptions:
    """The byte GPT's options read as :func:`make_job` reads them, without loading its data or
    building its model; the model's chain is its embedding, its blocks and its head."""
    opts = parse_options(ByteGPTOptions, options, where)
    return CheckedOptions(layers=opts.model.num_layers + 2, unchanged=opts == ByteGPTOptions())


@checks_options(check_options)
def make_job(ctx: JobContext) -> ByteGPTJob:
    """The factory of the embedded default job (its options checked by :func:`check_options`
    when the site's config is read)."""
    opts = parse_options(ByteGPTOptions, ctx.options)
    data = load_corpora(opts.data)
    model = build_model(opts.model, ctx.seed, device=ctx.device)
    sampler = BatchSampler(
        data.train,
        batch_size=opts.optim.batch_size,
        context_len=opts.model.context_len,
        seed=sampler_seed(ctx.seed, opts.data.shard_index),
    )
    val = eval_batches(
        data.val, opts.eval_batches, opts.eval_batch_size, opts.model.context_len, seed=0
    )
    return ByteGPTJob(model=model, sampler=sampler, optim_cfg=opts.optim, val_batches=val)
