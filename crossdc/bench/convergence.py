"""``crossdc bench convergence``: validation loss after equal rounds, per codec, against fp32.

Runs the demo federation (real processes, the embedded default corpus, blocking sync so that runs
are deterministic) once per codec, the codec applied to both directions (site updates with the sites' error feedback, the global delta with the
coordinator's), with identical seeds, and reports each codec's final validation loss, its relative
gap to fp32, and the WAN bytes it took.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "topk:0.1")


def run_one(codec: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "crossdc",
        "demo",
        "--json",
        "--sites",
        str(args.sites),
        "--rounds",
        str(args.rounds),
        "--inner-steps",
        str(args.inner_steps),
        "--uplink-codec",
        codec,
        "--downlink-codec",
        codec,
        "--workdir",
        str(workdir / codec.replace(":", "_")),
        # Blocking sync: with overlap the inner step at which a result is merged depends on
        # timing, a noise larger than the differences between codecs.
        "--no-overlap",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"demo with {codec} failed: {proc.stderr.strip()[-2000:]}")
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    codecs = [c for c in args.codecs.split(",") if c]
    if "fp32" not in codecs:
        codecs.insert(0, "fp32")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="crossdc-conv-") as tmp:
        for codec in codecs:
            results[codec] = run_one(codec, args, Path(tmp))
    base = results["fp32"]["val_loss_final"]
    rows = []
    for codec, r in results.items():
        rows.append(
            {
                "codec": codec,
                "val_loss_final": r["val_loss_final"],
                "val_loss_gap": (r["val_loss_final"] - base) / base,
                "wan_bytes_total": r["wan_bytes_total"],
                "bytes_ratio_vs_fp32": results["fp32"]["wan_bytes_total"] / r["wan_bytes_total"],
                "wall_seconds": r["wall_seconds"],
            }
        )
    return {
        "sites": args.sites,
        "rounds": args.rounds,
        "inner_steps": args.inner_steps,
        "val_loss_initial": results["fp32"]["val_loss_initial"],
        "codecs": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crossdc bench convergence", description=__doc__)
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS))
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{'codec':>10} {'val_loss':>9} {'gap':>8} {'wan_bytes':>12} {'ratio':>6}")
        for r in out["codecs"]:
            print(
                f"{r['codec']:>10} {r['val_loss_final']:9.4f} {r['val_loss_gap'] * 100:7.2f}% "
                f"{r['wan_bytes_total']:12d} {r['bytes_ratio_vs_fp32']:6.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
