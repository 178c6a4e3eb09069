"""A built-in job: a Hugging Face ``transformers`` causal LM, built from a config (never
downloaded) and trained on a site's text (the byte GPT's corpora,
``site_agent.jobs.bytegpt.data``) with AdamW and a linear warm-up.

``make_job`` is its factory (``[site.job] factory = "site_agent.jobs.hf:make_job"``); its options
(``[site.job.options]``) are the fields of :class:`HFOptions`. It owns the model's construction
from ``model_type`` and ``config`` (seeded, so every site starts from the same weights), the
vocabulary (bytes 0..255, or the ids of a ``tokenizers`` JSON file), the batches of its data
share, the next-token loss, the validation metrics and its data cursor. It needs the ``hf`` extra
(``transformers``, and ``tokenizers`` for ``tokenizer_file``), imported only when a job is made.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from site_agent.jobs.bytegpt.data import (
    BatchSampler,
    ByteCorpus,
    DataConfig,
    eval_batches,
    load_corpora,
)
from site_agent.jobs.bytegpt.data import sampler_seed as data_sampler_seed
from site_agent.jobs.bytegpt.optim import InnerOptimConfig, WarmupSchedule, adamw
from site_agent.jobs.contract import JobContext, parse_options

Batch = tuple[torch.Tensor, torch.Tensor]
"""Input ids and next-token targets, both int64 ``[B, T]``."""

TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}
"""The default ``config`` of ``model_type = "llama"``; a given ``config`` table overrides it."""

BYTE_VOCAB = 256
_MISSING = "the hf job needs transformers and tokenizers: pip install crossdc[hf]"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFOptions:
    """The hf job's options (``[site.job.options]``)."""

    model_type: str = "llama"
    """A ``transformers`` model type (``AutoConfig.for_model``)."""
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of that config (over ``TINY_LLAMA`` for llama)."""
    tokenizer_file: str = ""
    """A ``tokenizers`` JSON file; empty: byte-level ids 0..255."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    context_len: int = 64
    batch_size: int = 8
    eval_batches: int = 4
    eval_batch_size: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.1
    """On parameters of two or more dimensions; 0 on the others."""
    betas: tuple[float, ...] = (0.9, 0.95)
    warmup_steps: int = 20

    def __post_init__(self) -> None:
        for name in ("context_len", "batch_size", "eval_batches", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"site.job.options.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not self.weight_decay >= 0 or self.warmup_steps < 0:
            raise ValueError("site.job.options: lr must be > 0, weight_decay and warmup_steps >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(
                f"site.job.options.betas must be two numbers in [0, 1), got {self.betas}"
            )


class TokenCorpus(ByteCorpus):
    """A corpus of token ids of any integer dtype (``BatchSampler`` reads only ``data``)."""

    def __init__(self, data: np.ndarray, *, source: str) -> None:
        self.data = data
        self.source = source


def encode(tokenizer: Any, corpus: ByteCorpus) -> TokenCorpus:
    """``corpus``'s text as token ids, encoded in blocks of lines (in parallel) and joined."""
    lines = corpus.data.tobytes().decode("utf-8", errors="replace").splitlines(keepends=True)
    blocks = ["".join(lines[i : i + 256]) for i in range(0, len(lines), 256)]
    encoded = tokenizer.encode_batch(blocks, add_special_tokens=False)
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encoded), dtype=np.int64)
    return TokenCorpus(ids, source=f"{corpus.source} as tokens")


class HFJob:
    """A causal LM as a job: random windows of the site's ids, next-token cross entropy over
    every position, and the validation loss and perplexity over fixed held-out batches. A batch
    weighs its target tokens."""

    def __init__(
        self,
        *,
        model: nn.Module,
        sampler: BatchSampler,
        optim_cfg: InnerOptimConfig,
        val_batches: list[Batch],
        architecture: dict[str, Any],
    ) -> None:
        self.model = model
        self.architecture = architecture
        self.sampler = sampler
        self.optimizer = adamw(model, optim_cfg)
        self.scheduler = WarmupSchedule(self.optimizer, optim_cfg)
        self.val_batches = val_batches

    def batches(self) -> Iterator[Batch]:
        while True:
            yield self.sampler.next_batch()

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return self.output_loss(model(input_ids=x, use_cache=False).logits, y)

    def split(self, batch: Batch) -> Batch:
        return batch  # (input ids, next-token targets); the model's first argument is input_ids

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross entropy of the logits (what a pipeline's last stage hands on)."""
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())

    def weight(self, batch: Batch) -> int:
        return int(batch[1].numel())

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        losses = [self.loss(model, (x.to(device), y.to(device))) for x, y in self.val_batches]
        loss = float(torch.stack(losses).double().mean().cpu())
        return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf}

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


