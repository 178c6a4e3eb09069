"""The roles a demo starts: their configs, the federation kit, the emulated WAN links and the
processes (``DemoRun``), and reading what the coordinator writes (``endpoint.json``,
``status.json``). ``crossdc.demo`` and the benchmarks build their federations from these.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from comm.ops.configio import dump_toml
from crossdc.lab.profiles import PRESETS, LinkProfile, parse_profile
from crossdc.progress_view import read_status

if TYPE_CHECKING:
    from crossdc.lab.wanem import LinkEmulator

SITE_NAMES = ("eu", "us", "ap", "sa", "af", "me", "oc", "na")

# The embedded default: a small byte-level GPT that learns visibly within two minutes on 2 cores.
DEMO_MODEL = {"context_len": 128, "num_layers": 4, "d_model": 128, "num_heads": 4}
DEMO_SEED = 1234
"""The sites' model seed; the coordinator builds the same θ0 from it (no upload at the join)."""


def link_profiles(args: argparse.Namespace, site_ids: list[str]) -> dict[str, LinkProfile]:
    """Each site's emulated WAN link: presets by site name, overridden by ``--link``."""
    profiles = {s: PRESETS.get(s, PRESETS["lan"]) for s in site_ids}
    for item in args.link:
        site, sep, spec = item.partition("=")
        if not sep or site not in profiles:
            raise ValueError(f"--link {item!r}: expected SITE=PROFILE with SITE in {site_ids}")
        profiles[site] = parse_profile(spec)
    return profiles


