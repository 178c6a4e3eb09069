"""``crossdc bench scale``: one real coordinator against many simulated sites, by model size.

The coordinator is a real ``crossdc coordinator`` process (its own config, state dir and socket).
The sites are clients in this process, each with its own ZeroMQ DEALER channel, speaking the real
wire protocol: the first joins and uploads θ0, the others join proving θ0 by hash; in every round
each sends an int4 update of the whole model and takes the result, without training (the bench
measures the coordinator, not the sites). Per case it reports the coordinator's peak resident
memory (``VmHWM``), how long each round took from its RoundStart to the last site's result,
messages the coordinator refused, and WAN bytes per round (everything on its socket, divided by
the rounds).

Per coordinator process (the list ``shards``; one process today, so one entry) it reports:

- ``peak_rss_bytes``: its peak resident memory (``VmHWM``);
- ``base_rss_bytes``: its resident memory (``VmRSS``) once it is up and has welcomed the first
  site, before that site sends θ0: the process without the model;
- ``bytes_per_param``: ``(peak_rss_bytes - base_rss_bytes) / params``, what the model costs the
  process per parameter it owns;
- ``fold_rate``: parameter values of accepted updates decoded, checked and folded per CPU second
  of the thread that did it, from the coordinator's counters
  ``crossdc_fold_parameter_updates_total`` and ``crossdc_fold_cpu_seconds_total`` (also in its
  ``status.json``); the transport's and the state writer's threads are not in that time;
- ``cpu_seconds``: the whole process's CPU time (user + system, ``/proc/PID/stat``) as last seen
  before it exited, for the fold's share of it;
- ``round_close_seconds``: as above.

``docs/scaling.md`` has the figures and what they mean.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.ops.configio import dump_toml
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.schema import (
    Eval,
    Global,
    Heartbeat,
    InitParams,
    Join,
    Message,
    RoundStart,
    Shutdown,
    Update,
    Welcome,
)
from comm.wire.tensors import encode_tensors, state_hash
from crossdc.bench import print_report
from crossdc.progress import add_progress_argument, open_progress

TENSOR_NUMEL = 1 << 22  # the model is cut into tensors of at most 4M values
FINGERPRINT = "bench-scale"


def model(numel: int) -> dict[str, np.ndarray]:
    """A model of ``numel`` float32 values in tensors of at most TENSOR_NUMEL."""
    rng = np.random.default_rng(0)
    sizes = [TENSOR_NUMEL] * (numel // TENSOR_NUMEL) + [numel % TENSOR_NUMEL]
    return {
        f"t{i:03d}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes) if n
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss(pid: int, field: str = "VmHWM") -> int:
    """The process's peak (``VmHWM``) or current (``VmRSS``) resident set in bytes; 0 once it
    is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_seconds(pid: int) -> float:
    """The process's CPU time so far (user + system, all its threads); 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_config(workdir: Path, *, sites: int, rounds: int, port: int) -> Path:
    table = {
        "bind": f"tcp://127.0.0.1:{port}",
        "state_dir": str(workdir / "coordinator"),
        "metrics_port": 0,
        "min_sites": sites,
        "max_rounds": rounds,
        "num_inner_steps": 10,
        "overlap": False,
        "uplink_codec": "int4",
        "downlink_codec": "int4",
        "align_arrivals": False,
        "round_deadline_s": 1800.0,
        "site_timeout_s": 1800.0,
        "final_eval_wait_s": 60.0,
        "keep_checkpoints": 1,
        "max_update_norm": 1e12,
        "security": {"insecure": True},
    }
    path = workdir / "coordinator.toml"
    path.write_text(dump_toml({"coordinator": table}))
    return path


@dataclass
class _Site:
    site_id: str
    chan: DealerChannel
    done: bool = False
    version: int = 0
    next_beat: float = 0.0

    def beat(self) -> None:
        """A heartbeat each interval, as a real site sends: the coordinator cuts a connection
        that stays silent past its heartbeat timeout (a site waiting for a long close would)."""
        now = time.monotonic()
        if now >= self.next_beat:
            self.chan.send(
                Heartbeat(site_id=self.site_id, global_version=self.version, sent_at=now)
            )
            self.next_beat = now + self.chan.cfg.heartbeat_interval_s


@dataclass
class _Run:
    """The simulated sites' view of one case."""

    theta0: dict[str, np.ndarray]
    update: tuple[EncodedTensor, ...]
    sites: list[_Site] = field(default_factory=list)
    opened: dict[int, float] = field(default_factory=dict)
    closed: dict[int, float] = field(default_factory=dict)
    peak_rss: int = 0
    base_rss: int = 0
    cpu_seconds: float = 0.0


