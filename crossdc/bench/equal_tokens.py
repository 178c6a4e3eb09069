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
baseline) / baseline), DiLoCo's encoded bytes per inner step (every site's update and every
site's copy of the broadcast, as ``bench wan`` counts them) and ``bytes_ratio_vs_ddp``: the
baseline's wire bytes per step (every site's fp32 gradient up and the fp32 mean down to every
site, 2 x sites x 4 bytes a parameter) over DiLoCo's.

``--strategy sparseloco`` is SparseLoCo's recipe: the sites' error feedback decays by
``--ef-decay`` and is the only memory, the outer step is SGD at ``--outer-lr`` without momentum,
and with ``--broadcast sparse`` the sites receive the sites' encoded updates themselves and apply
the coordinator's step exactly (counted as every site receiving every update).

The baseline depends only on the sites, steps, batch, inner lr, evaluation period and seed: it is
computed once and kept in a cache file named by those (``--baseline-cache``), and while it is
computed DiLoCo runs in a second process. ``--sweep`` runs the grid ``--sweep-inner-steps`` x
``--sweep-k`` x ``--sweep-bits`` of ``chunktopk`` settings for every seed of ``--seeds``,
``--jobs`` at a time, and writes the frontier (bytes ratio against loss gap) as JSON and a PNG.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch

from comm.codecs.registry import get_codec
from coordinator import strategies
from crossdc.bench import print_report
from crossdc.bench.equal_tokens_args import build_parser, int_list
from crossdc.bench.equal_tokens_sim import (
    run_ddp,
    run_diloco,
    site_trainer,
)
from crossdc.bench.local_trainer import LocalTrainer
from crossdc.demo_args import resolve_outer_rule_defaults
from crossdc.demo_roles import DEMO_MODEL
from crossdc.plot import PlotUnavailable, frontier_point, plot_frontier
from crossdc.progress import (
    SILENT,
    Progress,
    open_progress,
    pop_no_progress,
)
from site_agent.jobs.bytegpt.data import ByteCorpus, eval_batches, stdlib_split
from site_agent.jobs.bytegpt.model import ModelConfig
from site_agent.jobs.bytegpt.optim import InnerOptimConfig

Arrays = dict[str, np.ndarray]


def check_arguments(args: argparse.Namespace) -> None:
    """Every argument checked before any work; ``ValueError`` naming the one that is wrong."""
    resolve_outer_rule_defaults(args)
    if min(args.sites, args.steps, args.inner_steps, args.batch_size, args.eval_every) < 1:
        raise ValueError("--sites, --steps, --inner-steps, --batch-size, --eval-every must be >= 1")
    if args.outer_warmup_steps < 0 or args.overlap_steps < 0:
        raise ValueError("--outer-warmup-steps and --overlap-steps must be >= 0")
    if not args.outer_lr > 0 or not 0.0 <= args.outer_momentum < 1.0:
        raise ValueError("--outer-lr must be > 0 and --outer-momentum in [0, 1)")
    if not 0.0 <= args.ef_decay <= 1.0:
        raise ValueError(f"--ef-decay must be in [0, 1], got {args.ef_decay}")
    problem = strategies.problem(
        args.strategy,
        broadcast=args.broadcast,
        spelling=strategies.Spelling("--strategy", "--broadcast", command_line=True),
    )
    if problem is not None:
        raise ValueError(problem)
    if not args.selsync_threshold >= 0:
        raise ValueError(f"--selsync-threshold must be >= 0, got {args.selsync_threshold}")
    if args.jobs < 1:
        raise ValueError("--jobs must be >= 1")
    for flag in ("codec", "uplink_codec", "downlink_codec"):
        spec = getattr(args, flag)
        if spec is not None:
            try:
                get_codec(spec)
            except ValueError as exc:
                raise ValueError(f"--{flag.replace('_', '-')}: {exc}") from None


def _setup(args: argparse.Namespace) -> tuple[ModelConfig, InnerOptimConfig, list[Any], list[Any]]:
    torch.set_num_threads(1)
    model = ModelConfig(**DEMO_MODEL)
    optim = InnerOptimConfig(lr=args.lr, batch_size=args.batch_size)
    shards, heldout = stdlib_split(args.sites)
    evals = eval_batches(
        ByteCorpus.from_stdlib_modules(heldout, 4 << 20), 8, 16, model.context_len, seed=0
    )
    return model, optim, shards, evals


