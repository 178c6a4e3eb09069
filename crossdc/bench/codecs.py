"""Codec benchmark: throughput, compression ratio and error of each payload codec.

Every figure is relative to the float32 input: ``ratio`` = fp32 bytes / encoded bytes (scales and
indices included), ``*_gbps`` = fp32 bytes / seconds / 1e9, best of ``repeats``. ``memcpy_gbps``
is ``np.copyto`` into a preallocated array in the same run, the yardstick the targets in
``docs/compression.md`` are stated against.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from comm.codecs.registry import get_codec

CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "topk:0.01", "int8+zstd")


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(size_mib: int = 64, repeats: int = 3) -> dict[str, Any]:
    """Measure every codec in ``CODECS`` on a ``size_mib`` MiB float32 tensor of N(0, 1) values."""
    if size_mib < 1 or repeats < 1:
        raise ValueError(f"size_mib and repeats must be >= 1, got {size_mib}, {repeats}")
    numel = size_mib * (1 << 20) // 4
    x = np.random.default_rng(0).standard_normal(numel, dtype=np.float32)
    dst = np.empty_like(x)
    codecs = {spec: get_codec(spec) for spec in CODECS}
    # One untimed pass first: it is also the encoding the ratio and error figures describe.
    encoded = {spec: codec.encode("bench", x) for spec, codec in codecs.items()}
    errors = {
        spec: float(np.max(np.abs(codec.decode(encoded[spec]) - x)))
        for spec, codec in codecs.items()
    }
    # Timed rounds interleave the codecs, so a transient slowdown of the host (another process,
    # the kernel reclaiming freed memory) costs one sample per codec, not a codec's every sample.
    memcpy_s = math.inf
    encode_s = dict.fromkeys(codecs, math.inf)
    decode_s = dict.fromkeys(codecs, math.inf)
    for _ in range(repeats):
        memcpy_s = min(memcpy_s, _seconds(functools.partial(np.copyto, dst, x)))
        for spec, codec in codecs.items():
            encode_s[spec] = min(
                encode_s[spec], _seconds(functools.partial(codec.encode, "bench", x))
            )
            decode_s[spec] = min(
                decode_s[spec], _seconds(functools.partial(codec.decode, encoded[spec]))
            )
    return {
        "size_mib": size_mib,
        "repeats": repeats,
        "memcpy_gbps": x.nbytes / memcpy_s / 1e9,
        "codecs": [
            {
                "name": spec,
                "ratio": x.nbytes / encoded[spec].nbytes,
                "encode_gbps": x.nbytes / encode_s[spec] / 1e9,
                "decode_gbps": x.nbytes / decode_s[spec] / 1e9,
                "max_abs_err": errors[spec],
            }
            for spec in codecs
        ],
    }


def _table(report: dict[str, Any]) -> str:
    memcpy = report["memcpy_gbps"]
    lines = [
        f"{report['size_mib']} MiB float32, best of {report['repeats']}; memcpy {memcpy:.2f} GB/s",
        f"{'codec':<12} {'ratio':>8} {'enc GB/s':>9} {'x memcpy':>8} "
        f"{'dec GB/s':>9} {'x memcpy':>8} {'max |err|':>10}",
    ]
    for r in report["codecs"]:
        lines.append(
            f"{r['name']:<12} {r['ratio']:>8.2f} {r['encode_gbps']:>9.2f} "
            f"{r['encode_gbps'] / memcpy:>8.2f} {r['decode_gbps']:>9.2f} "
            f"{r['decode_gbps'] / memcpy:>8.2f} {r['max_abs_err']:>10.3g}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crossdc bench codecs", description=__doc__)
    parser.add_argument("--size-mib", type=int, default=64, help="tensor size in MiB (fp32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; best kept")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = run(size_mib=args.size_mib, repeats=args.repeats)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