def _answer(run: _Run, site: _Site, msg: Message) -> None:
    """What a site sends back: InitParams when asked, an update per round, Eval when asked."""
    if isinstance(msg, Welcome) and msg.need_init:
        site.chan.send(
            InitParams(
                site_id=site.site_id,
                model_fingerprint=FINGERPRINT,
                payload=encode_tensors(run.theta0, get_codec("fp32")),
            )
        )
    elif isinstance(msg, RoundStart):
        run.opened.setdefault(msg.round_id, time.monotonic())
        site.chan.send(
            Update(
                site_id=site.site_id,
                round_id=msg.round_id,
                global_version=msg.fragment_base_version,
                fragment=msg.fragment,
                weight=1.0,
                train_loss=1.0,
                compute_seconds=0.0,
                step_seconds=0.0,
                link_rtt_s=0.0,
                link_goodput_bps=0.0,
                payload=run.update,
            )
        )
    elif isinstance(msg, Global):
        run.closed[msg.round_id] = time.monotonic()
        site.version = msg.global_version
        if msg.evaluate:
            site.chan.send(
                Eval(
                    site_id=site.site_id,
                    global_version=msg.global_version,
                    val_loss=1.0,
                )
            )
    elif isinstance(msg, Shutdown):
        site.done = True


FRAMES_PER_PASS = 64
"""Frame lists one site reads per pass over the sites: a real site's I/O thread drains its
socket; one read per pass would let a site fall behind what its socket receives."""


def _drain(run: _Run, site: _Site) -> bool:
    """Read what waits on one site's socket (up to FRAMES_PER_PASS); True if there was any."""
    busy = False
    for _ in range(FRAMES_PER_PASS):
        before = site.chan.stats.bytes_received
        msg = site.chan.recv(0.0)
        if msg is not None:
            _answer(run, site, msg)
            if not isinstance(msg, Heartbeat):
                site.next_beat = 0.0  # its acknowledgement rides on the next heartbeat
        elif site.chan.stats.bytes_received == before:
            return busy  # nothing came in
        busy = True
    return busy


def _await_welcome(
    run: _Run, site: _Site, timeout_s: float, before: Callable[[], None] = lambda: None
) -> None:
    """Wait for the coordinator's Welcome to ``site``, run ``before``, and answer it (InitParams
    when asked)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        site.beat()
        msg = site.chan.recv(0.1)
        if msg is not None:
            if isinstance(msg, Welcome):
                before()
            _answer(run, site, msg)
            if isinstance(msg, Welcome):
                return
    raise RuntimeError(f"no Welcome to {site.site_id} within {timeout_s:.0f}s")


def _serve(run: _Run, coord: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Drive every site's channel until all got Shutdown (or the coordinator exited)."""
    deadline = time.monotonic() + timeout_s
    last_rss = 0.0
    while not all(s.done for s in run.sites):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no Shutdown within {timeout_s:.0f}s")
        if coord.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {coord.returncode}")
        busy = False
        for site in run.sites:
            site.beat()
            busy = _drain(run, site) or busy
        if time.monotonic() - last_rss > 0.2:
            run.peak_rss, last_rss = max(run.peak_rss, _rss(coord.pid)), time.monotonic()
            run.cpu_seconds = max(run.cpu_seconds, _cpu_seconds(coord.pid))
        if not busy:
            time.sleep(0.002)


def _new_run(numel: int) -> _Run:
    """θ0 of ``numel`` values and the one int4 update every simulated site sends."""
    theta0 = model(numel)
    rng = np.random.default_rng(1)
    delta = {k: (1e-3 * rng.standard_normal(v.size)).astype(np.float32) for k, v in theta0.items()}
    return _Run(theta0=theta0, update=encode_tensors(delta, get_codec("int4")))