def _trainers(args: argparse.Namespace) -> tuple[list[LocalTrainer], list[Any]]:
    model, optim, shards, evals = _setup(args)
    return [site_trainer(s, i, model, optim, args.seed) for i, s in enumerate(shards)], evals


def _baseline_key(args: argparse.Namespace) -> dict[str, Any]:
    """What the baseline's curve depends on (and nothing DiLoCo alone reads)."""
    return {
        "sites": args.sites,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "eval_every": args.eval_every,
        "seed": args.seed,
        "model": DEMO_MODEL,
    }


def baseline_cache_path(args: argparse.Namespace) -> Path | None:
    """The baseline's cache file for these settings; None with ``--no-baseline-cache``."""
    if args.baseline_cache is None:
        return None
    text = json.dumps(_baseline_key(args), sort_keys=True)
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return Path(args.baseline_cache) / f"ddp-{digest}.json"


def _read_baseline(path: Path | None, args: argparse.Namespace) -> dict[str, Any] | None:
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != json.loads(json.dumps(_baseline_key(args))):
        return None
    return {"curve": {int(k): float(v) for k, v in data["curve"].items()}, **data["meta"]}


def compute_baseline(args: argparse.Namespace, progress: Progress = SILENT) -> dict[str, Any]:
    """The baseline's curve and per-step wire bytes, from the cache or computed (and cached)."""
    path = baseline_cache_path(args)
    cached = _read_baseline(path, args)
    if cached is not None:
        return {**cached, "cached": True}
    trainers, evals = _trainers(args)
    numel = sum(int(v.size) for v in trainers[0].parameters_numpy().values())
    start = time.perf_counter()
    curve = run_ddp(trainers, args.steps, evals, args.eval_every, progress)
    meta = {
        "seconds": time.perf_counter() - start,
        # Every step: each site's fp32 gradient up, the fp32 mean down to each site.
        "wire_bytes_per_step": 2 * args.sites * 4 * numel,
        "numel": numel,
    }
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(
            json.dumps({"key": _baseline_key(args), "curve": curve, "meta": meta}, indent=1)
        )
        tmp.replace(path)
    return {"curve": curve, **meta, "cached": False}


def compute_diloco(args: argparse.Namespace, progress: Progress = SILENT) -> dict[str, Any]:
    trainers, evals = _trainers(args)
    start = time.perf_counter()
    curve, wire_bytes = run_diloco(
        trainers,
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
        strategy=args.strategy,
        ef_decay=args.ef_decay,
        broadcast=args.broadcast,
        selsync_threshold=args.selsync_threshold,
        progress=progress,
    )
    return {"curve": curve, "wire_bytes": wire_bytes, "seconds": time.perf_counter() - start}


def _pool(jobs: int) -> ProcessPoolExecutor:
    # spawn, not fork: a forked torch with live intra-op threads can deadlock.
    return ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))


def run(args: argparse.Namespace, progress: Progress = SILENT) -> dict[str, Any]:
    check_arguments(args)
    cached = _read_baseline(baseline_cache_path(args), args)
    if cached is not None:
        progress.phase(f"DiLoCo, {args.sites} sites x {args.steps} steps (baseline cached)", 1, 1)
        ddp = {**cached, "cached": True}
        dl = compute_diloco(args, progress)
    elif args.jobs >= 2:
        progress.phase(f"baseline and DiLoCo side by side, {args.steps} steps", 1, 1)
        with _pool(1) as pool:
            pending = pool.submit(compute_baseline, args)
            dl = compute_diloco(args, progress)
            ddp = pending.result()
    else:
        progress.phase(f"synchronous baseline, {args.sites} sites x {args.steps} steps", 1, 2)
        ddp = compute_baseline(args, progress)
        progress.phase(f"DiLoCo, {args.sites} sites x {args.steps} steps", 2, 2)
        dl = compute_diloco(args, progress)
    return report(args, ddp, dl)


