"""``crossdc bench equal_tokens``: DiLoCo against synchronous data parallelism at equal tokens.

The learning dynamics only, in one process on one thread, without sockets or timing: the demo's
model, the sites' stdlib shards and samplers (seeded by ``sampler_seed``, as sites seed theirs),
the sites' own ``LocalTrainer`` (AdamW, warm-up, clipping), the codecs with the sites' and the
coordinator's error feedback, the coordinator's token-weighted mean and outer step (with its
warm-up), and for the baseline the DDP site's ``DDPTrainer`` applying the mean gradient of every
site's batch. The same arithmetic as ``crossdc demo --no-overlap`` and ``crossdc bench ddp``
without their processes; with ``--overlap-steps d``, the demo's overlapped merge with every sync
taking d inner steps. A setting (inner steps per round, outer learning rate, momentum and warm-up,
overlap, codec, batch, run length) can so be compared at equal tokens in minutes.

Prints the validation-loss curves of both, their final values, ``val_loss_gap`` ((DiLoCo −
baseline) / baseline) and DiLoCo's encoded bytes per inner step (every site's update and every
site's copy of the broadcast, as ``bench wan`` counts them).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
import torch

from comm.codecs.base import PayloadCodec
from comm.codecs.feedback import ErrorFeedback
from comm.codecs.registry import decode_tensor, get_codec
from coordinator.config import CoordinatorConfig
from coordinator.strategy import DiLoCo, weighted_mean
from crossdc.bench import print_report
from crossdc.ddp.trainer import DDPTrainer
from crossdc.demo_args import add_outer_rule_arguments, resolve_outer_rule_defaults
from crossdc.demo_roles import DEMO_MODEL
from crossdc.progress import (
    SILENT,
    Progress,
    add_progress_argument,
    open_progress,
    pop_no_progress,
)
from site_agent.data import BatchSampler, ByteCorpus, eval_batches, sampler_seed, stdlib_split
from site_agent.jobs.bytegpt import LocalTrainer
from site_agent.model import ModelConfig, build_model
from site_agent.trainer import InnerOptimConfig

Arrays = dict[str, np.ndarray]


def _trainer(
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


def _encode_update(
    fb: ErrorFeedback, params: Arrays, local: Arrays, codec: PayloadCodec
) -> tuple[Arrays, int]:
    """A site's pseudo-gradient through its codec and error feedback: what the coordinator
    decodes, and the bytes encoded."""
    decoded: Arrays = {}
    nbytes = 0
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
    progress: Progress = SILENT,
) -> tuple[dict[int, float], int]:
    """DiLoCo rounds; returns the curve (the global model after each round) and the bytes encoded.

    ``overlap_steps`` = 0: blocking, every site starts each round from the global model. d > 0:
    overlapped as the site agent does it, with the sync taking d inner steps: a site keeps
    training from its own parameters, and after d steps of the next slot merges the global
    result, keeping its progress since the send (θ ← θ + θ_global_new − θ_at_send).
    """
    up, down = get_codec(uplink), get_codec(downlink)
    site_fb = [ErrorFeedback() for _ in trainers]
    coord_fb = ErrorFeedback()
    outer = DiLoCo(lr=outer_lr, momentum=outer_momentum, warmup_steps=outer_warmup_steps)
    params: Arrays = trainers[0].parameters_numpy()
    momentum: Arrays = {k: np.zeros_like(v) for k, v in params.items()}
    at_send: list[Arrays | None] = [None for _ in trainers]
    curve: dict[int, float] = {}
    done = wire_bytes = 0
    while done < steps:
        h = min(inner_steps, steps - done)
        updates: list[tuple[str, float, Arrays]] = []
        for i, (trainer, fb) in enumerate(zip(trainers, site_fb, strict=True)):
            _train_slot(trainer, params, at_send[i], h, overlap_steps)
            local = at_send[i] = trainer.parameters_numpy()
            decoded, nbytes = _encode_update(fb, params, local, up)
            wire_bytes += nbytes
            updates.append((f"site{i}", float(h), decoded))
        result = outer.outer_step(
            params,
            momentum,
            updates,
            inner_steps=done + h,
            final=outer_final_mean and done + h == steps,
        )
        momentum = result.momentum
        wire_bytes += _broadcast(coord_fb, params, result.params, down) * len(trainers)
        done += h
        site0 = trainers[0].parameters_numpy()
        trainers[0].load_parameters(params)
        curve[done] = trainers[0].evaluate(evals)
        trainers[0].load_parameters(site0)
        progress.count(done, steps, "steps")
    return curve, wire_bytes


def run(args: argparse.Namespace, progress: Progress = SILENT) -> dict[str, Any]:
    resolve_outer_rule_defaults(args)
    if min(args.sites, args.steps, args.inner_steps, args.batch_size, args.eval_every) < 1:
        raise ValueError("--sites, --steps, --inner-steps, --batch-size, --eval-every must be >= 1")
    if args.outer_warmup_steps < 0 or args.overlap_steps < 0:
        raise ValueError("--outer-warmup-steps and --overlap-steps must be >= 0")
    torch.set_num_threads(1)
    model = ModelConfig(**DEMO_MODEL)
    optim = InnerOptimConfig(lr=args.lr, batch_size=args.batch_size)
    shards, heldout = stdlib_split(args.sites)
    evals = eval_batches(
        ByteCorpus.from_stdlib_modules(heldout, 4 << 20), 8, 16, model.context_len, seed=0
    )

    def trainers() -> list[LocalTrainer]:
        return [_trainer(s, i, model, optim, args.seed) for i, s in enumerate(shards)]

    progress.phase(f"synchronous baseline, {args.sites} sites x {args.steps} steps", 1, 2)
    start = time.perf_counter()
    ddp_curve = run_ddp(trainers(), args.steps, evals, args.eval_every, progress)
    ddp_s = time.perf_counter() - start
    progress.phase(f"DiLoCo, {args.sites} sites x {args.steps} steps", 2, 2)
    start = time.perf_counter()
    dl_curve, wire_bytes = run_diloco(
        trainers(),
        args.steps,
        evals,
        inner_steps=args.inner_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        outer_warmup_steps=args.outer_warmup_steps,
        outer_final_mean=args.outer_final_mean,
        overlap_steps=args.overlap_steps,
        uplink=args.uplink_codec or args.codec,
        downlink=args.downlink_codec or args.codec,
        progress=progress,
    )
    dl_s = time.perf_counter() - start
    ddp_final, dl_final = ddp_curve[args.steps], dl_curve[args.steps]
    return {
        "config": vars(args).copy(),
        "ddp_val_loss_by_step": ddp_curve,
        "diloco_val_loss_by_step": dl_curve,
        "val_loss_ddp": ddp_final,
        "val_loss_diloco": dl_final,
        "val_loss_gap": (dl_final - ddp_final) / ddp_final,
        "diloco_wire_bytes_per_inner_step": wire_bytes / args.steps,
        "ddp_seconds": ddp_s,
        "diloco_seconds": dl_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="crossdc bench equal_tokens", description=__doc__.split("\n")[0]
    )
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--steps", type=int, default=600, help="inner steps of every site (= DDP steps)")
    p.add_argument("--inner-steps", type=int, default=150, help="H: inner steps per round")
    p.add_argument("--batch-size", type=int, default=8, help="per-site batch (the demo's)")
    p.add_argument("--lr", type=float, default=InnerOptimConfig.lr, help="inner AdamW lr")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    add_outer_rule_arguments(p)
    p.add_argument(
        "--overlap-steps",
        type=int,
        default=0,
        help="0: blocking sync; d > 0: overlapped, each result merged d inner steps after the send "
        "(at the slot's end if d >= H, where the site waits for it before sending again)",
    )
    p.add_argument("--codec", default="fp32", help="both directions unless overridden")
    p.add_argument("--uplink-codec", default=None)
    p.add_argument("--downlink-codec", default=None)
    p.add_argument("--eval-every", type=int, default=150, help="baseline evaluation period")
    p.add_argument("--seed", type=int, default=0, help="model and sampler seed")
    p.add_argument("--json", action="store_true")
    add_progress_argument(p)
    args = p.parse_args(argv)
    progress = open_progress("crossdc bench equal_tokens", no_progress=pop_no_progress(args))
    try:
        with progress:
            out = run(args, progress)
    except ValueError as exc:
        print(f"crossdc bench equal_tokens: {exc}", file=sys.stderr)
        return 2
    print_report(out, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
