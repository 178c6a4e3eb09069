"""``crossdc bench convergence``: validation loss after equal rounds, per codec, against fp32.

Runs the demo federation (real processes, the embedded default corpus, blocking sync so that runs
are deterministic) once per codec and seed, the codec applied to both directions (site updates
with the sites' error feedback, the global delta with the coordinator's) or, for an entry
``UPLINK/DOWNLINK``, one codec each way, and reports each codec's final validation loss (the
mean over the seeds), its relative gap to fp32's mean, the gap per seed, and the WAN bytes it
took (mean over the seeds). One seed's trajectory differs
from another's by about as much as the codecs differ, so costs for the scheduler's table
(``coordinator.codec_loss_costs``) want several seeds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from comm.codecs.registry import get_codec
from coordinator.scheduler import directions
from crossdc.demo_roles import site_ids
from crossdc.progress import (
    SILENT,
    Progress,
    add_progress_argument,
    open_progress,
    pop_no_progress,
)

DEFAULT_CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "int3+zstd", "int2+zstd", "topk:0.1")


def run_dir(codec: str, seed: int, workdir: Path) -> Path:
    """The work directory of one codec's (or pair's) run with one seed."""
    return workdir / f"{codec.replace(':', '_').replace('/', '--')}-{seed}"


def run_one(codec: str, seed: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    uplink, downlink = directions(codec)
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
        "--batch-size",
        str(args.batch_size),
        "--seed",
        str(seed),
        "--uplink-codec",
        uplink,
        "--downlink-codec",
        downlink,
        "--workdir",
        str(run_dir(codec, seed, workdir)),
    ]
    # Equal tokens: arrival alignment gives sites that land early extra steps, and how many
    # depends on each codec's sync time (fp32 on a slow link trains the others longer), so it
    # is off. Blocking sync by default: with overlap the inner step at which a result is merged
    # depends on timing, a noise of its own; --overlap measures the default mode, noise and all.
    argv.append("--no-align-arrivals")
    if not args.overlap:
        argv.append("--no-overlap")
    if args.no_wan:
        argv.append("--no-wan")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"demo with {codec} failed: {proc.stderr.strip()[-2000:]}")
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def run(args: argparse.Namespace, progress: Progress = SILENT) -> dict[str, Any]:
    codecs = [c for c in args.codecs.split(",") if c]
    if "fp32" not in codecs:
        codecs.insert(0, "fp32")
    seeds = [int(x) for x in args.seeds.split(",") if x]
    results: dict[str, list[dict[str, Any]]] = {}
    cases = [(codec, seed) for codec in codecs for seed in seeds]
    with tempfile.TemporaryDirectory(prefix="crossdc-conv-") as tmp:
        for i, (codec, seed) in enumerate(cases, 1):
            progress.phase(f"demo with {codec}, seed {seed}", i, len(cases))
            demo_dir = run_dir(codec, seed, Path(tmp))
            sites = {s: demo_dir / f"site-{s}" for s in site_ids(args.sites)}
            with progress.follow(demo_dir / "coordinator", total=args.rounds, site_dirs=sites):
                results.setdefault(codec, []).append(run_one(codec, seed, args, Path(tmp)))
    base = [r["val_loss_final"] for r in results["fp32"]]
    base_mean = sum(base) / len(base)
    fp32_bytes = sum(r["wan_bytes_total"] for r in results["fp32"]) / len(seeds)
    rows = []
    for codec, runs in results.items():
        losses = [r["val_loss_final"] for r in runs]
        mean = sum(losses) / len(losses)
        wan_bytes = sum(r["wan_bytes_total"] for r in runs) / len(runs)
        rows.append(
            {
                "codec": codec,
                "val_loss_final": mean,
                "val_loss_gap": (mean - base_mean) / base_mean,
                "val_loss_gap_by_seed": [(v - b) / b for v, b in zip(losses, base, strict=True)],
                "wan_bytes_total": wan_bytes,
                "bytes_ratio_vs_fp32": fp32_bytes / wan_bytes,
                "wall_seconds": sum(r["wall_seconds"] for r in runs),
            }
        )
    return {
        "sites": args.sites,
        "rounds": args.rounds,
        "inner_steps": args.inner_steps,
        "batch_size": args.batch_size,
        "seeds": seeds,
        "tokens_by_codec": {
            c: [r.get("tokens_merged") for r in runs] for c, runs in results.items()
        },
        "overlap": args.overlap,
        "wan_emulation": not args.no_wan,
        "val_loss_initial": results["fp32"][0]["val_loss_initial"],
        "codecs": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crossdc bench convergence", description=__doc__)
    p.add_argument(
        "--codecs",
        default=",".join(DEFAULT_CODECS),
        help="comma-separated codecs (both directions) or UPLINK/DOWNLINK pairs",
    )
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seeds", default="1234", help="comma-separated demo seeds (mean over them)")
    p.add_argument("--overlap", action="store_true", help="overlapped sync (the demo's default)")
    p.add_argument(
        "--no-wan",
        action="store_true",
        help="loopback links (without overlap and alignment the losses do not depend on links)",
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", action="store_true")
    add_progress_argument(p)
    args = p.parse_args(argv)
    for codec in (c for c in args.codecs.split(",") if c):
        try:
            for spec in directions(codec):
                get_codec(spec)
        except ValueError as exc:
            p.error(f"--codecs: {exc}")
    with open_progress("crossdc bench convergence", no_progress=pop_no_progress(args)) as progress:
        out = run(args, progress)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{'codec':>22} {'val_loss':>9} {'gap':>8} {'wan_bytes':>12} {'ratio':>6}")
        for r in out["codecs"]:
            print(
                f"{r['codec']:>22} {r['val_loss_final']:9.4f} {r['val_loss_gap'] * 100:7.2f}% "
                f"{r['wan_bytes_total']:12.0f} {r['bytes_ratio_vs_fp32']:6.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
