"""Fold benchmark: parameter-updates a coordinator folds per CPU second, per codec.

For each codec, ``sites`` updates of a model of ``params`` parameters (tensors of at most
``tensor`` values each, N(0, 1) values encoded once, untimed) go through the coordinator's fold
as a round's updates do (:class:`coordinator.aggregate.MeanFold`: each checked from its encoded
values as it arrives and held as it came; at the close the mean is folded tensor by tensor from
the held updates into one float32 buffer). Every figure is parameter-updates (one parameter of
one update) per second of the process's CPU time (all its threads), best of ``repeats``:

- ``fold_rate``: the whole fold of the updates (their checks, and the mean at the close), what
  ``crossdc_fold_parameter_updates_total / crossdc_fold_cpu_seconds_total`` measures in a
  running coordinator;
- ``check_rate``: the checks alone (finiteness and norm from the encoded values,
  ``PayloadCodec.sum_squares``);
- ``add_rate``: the mean at the close alone (``PayloadCodec.accumulate`` of every held update
  into the buffer, tensor by tensor, and the division).

``fold_extra_bytes`` is the most memory the timed fold allocated (numpy's allocations, as
tracemalloc sees them, in the first repeat): the buffer of the largest tensor and the tiles,
not a copy of an update.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from coordinator.aggregate import MeanFold

CODECS = (
    "fp32",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "int3",
    "int2",
    "int4+zstd",
    "topk:0.01",
    "chunktopk",
)


def _cpu(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _shapes(params: int, tensor: int) -> dict[str, tuple[int, ...]]:
    sizes = [tensor] * (params // tensor) + ([params % tensor] if params % tensor else [])
    return {f"layers.{i}.w": (n,) for i, n in enumerate(sizes)}


def _payloads(
    spec: str, shapes: dict[str, tuple[int, ...]], sites: int
) -> list[tuple[EncodedTensor, ...]]:
    codec = get_codec(spec)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(sites):
        out.append(
            tuple(
                codec.encode(name, rng.standard_normal(shape, dtype=np.float32))
                for name, shape in shapes.items()
            )
        )
    return out


def _measure(
    spec: str, shapes: dict[str, tuple[int, ...]], sites: int, repeats: int
) -> dict[str, Any]:
    payloads = _payloads(spec, shapes, sites)
    codec = get_codec(spec)
    params = sum(math.prod(s) for s in shapes.values())
    names = [f"site{i}" for i in range(sites)]
    best = dict.fromkeys(("fold", "check", "add"), math.inf)
    extra = 0

    def take() -> MeanFold:
        """A round's updates checked and held, as they arrive."""
        fold = MeanFold(math.inf, names)
        for site, payload in zip(names, payloads, strict=True):
            assert isinstance(fold.add(site, 1.0 + len(site), payload, shapes), str)
        return fold

    def close(fold: MeanFold) -> None:
        """The close's fold: every tensor of the mean, as the step reads them."""
        mean = fold.mean()
        for name in shapes:
            mean[name]

    def check() -> None:
        for payload in payloads:
            for enc in payload:
                codec.sum_squares(enc)

    for r in range(repeats):
        if r == 0:
            tracemalloc.start()
            try:
                best["fold"] = min(best["fold"], _cpu(lambda: close(take())))
                extra = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        else:
            best["fold"] = min(best["fold"], _cpu(lambda: close(take())))
        held = take()
        best["check"] = min(best["check"], _cpu(check))
        best["add"] = min(best["add"], _cpu(partial(close, held)))
    updates = params * sites
    return {
        "name": spec,
        "encoded_bytes_per_param": round(sum(e.nbytes for e in payloads[0]) / params, 4),
        **{f"{k}_rate": round(updates / v) if v > 0 else None for k, v in best.items()},
        "fold_extra_bytes": extra,
    }


def run(
    params: int = 1 << 24,
    sites: int = 3,
    repeats: int = 3,
    tensor: int = 1 << 22,
    codecs: tuple[str, ...] = CODECS,
) -> dict[str, Any]:
    """Measure every codec in ``codecs`` folding ``sites`` updates of ``params`` parameters."""
    if min(params, sites, repeats, tensor) < 1:
        raise ValueError(
            f"params, sites, repeats and tensor must be >= 1, got {params}, {sites}, "
            f"{repeats}, {tensor}"
        )
    shapes = _shapes(params, tensor)
    return {
        "params": params,
        "sites": sites,
        "repeats": repeats,
        "tensor": tensor,
        "codecs": [_measure(spec, shapes, sites, repeats) for spec in codecs],
    }


def _rate(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.0f}M"


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['sites']} updates of {report['params']} parameters, parameter-updates per CPU "
        f"second, best of {report['repeats']}",
        f"{'codec':<12} {'B/param':>8} {'fold':>8} {'check':>8} {'add':>8} {'extra MiB':>10}",
    ]
    for r in report["codecs"]:
        lines.append(
            f"{r['name']:<12} {r['encoded_bytes_per_param']:>8.3f} {_rate(r['fold_rate']):>8} "
            f"{_rate(r['check_rate']):>8} {_rate(r['add_rate']):>8} "
            f"{r['fold_extra_bytes'] / 2**20:>10.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crossdc bench fold", description=__doc__)
    parser.add_argument("--params", type=int, default=1 << 24, help="parameters per update")
    parser.add_argument("--sites", type=int, default=3, help="updates folded per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; best kept")
    parser.add_argument(
        "--tensor", type=int, default=1 << 22, help="largest tensor, in values (the model's cut)"
    )
    parser.add_argument(
        "--codecs", default=",".join(CODECS), help="comma-separated codec specs to measure"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        codecs = tuple(get_codec(s.strip()).spec for s in args.codecs.split(",") if s.strip())
        report = run(args.params, args.sites, args.repeats, args.tensor, codecs)
    except ValueError as exc:
        parser.error(str(exc))
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