@dataclass
class DemoRun:
    workdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: list[Any] = field(default_factory=list)
    links: dict[str, LinkEmulator] = field(default_factory=dict)

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str], *, append: bool = False
    ) -> None:
        """Start ``argv`` as ``name``; ``append`` keeps the log of an earlier run (a restart)."""
        log = open(self.workdir / f"{name}.log", "ab" if append else "wb")  # noqa: SIM115
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def failure(self, name: str) -> str:
        """Why role ``name`` exited: its status and the line of its log that says why (the last
        ``cannot start:`` line, else the last exception line, else the last line)."""
        code = self.procs[name].poll()
        path = self.workdir / f"{name}.log"
        try:
            lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()]
        except OSError:
            lines = []
        said = [ln for ln in lines if "cannot start:" in ln]
        said = said or [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b", ln)]
        said = said or [ln for ln in lines if ln and not set(ln) <= set("=-")]
        why = f": {said[-1]}" if said else ""
        return f"{name} exited with status {code}{why} (log: {path})"

    def close(self, grace_s: float = 10.0) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        for link in self.links.values():
            link.close()


def _security(args: argparse.Namespace, workdir: Path, site_id: str | None) -> dict[str, Any]:
    if args.insecure:
        return {"insecure": True}
    return {"kit_dir": str(workdir / ("kit" if site_id is None else f"kit-{site_id}"))}


def _secagg(args: argparse.Namespace) -> dict[str, Any]:
    if not getattr(args, "secure_aggregation", False):
        return {}
    return {"secure_aggregation": {"clip_bound": 64.0}}


def _privacy(args: argparse.Namespace) -> dict[str, Any]:
    noise = getattr(args, "dp_noise", 0.0)
    if not noise:
        return {}
    return {"privacy": {"clip_norm": args.dp_clip, "noise_multiplier": noise}}


def _seed(args: argparse.Namespace) -> int:
    seed: int = getattr(args, "seed", DEMO_SEED)  # callers with their own arguments: the default
    return seed


def make_kits(workdir: Path, sites: list[str]) -> None:
    """A fresh federation kit for the demo: a CA, coordinator keys, one startup kit per site."""
    from comm.security.kits import init_kit, issue_site

    init_kit(workdir / "kit")
    for site_id in sites:
        issue_site(workdir / "kit", site_id, days=1, out_dir=workdir / f"kit-{site_id}")


def kit_problem(workdir: Path, sites: list[str]) -> str | None:
    """Why the kits a previous demo left in ``workdir`` cannot serve this run (a kit of an older
    format, an expired certificate, a site without a kit), or None when they can."""
    from comm.security.common import AuthError
    from comm.security.rolekits import load_coordinator_kit, load_site_kit

    try:
        load_coordinator_kit(workdir / "kit")
        for site_id in sites:
            load_site_kit(workdir / f"kit-{site_id}", site_id=site_id)
    except (ValueError, OSError, AuthError) as exc:
        return str(exc)
    return None


def site_ids(num_sites: int) -> list[str]:
    return [SITE_NAMES[i] if i < len(SITE_NAMES) else f"site{i}" for i in range(num_sites)]


def write_coordinator_config(
    args: argparse.Namespace,
    workdir: Path,
    *,
    overrides: dict[str, Any] | None = None,
    model: dict[str, int] | None = None,
) -> Path:
    """The coordinator's config; ``overrides`` replaces keys of its ``[coordinator]`` table;
    ``model`` (default DEMO_MODEL) is the sites' model, whose θ0 the coordinator builds."""
    coord_dir = workdir / "coordinator"
    coordinator = {
        "coordinator": {
            "bind": "tcp://127.0.0.1:0",
            "state_dir": str(coord_dir),
            "metrics_port": args.metrics_port,
            "min_sites": args.sites,
            "num_inner_steps": args.inner_steps,
            "max_rounds": args.rounds,
            "uplink_codec": args.uplink_codec,
            "downlink_codec": args.downlink_codec,
            "num_fragments": args.fragments,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "outer_strategy": getattr(args, "outer_strategy", "diloco"),
            "broadcast": getattr(args, "broadcast", "dense"),
            "outer_warmup_steps": args.outer_warmup_steps,
            "outer_final_mean": args.outer_final_mean,
            "overlap": not args.no_overlap,
            "align_arrivals": not getattr(args, "no_align_arrivals", False),
            "eval_every_rounds": args.eval_every,
            "round_deadline_s": 600.0,
            "site_timeout_s": 60.0,
            "security": _security(args, workdir, None),
            # Another job's θ0 comes from its first site (the coordinator never imports a job).
            **(
                {}
                if getattr(args, "job", "")
                else {"initial_model": {"seed": _seed(args), "model": model or DEMO_MODEL}}
            ),
            **_secagg(args),
        }
    }
    coordinator["coordinator"].update(overrides or {})
    coord_cfg = workdir / "coordinator.toml"
    coord_cfg.write_text(dump_toml(coordinator))
    return coord_cfg


def job_options(args: argparse.Namespace, site_index: int) -> dict[str, Any]:
    """``--job-option KEY=VALUE`` as the options table of site ``site_index``."""
    options: dict[str, Any] = {}
    for item in getattr(args, "job_option", []):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--job-option {item!r} is not KEY=VALUE")
        text = raw.replace("{site_index}", str(site_index)).replace("{num_sites}", str(args.sites))
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # a bare word: a string
        *parents, leaf = key.split(".")
        table = options
        for part in parents:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ValueError(f"--job-option {item!r}: {part!r} is not a table")
        table[leaf] = value
    return options


def _job_tables(
    args: argparse.Namespace, index: int, model: dict[str, int] | None
) -> dict[str, Any]:
    """A site's job: ``--job`` with its options, or the byte GPT on its stdlib shard."""
    if getattr(args, "job", ""):
        return {
            "job": {
                "factory": args.job,
                "python_path": [str(Path(p).resolve()) for p in args.job_path],
                "options": job_options(args, index),
            }
        }
    return {
        "eval_batches": 8,
        "eval_batch_size": 16,
        "data": {"source": "stdlib", "shard_index": index, "num_shards": args.sites},
        "model": model or DEMO_MODEL,
        "optim": {"batch_size": args.batch_size},
    }


def write_site_configs(
    args: argparse.Namespace,
    workdir: Path,
    endpoints: dict[str, str],
    *,
    model: dict[str, int] | None = None,
) -> list[tuple[str, Path]]:
    """One config per site; ``endpoints`` is where each reaches the coordinator; ``model``
    replaces the default DEMO_MODEL."""
    sites = []
    for i, site_id in enumerate(site_ids(args.sites)):
        doc = {
            "site": {
                "site_id": site_id,
                "coordinator": endpoints[site_id],
                "state_dir": str(workdir / f"site-{site_id}"),
                "seed": _seed(args),
                "num_threads": 1,
                "device": "cpu",
                "stages": args.stages,
                "error_feedback_decay": getattr(args, "error_feedback_decay", 1.0),
                **_job_tables(args, i, model),
                "security": _security(args, workdir, site_id),
                **_privacy(args),
                **_secagg(args),
            }
        }
        path = workdir / f"site-{site_id}.toml"
        path.write_text(dump_toml(doc))
        sites.append((site_id, path))
    return sites


def wait_endpoint(path: Path, coord: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The endpoint the coordinator writes to ``path`` once it listens (``endpoint.json``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if coord.poll() is not None:
            raise RuntimeError(f"coordinator exited with {coord.returncode} before listening")
        status = read_status(path)
        if status is not None:
            return str(status["endpoint"])
        time.sleep(0.05)
    raise RuntimeError(f"coordinator did not write {path} within {timeout_s:.0f}s")
