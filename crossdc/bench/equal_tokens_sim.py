"""The arithmetic of ``crossdc bench equal_tokens``: the synchronous data-parallel baseline
(``run_ddp``) and DiLoCo's rounds (``run_diloco``: the sites' inner steps, their error feedback
and encoding, the coordinator's mean and outer step, the broadcast), in one process."""

from __future__ import annotations

from typing import Any

import numpy as np

from comm.codecs.base import PayloadCodec
from comm.codecs.feedback import ErrorFeedback
from comm.codecs.registry import decode_tensor, get_codec
from coordinator import strategies
from coordinator.config import CoordinatorConfig
from coordinator.strategies.base import OuterSettings, weighted_mean
from crossdc.bench.local_trainer import LocalTrainer
from crossdc.ddp.trainer import DDPTrainer
from crossdc.progress import (
    SILENT,
    Progress,
)
from site_agent.jobs.bytegpt.data import BatchSampler, ByteCorpus, sampler_seed
from site_agent.jobs.bytegpt.model import ModelConfig, build_model
from site_agent.jobs.bytegpt.optim import InnerOptimConfig

Arrays = dict[str, np.ndarray]


def site_trainer(
    shard: list[str], index: int, model: ModelConfig, optim: InnerOptimConfig, seed: int
) -> LocalTrainer:
    sampler = BatchSampler(
        ByteCorpus.from_stdlib_modules(shard, None),
        batch_size=optim.batch_size,
        context_len=model.context_len,
        seed=sampler_seed(seed, index),
    )
    return LocalTrainer(model=build_model(model, seed), sampler=sampler, optim_cfg=optim)


def run_ddp(
    trainers: list[LocalTrainer],
    steps: int,
    evals: list[Any],
    eval_every: int,
    progress: Progress = SILENT,
) -> dict[int, float]:
    """Every step: each site's batch's gradient at the shared parameters, their token-weighted
    mean, one AdamW step; the first trainer's model stands for every site's."""
    ddp = DDPTrainer(trainers[0])
    curve: dict[int, float] = {}
    for step in range(1, steps + 1):
        grads = [ddp.compute_gradient(t.sampler.next_batch()) for t in trainers]
        ddp.apply_gradient(weighted_mean([(float(g.tokens), g.grads) for g in grads]))
        if step % eval_every == 0 or step == steps:
            curve[step] = trainers[0].evaluate(evals)
        progress.count(step, steps, "steps")
    return curve


def _train_slot(
    trainer: LocalTrainer, params: Arrays, sent: Arrays | None, h: int, overlap_steps: int
) -> None:
    """One site's ``h`` inner steps of a round: from the global ``params`` (blocking, or its
    first round), or overlapped: ``overlap_steps`` steps, then the merge of the global result
    into its progress since it sent ``sent``, then the rest."""
    if overlap_steps == 0 or sent is None:
        trainer.load_parameters(params)
        trainer.train_steps(h)
        return
    before = min(overlap_steps, h)
    trainer.train_steps(before)
    cur = trainer.parameters_numpy()
    trainer.load_parameters({k: cur[k] + (params[k] - sent[k]) for k in params})
    if h > before:
        trainer.train_steps(h - before)


SKIP_MARKER_BYTES = 16
"""What a skipped (insignificant) update costs on the wire: a small "nothing significant" marker."""


def _encode_update(
    fb: ErrorFeedback,
    params: Arrays,
    local: Arrays,
    codec: PayloadCodec,
    skip_below: float = 0.0,
) -> tuple[Arrays, int]:
    """A site's pseudo-gradient through its codec and error feedback: what the coordinator
    decodes, and the bytes encoded. SelSync's rule with ``skip_below`` > 0: when the
    accumulator's norm relative to the parameters' is below it, the update is held in the
    residual and a marker is sent instead; the round counts it as a zero update."""
    decoded: Arrays = {}
    nbytes = 0
    if skip_below > 0:
        acc = sum(fb.accumulated_norm(k, v - local[k]) ** 2 for k, v in params.items())
        ref = sum(float(np.dot(v.ravel(), v.ravel())) for v in params.values())
        if acc < skip_below**2 * ref:
            for name, value in params.items():
                fb.hold(name, value - local[name])
                decoded[name] = np.zeros_like(value)
            return decoded, SKIP_MARKER_BYTES
    for name, value in params.items():
        enc = fb.compress(name, value - local[name], codec)
        nbytes += enc.nbytes
        decoded[name] = decode_tensor(enc).reshape(value.shape)
    return decoded, nbytes