def report(args: argparse.Namespace, ddp: dict[str, Any], dl: dict[str, Any]) -> dict[str, Any]:
    ddp_final, dl_final = ddp["curve"][args.steps], dl["curve"][args.steps]
    dl_per_step = dl["wire_bytes"] / args.steps
    return {
        "config": vars(args).copy(),
        "ddp_val_loss_by_step": ddp["curve"],
        "diloco_val_loss_by_step": dl["curve"],
        "val_loss_ddp": ddp_final,
        "val_loss_diloco": dl_final,
        "val_loss_gap": (dl_final - ddp_final) / ddp_final,
        "diloco_wire_bytes_per_inner_step": dl_per_step,
        "ddp_wire_bytes_per_inner_step": ddp["wire_bytes_per_step"],
        "bytes_ratio_vs_ddp": ddp["wire_bytes_per_step"] / dl_per_step if dl_per_step else None,
        "ddp_seconds": ddp["seconds"],
        "ddp_cached": ddp["cached"],
        "diloco_seconds": dl["seconds"],
    }


def _setting_args(args: argparse.Namespace, seed: int, h: int, k: int, bits: int) -> Any:
    one = argparse.Namespace(**vars(args))
    one.seed, one.inner_steps = seed, h
    spec = get_codec(f"chunktopk:chunk={args.sweep_chunk},k={k},bits={bits}").spec
    one.uplink_codec = spec
    return one


def sweep(args: argparse.Namespace, progress: Progress = SILENT) -> dict[str, Any]:
    """Every (H, k, bits) for every seed, ``--jobs`` processes at a time, each seed's baseline
    once (from the cache when there). ``frontier.json`` in ``--out`` is rewritten as each run completes (a sweep stopped
    early leaves what it measured); ``frontier.png`` is drawn at the end (without matplotlib, the
    optional ``plot`` extra, it is not: ``png`` is None and stderr says why)."""
    check_arguments(args)
    seeds = int_list("--seeds", args.seeds)
    grid = [
        (h, k, b)
        for h in int_list("--sweep-inner-steps", args.sweep_inner_steps)
        for k in int_list("--sweep-k", args.sweep_k)
        for b in int_list("--sweep-bits", args.sweep_bits)
    ]
    runs = {seed: [_setting_args(args, seed, h, k, b) for h, k, b in grid] for seed in seeds}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "frontier.json"
    total = len(seeds) * len(grid)
    progress.phase(f"sweep: {len(seeds)} baselines and {total} settings", 1, 1)
    points: list[dict[str, Any]] = []
    frontier: dict[str, Any] = {"config": vars(args).copy(), "points": points}
    with _pool(args.jobs) as pool:
        # Setting by setting, each for every seed, a seed's baseline submitted just before its
        # first setting: the first setting's figures on every seed come first.
        bases: dict[int, Any] = {}
        pending = []
        for i in range(len(grid)):
            for seed in seeds:
                if seed not in bases:
                    seed_args = argparse.Namespace(**{**vars(args), "seed": seed})
                    bases[seed] = pool.submit(compute_baseline, seed_args)
                one = runs[seed][i]
                pending.append((one, bases[seed], pool.submit(compute_diloco, one)))
        for i, (one, base, dl) in enumerate(pending, 1):
            r = report(one, base.result(), dl.result())
            points.append(frontier_point(r))
            json_path.write_text(json.dumps(frontier, indent=1))
            progress.count(i, total, "settings")
    try:
        png: str | None = str(plot_frontier(json_path, out_dir / "frontier.png"))
    except PlotUnavailable as exc:  # no matplotlib: the figures are the optional 'plot' extra
        print(f"crossdc bench equal_tokens: no figure: {exc}", file=sys.stderr)
        png = None
    return {**frontier, "json": str(json_path), "png": png}


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__.split("\n")[0]).parse_args(argv)
    progress = open_progress("crossdc bench equal_tokens", no_progress=pop_no_progress(args))
    try:
        with progress:
            out = sweep(args, progress) if args.sweep else run(args, progress)
    except ValueError as exc:
        print(f"crossdc bench equal_tokens: {exc}", file=sys.stderr)
        return 2
    print_report(out, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
