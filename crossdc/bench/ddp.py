"""``crossdc bench ddp``: the synchronous data-parallel baseline over the demo's emulated WAN.

Launches ``python -m crossdc.ddp coordinator`` and one ``python -m crossdc.ddp site`` per site as real
processes, each site behind the :class:`~crossdc.lab.wanem.LinkEmulator` profile the demo gives it (the
eu/us/ap presets, overridable with ``--link``), on the demo's model, data shards and batch size.
Every inner step moves each site's full fp32 gradient up and the mean back down, so the numbers
to compare with ``crossdc demo`` are WAN bytes per inner step, compute utilization and wall time
at equal validation loss.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from comm.ops.configio import dump_toml
from crossdc.demo_roles import (
    DEMO_MODEL,
    DemoRun,
    link_profiles,
    site_ids,
    wait_endpoint,
    write_site_configs,
)
from crossdc.lab.wanem import LinkEmulator
from crossdc.progress_view import read_status

RESULT_FILE = "ddp-result.json"  # written by crossdc.ddp.site into each site's state dir


def _write_ddp_config(workdir: Path, *, sites: int, steps: int, eval_every: int) -> Path:
    doc = {
        "ddp": {
            "bind": "tcp://127.0.0.1:0",
            "state_dir": str(workdir / "ddp"),
            "min_sites": sites,
            "max_steps": steps,
            "eval_every": eval_every,
            "site_timeout_s": 120.0,
        }
    }
    path = workdir / "ddp.toml"
    path.write_text(dump_toml(doc))
    return path


def run_ddp(
    sites: int = 3,
    steps: int = 40,
    links: Sequence[str] | None = None,
    *,
    eval_every: int = 10,
    batch_size: int = 8,
    wan: bool = True,
    workdir: str | Path | None = None,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Run the baseline federation once and return its report.

    ``links``: ``SITE=PROFILE`` overrides of the demo presets (None: the presets as they are);
    ``wan=False`` connects the sites directly. Raises RuntimeError when a process fails.
    """
    if sites < 1 or steps < 1:
        raise ValueError(f"sites and steps must be >= 1, got sites={sites} steps={steps}")
    logging.getLogger("crossdc.lab").setLevel(logging.WARNING)
    ids = site_ids(sites)
    demo_args = argparse.Namespace(
        sites=sites, stages=1, batch_size=batch_size, link=list(links or []), insecure=True
    )
    profiles = link_profiles(demo_args, ids) if wan else {}
    with tempfile.TemporaryDirectory(prefix="crossdc-ddp-") as tmp:
        root = Path(workdir).resolve() if workdir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        return _run(root, ids, profiles, demo_args, steps, eval_every, timeout_s)


def _run(
    workdir: Path,
    ids: list[str],
    profiles: dict[str, Any],
    demo_args: argparse.Namespace,
    steps: int,
    eval_every: int,
    timeout_s: float,
) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cfg = _write_ddp_config(workdir, sites=len(ids), steps=steps, eval_every=eval_every)
    run = DemoRun(workdir)
    started = time.monotonic()
    status_path = workdir / "ddp" / "status.json"
    try:
        run.spawn(
            "ddp", [sys.executable, "-m", "crossdc.ddp", "coordinator", "--config", str(cfg)], env
        )
        coord = run.procs["ddp"]
        endpoint = wait_endpoint(workdir / "ddp" / "endpoint.json", coord, 120)
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        endpoints = {s: endpoint for s in ids}
        for site_id, prof in profiles.items():
            link = LinkEmulator(host, int(port), profile=prof, name=f"link-{site_id}")
            link.start()
            run.links[site_id] = link
            endpoints[site_id] = f"tcp://127.0.0.1:{link.port}"
        for site_id, path in write_site_configs(demo_args, workdir, endpoints):
            run.spawn(
                f"site-{site_id}",
                [sys.executable, "-m", "crossdc.ddp", "site", "--config", str(path)],
                env,
            )
        while coord.poll() is None:
            dead = [n for n, p in run.procs.items() if p.poll() not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead} exited with an error; see {workdir}")
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"timed out after {timeout_s:.0f}s; see {workdir}")
            time.sleep(0.25)
        for name, proc in run.procs.items():
            if proc.wait(timeout=60) != 0:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {workdir}")
        link_bytes = {s: link.bytes_up + link.bytes_down for s, link in run.links.items()}
    finally:
        run.close()
    wall = time.monotonic() - started
    status = read_status(status_path)
    if status is None or not status.get("finished") or status.get("aborted"):
        raise RuntimeError(f"the run did not complete: {status and status.get('outcome')}")
    results = {s: json.loads((workdir / f"site-{s}" / RESULT_FILE).read_text()) for s in ids}
    return build_report(status, results, wall, link_bytes, profiles, demo_args.batch_size)