def load_tokenizer(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` saved at ``path``."""
    import tokenizers

    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as exc:
        raise ValueError(
            f"site.job.options.tokenizer_file {path!r}: cannot load it: {exc}"
        ) from exc


def build_config(transformers: Any, opts: HFOptions, vocab: int) -> Any:
    """The model's config, checked: no key its model type does not know, room for the ids
    and for ``context_len`` positions."""
    kwargs = {**(TINY_LLAMA if opts.model_type == "llama" else {}), **opts.config}
    kwargs.setdefault("vocab_size", vocab)
    if not isinstance(kwargs["vocab_size"], int) or kwargs["vocab_size"] < vocab:
        raise ValueError(
            f"site.job.options.config.vocab_size={kwargs['vocab_size']} is smaller than the "
            f"vocabulary ({vocab} ids)"
        )
    config = transformers.AutoConfig.for_model(opts.model_type, **kwargs)
    # An unknown keyword lands in the config as an extra attribute: a typo would pass unseen.
    known = set(transformers.AutoConfig.for_model(opts.model_type).to_dict())
    unknown = sorted(set(config.to_dict()) - known)
    if unknown:
        raise ValueError(f"site.job.options.config: {opts.model_type} has no {unknown[0]!r}")
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < opts.context_len:
        raise ValueError(f"context_len={opts.context_len} > max_position_embeddings={positions}")
    return config


def make_job(ctx: JobContext) -> HFJob:
    """The hf job's factory."""
    opts = parse_options(HFOptions, ctx.options)
    try:
        import transformers

        tokenizer = load_tokenizer(opts.tokenizer_file) if opts.tokenizer_file else None
    except ImportError as exc:
        raise ImportError(_MISSING) from exc
    vocab = BYTE_VOCAB if tokenizer is None else tokenizer.get_vocab_size(with_added_tokens=True)
    config = build_config(transformers, opts, vocab)
    auto_model: Any = transformers.AutoModelForCausalLM
    # Built on the CPU from the seed alone, the global RNG left as it was: the same weights
    # on every site whatever its device.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        model = auto_model.from_config(config).to(ctx.device)
    architecture = json.loads(json.dumps(config.to_dict(), default=str))
    for key in ("transformers_version", "_name_or_path"):
        architecture.pop(key, None)
    # No key/value cache in training (a pipeline stage calls the model with its inputs alone);
    # set after the architecture is read, so the fingerprint stays what it was.
    model.config.use_cache = False
    data = load_corpora(opts.data)
    train, val = data.train, data.val
    architecture["vocabulary"] = "bytes"
    if tokenizer is not None:
        digest = hashlib.blake2b(tokenizer.to_str().encode(), digest_size=8).hexdigest()
        architecture["vocabulary"] = f"tokenizer:{digest}"
        train, val = encode(tokenizer, train), encode(tokenizer, val)
    seed = data_sampler_seed(ctx.seed, opts.data.shard_index)
    beta1, beta2 = opts.betas
    return HFJob(
        model=model,
        sampler=BatchSampler(
            train, batch_size=opts.batch_size, context_len=opts.context_len, seed=seed
        ),
        optim_cfg=InnerOptimConfig(
            lr=opts.lr,
            weight_decay=opts.weight_decay,
            beta1=beta1,
            beta2=beta2,
            warmup_steps=opts.warmup_steps,
            batch_size=opts.batch_size,
        ),
        val_batches=eval_batches(val, opts.eval_batches, opts.eval_batch_size, opts.context_len),
        architecture=architecture,
    )


__all__ = ["HFJob", "HFOptions", "make_job"]