def _broadcast(fb: ErrorFeedback, params: Arrays, target: Arrays, codec: PayloadCodec) -> int:
    """Move ``params`` (in place) to ``target`` as the sites receive it: the delta through the
    downlink codec with the coordinator's error feedback. Returns the bytes of one copy."""
    nbytes = 0
    for name, value in params.items():
        enc = fb.compress(name, target[name] - value, codec)
        nbytes += enc.nbytes
        params[name] = value + decode_tensor(enc).reshape(value.shape)
    return nbytes


def _site_updates(
    trainers: list[LocalTrainer],
    site_fb: list[ErrorFeedback],
    params: Arrays,
    at_send: list[Arrays | None],
    h: int,
    overlap_steps: int,
    up: PayloadCodec,
    selsync_threshold: float,
) -> tuple[list[tuple[str, float, Arrays]], int]:
    """Each site's slot of ``h`` inner steps, and its encoded update (and the bytes it took)."""
    updates: list[tuple[str, float, Arrays]] = []
    round_bytes = 0
    for i, (trainer, fb) in enumerate(zip(trainers, site_fb, strict=True)):
        _train_slot(trainer, params, at_send[i], h, overlap_steps)
        local = at_send[i] = trainer.parameters_numpy()
        decoded, nbytes = _encode_update(fb, params, local, up, selsync_threshold)
        round_bytes += nbytes
        updates.append((f"site{i}", float(h), decoded))
    return updates, round_bytes


def _evaluate_global(trainer: LocalTrainer, params: Arrays, evals: list[Any]) -> float:
    """The validation loss of ``params`` on ``trainer``, whose own parameters are put back."""
    own = trainer.parameters_numpy()
    trainer.load_parameters(params)
    loss = trainer.evaluate(evals)
    trainer.load_parameters(own)
    return loss


def run_diloco(
    trainers: list[LocalTrainer],
    steps: int,
    evals: list[Any],
    *,
    inner_steps: int,
    outer_lr: float,
    outer_momentum: float,
    outer_warmup_steps: int = CoordinatorConfig.outer_warmup_steps,
    outer_final_mean: bool = CoordinatorConfig.outer_final_mean,
    overlap_steps: int = 0,
    uplink: str,
    downlink: str,
    strategy: str = "diloco",
    ef_decay: float = 1.0,
    broadcast: str = "dense",
    selsync_threshold: float = 0.0,
    progress: Progress = SILENT,
) -> tuple[dict[int, float], int]:
    """DiLoCo rounds; returns the curve (the global model after each round) and the bytes encoded.

    ``overlap_steps`` = 0: blocking, every site starts each round from the global model. d > 0:
    overlapped as the site agent does it, with the sync taking d inner steps: a site keeps
    training from its own parameters, and after d steps of the next slot merges the global
    result, keeping its progress since the send (θ ← θ + θ_global_new − θ_at_send).
    """
    up, down = get_codec(uplink), get_codec(downlink)
    site_fb = [ErrorFeedback(decay=ef_decay) for _ in trainers]
    coord_fb = ErrorFeedback()
    settings = OuterSettings(lr=outer_lr, momentum=outer_momentum, warmup_steps=outer_warmup_steps)
    outer = strategies.build(strategy, settings)
    params: Arrays = trainers[0].parameters_numpy()
    momentum: Arrays = {k: np.zeros_like(v) for k, v in params.items()}
    at_send: list[Arrays | None] = [None for _ in trainers]
    curve: dict[int, float] = {}
    done = wire_bytes = 0
    while done < steps:
        h = min(inner_steps, steps - done)
        updates, round_bytes = _site_updates(
            trainers, site_fb, params, at_send, h, overlap_steps, up, selsync_threshold
        )
        wire_bytes += round_bytes
        result = outer.outer_step(
            params,
            momentum,
            updates,
            inner_steps=done + h,
            final=outer_final_mean and done + h == steps,
        )
        momentum = result.momentum
        if broadcast == "sparse":
            # Every site receives every site's encoded update and runs the coordinator's step
            # (comm.codecs.broadcast.sparse_step) on them: it lands on result.params exactly.
            params = {k: v.copy() for k, v in result.params.items()}
            wire_bytes += round_bytes * len(trainers)
        else:
            wire_bytes += _broadcast(coord_fb, params, result.params, down) * len(trainers)
        done += h
        curve[done] = _evaluate_global(trainers[0], params, evals)
        progress.count(done, steps, "steps")
    return curve, wire_bytes