def build_report(
    status: dict[str, Any],
    results: dict[str, dict[str, Any]],
    wall_seconds: float,
    link_bytes: dict[str, int],
    profiles: dict[str, Any],
    batch_size: int,
) -> dict[str, Any]:
    steps = int(status["steps_completed"])
    wan = int(status["wire_bytes_in"]) + int(status["wire_bytes_out"])
    step_s = [float(s) for s in status.get("step_seconds", [])]
    hashes = {r["state_hash"] for r in results.values()}
    return {
        "baseline": "ddp",
        "sites": len(results),
        "steps": steps,
        "batch_size": batch_size,
        "context_len": DEMO_MODEL["context_len"],
        "num_parameters": status.get("num_parameters", 0),
        "tokens_per_step": status["tokens_total"] / steps if steps else 0,
        "wall_seconds": wall_seconds,
        "run_seconds": status.get("run_seconds"),
        "step_seconds_mean": sum(step_s) / len(step_s) if step_s else None,
        "compute_utilization": sum(r["compute_utilization"] for r in results.values())
        / len(results),
        "compute_utilization_by_site": {s: r["compute_utilization"] for s, r in results.items()},
        "wan_bytes_total": wan,
        "wan_bytes_in": status["wire_bytes_in"],
        "wan_bytes_out": status["wire_bytes_out"],
        "wan_bytes_per_inner_step": wan / steps if steps else 0,
        "link_bytes": link_bytes,
        "links": {s: p.to_spec() for s, p in profiles.items()},
        "val_loss_by_step": {int(k): v for k, v in status.get("val_losses", {}).items()},
        "sites_bit_identical": len(hashes) == 1,
        "rejected": status.get("rejected", {}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crossdc bench ddp", description=__doc__.split("\n")[0])
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="inner steps (one all-reduce each)")
    p.add_argument("--eval-every", type=int, default=10, help="val loss every N steps; 0: off")
    p.add_argument("--batch-size", type=int, default=8, help="per-site batch (the demo's)")
    p.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="SITE=PROFILE",
        help="override a site's WAN link, e.g. ap=20mbit,150ms (default: the demo presets)",
    )
    p.add_argument("--no-wan", action="store_true", help="connect sites directly")
    p.add_argument("--workdir", default="", help="keep configs, logs and state here")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        out = run_ddp(
            args.sites,
            args.steps,
            args.link,
            eval_every=args.eval_every,
            batch_size=args.batch_size,
            wan=not args.no_wan,
            workdir=args.workdir or None,
            timeout_s=args.timeout,
        )
    except (ValueError, RuntimeError) as exc:
        print(f"crossdc bench ddp: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"ddp baseline: {out['sites']} sites x {out['steps']} steps, "
        f"{out['num_parameters']:,} parameters\n"
        f"  wall {out['wall_seconds']:.1f}s (run {out['run_seconds']:.1f}s, "
        f"{out['step_seconds_mean']:.2f}s/step), compute utilization "
        f"{out['compute_utilization']:.1%}\n"
        f"  WAN bytes {out['wan_bytes_total']:,} ({out['wan_bytes_per_inner_step']:,.0f}/step)"
    )
    for step, loss in sorted(out["val_loss_by_step"].items()):
        print(f"  step {step:>5}: val_loss {loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
