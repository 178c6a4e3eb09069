"""``crossdc bench scale``: one real coordinator against many simulated sites, by model size.

The coordinator is a real ``crossdc coordinator`` process (its own config, state dir and socket).
The sites are clients in this process, each with its own ZeroMQ DEALER channel, speaking the real
wire protocol: the first joins and uploads θ0, the others join proving θ0 by hash; in every round
each sends an int4 update of the whole model and takes the result, without training (the bench
measures the coordinator, not the sites). The sites stream (``crossdc.bench.scale_sites``): θ0
and their updates are generated a tensor at a time, the results they receive are applied to θ
and hashed a tensor at a time, and θ lives in a file, so that the bench holds almost nothing
per parameter beside the coordinator. Per case it reports the coordinator's peak resident
memory (``VmHWM``), how long each round took from its RoundStart to the last site's result,
messages the coordinator refused, WAN bytes per round (everything on its socket, divided by
the rounds), how many sites ended on the coordinator's last version and state hash
(``sites_on_final_hash``; every site checks every result's hash on the way) and the bench
process's own peak resident memory (``bench_peak_rss_bytes``, its ``VmHWM`` over the case: it
is reset when the case starts; 0 where the kernel refuses that).

With ``--shards S`` (S > 1) the coordinator is S processes, ``crossdc coordinator --shard N``
for N in 0 to S-1 from one config with ``shards = S`` (each its own port, state directory and
status file; shard 0's control plane on a port of its own), and no process builds θ0 but the
first site, which uploads it: each site holds one channel per shard put together as a real
site's (``site_agent.shard_links.ShardedLink``), which sends each shard its tensors of θ0 and of
every update (the cut of ``comm.wire.partition.partition``) and hands the site a result once
every shard's part of it came, under the whole model's hash that shard 0 signs; the sites apply
and hash it as with one process, and ``sites_on_final_hash`` counts the sites on shard 0's last
version and that hash. With one shard everything is as above.

Per coordinator process (the list ``shards``, shard 0 first; one entry with one process) it
reports (``params``: the parameters it owns, all of them with one process):

- ``peak_rss_bytes``: its peak resident memory (``VmHWM``);
- ``base_rss_bytes``: its resident memory (``VmRSS``) once it is up and has welcomed the first
  site, before that site sends θ0: the process without the model;
- ``bytes_per_param``: ``(peak_rss_bytes - base_rss_bytes) / params``, what the model costs the
  process per parameter it owns;
- ``budget_bytes_per_param``: what the process holds per parameter with the configuration it
  reads and the sites of the case (:func:`coordinator.memory.state_budget`: the state kept, θ 4,
  the outer momentum 4 with DiLoCo and the downlink residual 4 with the dense broadcast; the
  updates the open rounds hold as they came, the uplink codec's size per site and round open
  at once; the broadcast being sent, the downlink codec's size: 12 + 3 x 0.53 + 0.53 = 14.1
  here);
- ``within_budget``: ``bytes_per_param <= budget_bytes_per_param + tolerance / params``, where
  ``tolerance`` (:func:`tolerance_bytes`) is what the process may hold beside that, none of it
  growing with the model: the transfers its transport reassembles, at most the channel's
  receive budget (``receive_budget_bytes``, 1 GiB by default, over all its peers), and a
  close's temporaries of one tensor, CLOSE_TEMPORARIES (8) float32 arrays of the largest tensor
  (128 MiB at the bench's 4M values). Divided by the parameters they vanish for a large model
  and dominate a small one (about 12 bytes per parameter at 100M, 1.2 at 1B): the check says
  something from a few hundred million parameters on;
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
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from comm.ops.configio import dump_toml
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.partition import partition
from comm.wire.schema import Join, Welcome
from coordinator.config import CoordinatorConfig, load_coordinator_config, sections
from coordinator.memory import state_budget
from crossdc.bench import print_report
from crossdc.bench.scale_sites import (
    FINGERPRINT,
    TENSOR_NUMEL,
    Layout,
    SharedTheta,
    Site,
    Sites,
    drain,
)
from crossdc.progress import add_progress_argument, open_progress
from site_agent.shard_links import ShardedLink


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss(pid: int | str, field: str = "VmHWM") -> int:
    """The process's peak (``VmHWM``) or current (``VmRSS``) resident set in bytes; 0 once it
    is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_own_peak() -> bool:
    """Start this process's ``VmHWM`` afresh from its current resident set (Linux's
    ``clear_refs`` 5), so that each case measures its own peak; False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _cpu_seconds(pid: int) -> float:
    """The process's CPU time so far (user + system, all its threads); 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def coordinator_table(
    workdir: Path, *, sites: int, rounds: int, port: int, shards: int = 1, control_port: int = 0
) -> dict[str, Any]:
    """The ``[coordinator]`` table of a case's coordinator: one process, or with ``shards`` > 1
    every shard's (shard i on ``port`` + i, shard 0's control plane on ``control_port``)."""
    table: dict[str, Any] = {
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
    if shards > 1:
        # A shard may have to go back a version: it keeps the one before.
        table.update(
            shards=shards,
            shard_control_bind=f"tcp://127.0.0.1:{control_port}",
            keep_checkpoints=2,
            channel={"heartbeat_timeout_s": SHARD_HEARTBEAT_TIMEOUT_S},
        )
    return table


SHARD_HEARTBEAT_TIMEOUT_S = 60.0
"""With several shards, the silence after which a connection is cut and a shard counted lost
(the channel's ``heartbeat_timeout_s``, 10 s by default), on the shards and the sites alike: S
coordinator processes and the sites share this machine's cores, and a shard busy with a pass
over its part of a large model (θ0's digests, a close) may not be heard from for seconds. A
shard lost aborts the rounds in flight, which the bench does not measure."""


# ---- the budget --------------------------------------------------------------------------------


def budget_bytes_per_param(cfg: CoordinatorConfig, sites: int) -> float:
    """The bytes a coordinator configured as ``cfg`` holds per parameter it owns with ``sites``
    sites (:func:`coordinator.memory.state_budget`'s total)."""
    return state_budget(sections(cfg), sites).total


CLOSE_TEMPORARIES = 8
"""Float32 arrays of the largest tensor a close holds at once beside the state (about 7 by the
close's own count: the mean's buffer, θ + residual, the step, the delta, its decoding, the
codec's work arrays; one more to spare)."""


def tolerance_bytes(cfg: CoordinatorConfig, largest_tensor: int) -> int:
    """What a coordinator configured as ``cfg`` (its largest tensor ``largest_tensor`` values)
    may hold beside its budget, none of it growing with the model: the transfers in reassembly
    (at most the channel's receive budget) and a close's temporaries (CLOSE_TEMPORARIES float32
    arrays of the largest tensor)."""
    return cfg.channel.receive_budget_bytes + CLOSE_TEMPORARIES * 4 * largest_tensor


# ---- one coordinator process -------------------------------------------------------------------


@dataclass
class _Coordinator:
    """A ``crossdc coordinator`` process of a case and what the bench saw of it."""

    workdir: Path
    config: CoordinatorConfig
    """Its configuration, as it reads it."""
    endpoint: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    peak_rss: int = 0
    base_rss: int = 0
    cpu_seconds: float = 0.0
    owned: tuple[int, int] | None = None
    """A shard of several: the parameters it owns and its largest tensor; None: the whole."""

    @classmethod
    def start(cls, workdir: Path, *, sites: int, rounds: int) -> _Coordinator:
        port = _free_port()
        table = coordinator_table(workdir, sites=sites, rounds=rounds, port=port)
        cfg = workdir / "coordinator.toml"
        cfg.write_text(dump_toml({"coordinator": table}))
        log = open(workdir / "coordinator.log", "wb")  # noqa: SIM115 (closed by stop)
        proc = subprocess.Popen(
            [sys.executable, "-m", "crossdc", "coordinator", "--config", str(cfg)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        return cls(workdir, load_coordinator_config(cfg), f"tcp://127.0.0.1:{port}", proc, log)

    @classmethod
    def start_shards(
        cls, workdir: Path, *, sites: int, rounds: int, shards: int, layout: Layout
    ) -> list[_Coordinator]:
        """``shards`` processes ``crossdc coordinator --shard N`` of one config, shard 0 first,
        each owning its part of ``layout``'s tensors."""
        from coordinator.sharding import ShardIdentity, shard_config

        port, control = _free_ports(shards), _free_port()
        table = coordinator_table(
            workdir, sites=sites, rounds=rounds, port=port, shards=shards, control_port=control
        )
        path = workdir / "coordinator.toml"
        path.write_text(dump_toml({"coordinator": table}))
        whole = load_coordinator_config(path)
        parts = partition({name: (n,) for _, name, _, n in layout.tensors()}, shards)
        sizes = dict(zip(layout.names, layout.sizes, strict=True))
        out: list[_Coordinator] = []
        for i, part in enumerate(parts):
            log = open(workdir / f"coordinator-{i}.log", "wb")  # noqa: SIM115 (closed by stop)
            proc = subprocess.Popen(
                [sys.executable, "-m", "crossdc", "coordinator", "--config", str(path)]
                + ["--shard", str(i)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            cfg = shard_config(whole, ShardIdentity(i, shards, "bench"))
            owned = (sum(sizes[n] for n in part), max(sizes[n] for n in part))
            out.append(cls(workdir, cfg, f"tcp://127.0.0.1:{port + i}", proc, log, owned=owned))
        return out

    def sample(self) -> None:
        self.peak_rss = max(self.peak_rss, _rss(self.proc.pid))
        self.cpu_seconds = max(self.cpu_seconds, _cpu_seconds(self.proc.pid))

    def check_running(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {self.proc.returncode}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def status(self) -> dict[str, Any]:
        return dict(json.loads((Path(self.config.state_dir) / "status.json").read_text()))


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports free on the loopback now."""
    for _ in range(100):
        first = _free_port()
        if first + count > 65536:
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports")


# ---- a case ------------------------------------------------------------------------------------


def _await_welcome(
    sites: Sites, site: Site, timeout_s: float, before: Callable[[], None] = lambda: None
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
            sites.answer(site, msg)
            if isinstance(msg, Welcome):
                return
    raise RuntimeError(f"no Welcome to {site.site_id} within {timeout_s:.0f}s")


def _serve(sites: Sites, coords: list[_Coordinator], timeout_s: float) -> None:
    """Drive every site's channel and take the results they receive until every site got
    Shutdown and holds the last result (or a coordinator exited)."""
    deadline = time.monotonic() + timeout_s
    last_rss = 0.0
    while not sites.idle:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no Shutdown within {timeout_s:.0f}s")
        for coord in coords:
            coord.check_running()
        busy = False
        for site in sites.sites:
            site.beat()
            busy = drain(sites, site) or busy
        busy = sites.step() or busy
        sites.theta.files.release()
        if time.monotonic() - last_rss > 0.2:
            for coord in coords:
                coord.sample()
            last_rss = time.monotonic()
        if not busy:
            time.sleep(0.002)


def run_case(
    sites: int, numel: int, rounds: int, workdir: Path, timeout_s: float, shards: int = 1
) -> dict[str, Any]:
    """One case: ``sites`` simulated sites, a model of ``numel`` parameters, ``rounds`` rounds,
    and a coordinator of ``shards`` processes. ValueError when the model has fewer tensors than
    shards (each shard owns at least one)."""
    layout = Layout.of(numel)
    parts = partition({name: (n,) for _, name, _, n in layout.tensors()}, shards)
    workdir.mkdir(parents=True)
    own_peak = _reset_own_peak()
    if shards == 1:
        coords = [_Coordinator.start(workdir, sites=sites, rounds=rounds)]
    else:
        coords = _Coordinator.start_shards(
            workdir, sites=sites, rounds=rounds, shards=shards, layout=layout
        )
    run = Sites(SharedTheta(layout, workdir / "sites"))
    channel = ChannelConfig(max_transfer_bytes=max(1 << 30, 8 * numel))
    if shards > 1:
        channel = replace(channel, heartbeat_timeout_s=SHARD_HEARTBEAT_TIMEOUT_S)
    try:
        digest = run.theta.write_theta0()  # before the sites connect: none has joined to beat
        for i in range(sites):
            chans = tuple(DealerChannel(channel, identity=f"site{i:02d}") for _ in coords)
            for chan, c in zip(chans, coords, strict=True):
                chan.connect(c.endpoint)
            if shards == 1:
                run.sites.append(Site(i, f"site{i:02d}", chans[0], hash=digest))
            else:
                link = ShardedLink(chans, parts)
                run.sites.append(Site(i, f"site{i:02d}", link, chans, hash=digest))
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
                # model yet: its resident memory now is its base (every shard's).
                def base() -> None:
                    for c in coords:
                        c.base_rss = _rss(c.proc.pid, "VmRSS")

                _await_welcome(run, site, timeout_s, before=base)
        started = time.monotonic()
        _serve(run, coords, timeout_s)
        wall = time.monotonic() - started
        for c in coords:
            c.proc.wait(timeout=120)
    finally:
        for site in run.sites:
            for wire in site.wires:
                wire.close(flush_timeout_s=0)
        for c in coords:
            c.stop()
        run.theta.close()
    bench_peak = _rss("self") if own_peak else 0
    return _figures(run, coords, sites, numel, wall, bench_peak)


def _shard(
    coord: _Coordinator, status: dict[str, Any], params: int, largest: int, sites: int
) -> dict[str, Any]:
    """One coordinator process's figures (an entry of ``shards``)."""
    if coord.owned is not None:
        params, largest = coord.owned
    folded = int(status.get("fold_parameter_updates", 0))
    fold_cpu = round(float(status.get("fold_cpu_seconds", 0.0)), 6)
    per_param = (coord.peak_rss - coord.base_rss) / params
    budget = budget_bytes_per_param(coord.config, sites)
    tolerance = tolerance_bytes(coord.config, largest) / params
    return {
        "params": params,
        "peak_rss_bytes": coord.peak_rss,
        "base_rss_bytes": coord.base_rss,
        "bytes_per_param": round(per_param, 2),
        "budget_bytes_per_param": round(budget, 4),
        "within_budget": per_param <= budget + tolerance,
        "fold_parameter_updates": folded,
        "fold_cpu_seconds": fold_cpu,
        "fold_rate": round(folded / fold_cpu) if fold_cpu > 0 else 0,
        "cpu_seconds": round(coord.cpu_seconds, 2),
    }


def _figures(
    run: Sites,
    coords: list[_Coordinator],
    sites: int,
    numel: int,
    wall: float,
    bench_peak: int,
) -> dict[str, Any]:
    """The case's report, from the coordinators' status files and the sites' observations."""
    statuses = [c.status() for c in coords]
    status = statuses[0]  # the one that plans the rounds
    wan = sum(int(s.get("wire_bytes_in", 0)) + int(s.get("wire_bytes_out", 0)) for s in statuses)
    rounds = int(status.get("rounds_completed", 0))
    closes = [
        round(run.closed[r] - run.opened[r], 3) for r in sorted(run.closed) if r in run.opened
    ]
    shards = [
        _shard(c, s, numel, run.layout.largest, sites)
        for c, s in zip(coords, statuses, strict=True)
    ]
    for shard in shards:
        shard["round_close_seconds"] = closes
    final = (status.get("global_version"), status.get("state_hash"))
    return {
        "sites": sites,
        "params": numel,
        "rounds": rounds,
        "coordinator_peak_rss_bytes": max(c.peak_rss for c in coords),
        "round_close_seconds": closes,
        "messages_refused": sum(int(sum(s.get("rejected", {}).values())) for s in statuses),
        "wan_bytes_per_round": wan / max(1, rounds),
        "wan_bytes_total": wan,
        # The sites' side of the coordinator's receive budget: uploads it held back (they waited
        # with every chunk acknowledged) and chunks sent again after a stall.
        "uploads_waited": sum(w.stats.credit_waits for s in run.sites for w in s.wires),
        "chunks_resent": sum(w.stats.chunks_resent for s in run.sites for w in s.wires),
        "wall_seconds": round(wall, 2),
        "sites_on_final_hash": sum((s.version, s.hash) == final for s in run.sites),
        "bench_peak_rss_bytes": bench_peak,
        "shards": shards,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crossdc bench scale", description=__doc__.splitlines()[0])
    p.add_argument("--sites", default="2,8,32,64", help="comma-separated site counts")
    p.add_argument("--params", default="1000000,10000000,50000000", help="model sizes")
    p.add_argument("--rounds", type=int, default=2, help="rounds per case")
    p.add_argument("--shards", type=int, default=1, help="coordinator processes (shards)")
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
    if min(site_counts) < 1 or min(sizes) < 1 or args.rounds < 1 or args.shards < 1:
        print("crossdc bench scale: sites, params, rounds and shards must be >= 1", file=sys.stderr)
        return 2
    few = [n for n in sizes if len(Layout.of(n).sizes) < args.shards]
    if few:
        print(
            f"crossdc bench scale: {few[0]:,} parameters make {len(Layout.of(few[0]).sizes)} "
            f"tensors of at most {TENSOR_NUMEL:,} values, fewer than {args.shards} shards",
            file=sys.stderr,
        )
        return 2
    runs = []
    cases = [(numel, sites) for numel in sizes for sites in site_counts]
    progress = open_progress("crossdc bench scale", no_progress=args.no_progress)
    with progress, tempfile.TemporaryDirectory(prefix="crossdc-scale-") as tmp:
        root = Path(args.workdir or tmp)
        for i, (numel, sites) in enumerate(cases, 1):
            workdir = root / f"p{numel}-s{sites}"
            progress.phase(f"{numel:,} parameters x {sites} sites", i, len(cases))
            status_dir = workdir / "coordinator" / ("shard-0" if args.shards > 1 else "")
            with progress.follow(status_dir, total=args.rounds):
                runs.append(run_case(sites, numel, args.rounds, workdir, args.timeout, args.shards))
            # Each case as it finishes (a long run that fails later keeps what it measured).
            progress.log(json.dumps(runs[-1]))
    print_report({"runs": runs}, as_json=args.json)
    return 0