def run_case(
    sites: int, numel: int, rounds: int, workdir: Path, timeout_s: float
) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    port = _free_port()
    cfg = write_config(workdir, sites=sites, rounds=rounds, port=port)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(workdir / "coordinator.log", "wb")  # noqa: SIM115 (closed below)
    coord = subprocess.Popen(
        [sys.executable, "-m", "crossdc", "coordinator", "--config", str(cfg)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    run = _new_run(numel)
    channel = ChannelConfig(max_transfer_bytes=max(1 << 30, 8 * numel))
    try:
        for i in range(sites):
            chan = DealerChannel(channel, identity=f"site{i:02d}")
            chan.connect(f"tcp://127.0.0.1:{port}")
            run.sites.append(_Site(f"site{i:02d}", chan))
        digest = state_hash(run.theta0)
        for i, site in enumerate(run.sites):
            # The first joins with nothing and is asked for θ0; the others prove it by hash.
            site.chan.send(
                Join(
                    site_id=site.site_id,
                    model_fingerprint=FINGERPRINT,
                    global_version=0 if i else -1,
                    state_hash=digest if i else "",
                )
            )
            if i == 0:
                # So the first join is the one asked for θ0; the coordinator is up and holds no
                # model yet: its resident memory now is its base.
                def base(pid: int = coord.pid) -> None:
                    run.base_rss = _rss(pid, "VmRSS")

                _await_welcome(run, site, timeout_s, before=base)
        started = time.monotonic()
        _serve(run, coord, timeout_s)
        wall = time.monotonic() - started
        coord.wait(timeout=120)
    finally:
        for site in run.sites:
            site.chan.close(flush_timeout_s=0)
        if coord.poll() is None:
            coord.kill()
            coord.wait()
        log.close()
    return _figures(run, workdir, sites, numel, wall)


def _figures(run: _Run, workdir: Path, sites: int, numel: int, wall: float) -> dict[str, Any]:
    """The case's report, from the coordinator's status file and the sites' observations."""
    status = json.loads((workdir / "coordinator" / "status.json").read_text())
    wan = int(status.get("wire_bytes_in", 0)) + int(status.get("wire_bytes_out", 0))
    rounds = int(status.get("rounds_completed", 0))
    closes = [run.closed[r] - run.opened[r] for r in sorted(run.closed) if r in run.opened]
    folded = int(status.get("fold_parameter_updates", 0))
    fold_cpu = round(float(status.get("fold_cpu_seconds", 0.0)), 6)
    shard = {
        "params": numel,
        "peak_rss_bytes": run.peak_rss,
        "base_rss_bytes": run.base_rss,
        "bytes_per_param": round((run.peak_rss - run.base_rss) / numel, 2),
        "fold_parameter_updates": folded,
        "fold_cpu_seconds": fold_cpu,
        "fold_rate": round(folded / fold_cpu) if fold_cpu > 0 else 0,
        "cpu_seconds": round(run.cpu_seconds, 2),
        "round_close_seconds": [round(s, 3) for s in closes],
    }
    return {
        "sites": sites,
        "params": numel,
        "rounds": rounds,
        "coordinator_peak_rss_bytes": run.peak_rss,
        "round_close_seconds": [round(s, 3) for s in closes],
        "messages_refused": int(sum(status.get("rejected", {}).values())),
        "wan_bytes_per_round": wan / max(1, rounds),
        "wan_bytes_total": wan,
        # The sites' side of the coordinator's receive budget: uploads it held back (they waited
        # with every chunk acknowledged) and chunks sent again after a stall.
        "uploads_waited": sum(s.chan.stats.credit_waits for s in run.sites),
        "chunks_resent": sum(s.chan.stats.chunks_resent for s in run.sites),
        "wall_seconds": round(wall, 2),
        "shards": [shard],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crossdc bench scale", description=__doc__.splitlines()[0])
    p.add_argument("--sites", default="2,8,32,64", help="comma-separated site counts")
    p.add_argument("--params", default="1000000,10000000,50000000", help="model sizes")
    p.add_argument("--rounds", type=int, default=2, help="rounds per case")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    p.add_argument("--workdir", default="", help="keep configs, state and logs here")
    p.add_argument("--json", action="store_true")
    add_progress_argument(p)
    args = p.parse_args(argv)
    try:
        site_counts = [int(s) for s in args.sites.split(",")]
        sizes = [int(float(s)) for s in args.params.split(",")]
    except ValueError:
        print(
            "crossdc bench scale: --sites and --params take comma-separated numbers",
            file=sys.stderr,
        )
        return 2
    if min(site_counts) < 1 or min(sizes) < 1 or args.rounds < 1:
        print("crossdc bench scale: sites, params and rounds must be >= 1", file=sys.stderr)
        return 2
    runs = []
    cases = [(numel, sites) for numel in sizes for sites in site_counts]
    progress = open_progress("crossdc bench scale", no_progress=args.no_progress)
    with progress, tempfile.TemporaryDirectory(prefix="crossdc-scale-") as tmp:
        root = Path(args.workdir or tmp)
        for i, (numel, sites) in enumerate(cases, 1):
            workdir = root / f"p{numel}-s{sites}"
            progress.phase(f"{numel:,} parameters x {sites} sites", i, len(cases))
            with progress.follow(workdir / "coordinator", total=args.rounds):
                runs.append(run_case(sites, numel, args.rounds, workdir, args.timeout))
            # Each case as it finishes (a long run that fails later keeps what it measured).
            progress.log(json.dumps(runs[-1]))
    print_report({"runs": runs}, as_json=args.json)
    return 0
