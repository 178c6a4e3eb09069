"""``crossdc bench fuzz --live``: mutated valid frames against a live coordinator process.

A real ``crossdc coordinator`` runs with a fresh key kit (CURVE, certificates, the ZAP handler)
and short rounds. Two simulated sites, ``eu`` and ``us``, in a thread of this process, speak the
real protocol over their own CURVE connections: ``eu`` uploads θ0, ``us`` proves it by hash, and
both answer every plan with an update (no training: the rounds are what is measured). A third
certified site, ``fz``, is the attacker: an authenticated peer that sends what it likes under its
own name. Over its connection go valid messages of every type (its own joins, heartbeats,
updates for the open round, chunks, and messages claiming ``eu``'s identity or meant for sites),
most of them mutated by ``crossdc.bench.fuzz_mutate`` and renumbered so the replay check lets
them through to the decoders and handlers behind it.

The coordinator must stay up and keep closing rounds: a finding is its exit, a traceback in its
log, no round closed while the frames were flying, or none in the minute after they stopped.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from comm.codecs.registry import get_codec
from comm.ops.configio import dump_toml
from comm.security.kits import init_kit, issue_site, load_site_kit
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.chunking import split_frames
from comm.wire.frames import WireError, from_wire, to_wire
from comm.wire.schema import (
    ChunkAck,
    Error,
    ErrorCode,
    Eval,
    Global,
    Heartbeat,
    InitParams,
    Join,
    Leave,
    Message,
    RoundStart,
    SyncRequest,
    Update,
    Welcome,
)
from comm.wire.tensors import encode_tensors, state_hash
from crossdc.bench.fuzz_mutate import Mutator
from crossdc.bench.fuzz_targets import pack_frames, unpack_frames

FINGERPRINT = "bench-fuzz-live"
SITES = ("eu", "us")
ATTACKER = "fz"
SESSION = "fz-live"
RECOVERY_S = 60.0
"""After the frames stop, a round must close within this long."""
STARTUP_S = 120.0
ANSWER_AFTER_S = 0.25
"""A simulated site answers a plan this long after it came: a few rounds a second, not hundreds."""
MUTATED = 0.9
"""The share of the attacker's messages that are mutated (the rest go out valid)."""


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "layers.0.w": rng.standard_normal((32, 32)).astype(np.float32),
        "layers.0.b": np.zeros(32, np.float32),
        "head.w": rng.standard_normal((32, 8)).astype(np.float32),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_config(workdir: Path, kit: Path, port: int) -> Path:
    table = {
        "bind": f"tcp://127.0.0.1:{port}",
        "state_dir": str(workdir / "coordinator"),
        "metrics_port": 0,
        "min_sites": 2,
        "quorum_fraction": 0.5,
        "num_inner_steps": 1,
        "max_rounds": 0,
        "overlap": False,
        "uplink_codec": "fp32",
        "downlink_codec": "fp32",
        "align_arrivals": False,
        "round_deadline_s": 15.0,
        "site_timeout_s": 30.0,
        "grace_floor_s": 0.2,
        "grace_ceiling_s": 1.0,
        "keep_checkpoints": 1,
        "final_eval_wait_s": 1.0,
        "channel": {"max_transfer_bytes": 16 << 20, "receive_budget_bytes": 32 << 20},
        "security": {"kit_dir": str(kit)},
    }
    path = workdir / "coordinator.toml"
    path.write_text(dump_toml({"coordinator": table}))
    return path


# --------------------------------------------------------------------------------------------
# The simulated sites


@dataclass
class _Sites:
    """What the sites' thread saw; written by that thread only."""

    rounds_closed: list[float] = field(default_factory=list)
    """When each round's result reached ``eu`` (monotonic)."""
    open_round: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    failure: str = ""


class _SiteThread(threading.Thread):
    """``eu`` and ``us`` on their own CURVE connections, serving rounds until stopped."""

    def __init__(self, endpoint: str, kits: Path, params: dict[str, np.ndarray]) -> None:
        super().__init__(name="fuzz-live-sites", daemon=True)
        self.endpoint, self.kits, self.params = endpoint, kits, params
        self.seen = _Sites()
        self.stop = threading.Event()

    def run(self) -> None:
        chans: dict[str, DealerChannel] = {}
        try:
            for site in SITES:
                curve = load_site_kit(self.kits / f"kit-{site}", site_id=site).curve
                cfg = ChannelConfig(linger_s=0.1, curve=curve)
                chans[site] = DealerChannel(cfg, identity=site)
                chans[site].connect(self.endpoint)
            self._serve(chans)
        except Exception as exc:  # reported as the run's failure, not raised in a thread
            self.seen.failure = f"{type(exc).__name__}: {exc}"
        finally:
            for chan in chans.values():
                chan.close(flush_timeout_s=0)

    def _join(self, chans: dict[str, DealerChannel], site: str) -> None:
        first = site == SITES[0]
        chans[site].send(
            Join(
                site_id=site,
                model_fingerprint=FINGERPRINT,
                global_version=-1 if first else 0,
                state_hash="" if first else state_hash(self.params),
            )
        )

    def _serve(self, chans: dict[str, DealerChannel]) -> None:
        self._join(chans, SITES[0])
        joined: set[str] = set()
        plans: list[tuple[float, str, RoundStart]] = []
        beat_at = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= beat_at:
                beat_at = now + 1.0
                for site in joined:
                    chans[site].send(Heartbeat(site_id=site, global_version=0, sent_at=now))
            for site, chan in chans.items():
                msg = chan.recv(0.0)
                if msg is not None:
                    self._answer(chans, site, msg, joined, plans)
            for due, site, rs in [p for p in plans if p[0] <= now]:
                plans.remove((due, site, rs))
                chans[site].send(self._update(site, rs))
            time.sleep(0.002)

    def _answer(
        self,
        chans: dict[str, DealerChannel],
        site: str,
        msg: Message,
        joined: set[str],
        plans: list[tuple[float, str, RoundStart]],
    ) -> None:
        if isinstance(msg, Welcome):
            joined.add(site)
            if msg.need_init:
                payload = encode_tensors(self.params, get_codec("fp32"))
                chans[site].send(
                    InitParams(site_id=site, model_fingerprint=FINGERPRINT, payload=payload)
                )
            if site == SITES[0] and SITES[1] not in joined:
                self._join(chans, SITES[1])
        elif isinstance(msg, RoundStart):
            self.seen.open_round = max(self.seen.open_round, msg.round_id)
            plans.append((time.monotonic() + ANSWER_AFTER_S, site, msg))
        elif isinstance(msg, Global):
            if site == SITES[0]:
                self.seen.rounds_closed.append(time.monotonic())
            if msg.evaluate:
                chans[site].send(
                    Eval(site_id=site, global_version=msg.global_version, val_loss=1.0)
                )
        elif isinstance(msg, Error):
            code = (
                ErrorCode(msg.code).name.lower()
                if msg.code in ErrorCode._value2member_map_
                else str(msg.code)
            )
            self.seen.errors[f"{site}:{code}"] += 1
            if msg.code == ErrorCode.NOT_JOINED:
                joined.discard(site)
                self._join(chans, site)

    def _update(self, site: str, rs: RoundStart) -> Update:
        rng = np.random.default_rng(rs.round_id)
        delta = {
            k: (1e-3 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in self.params.items()
        }
        return Update(
            site_id=site,
            round_id=rs.round_id,
            global_version=rs.fragment_base_version,
            fragment=rs.fragment,
            weight=1.0,
            train_loss=1.0,
            compute_seconds=0.1,
            step_seconds=0.1,
            link_rtt_s=0.0,
            link_goodput_bps=0.0,
            payload=encode_tensors(delta, get_codec(rs.codec)),
        )


# --------------------------------------------------------------------------------------------
# The attacker


def _header(frames: list[bytes]) -> dict[Any, Any] | None:
    try:
        head = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:  # not msgpack any more
        return None
    return head if isinstance(head, dict) else None


def _renumbered(frames: list[bytes], seq: int) -> list[bytes]:
    """``frames`` with sequence number ``seq`` in the header, when the header is still a map
    that has one (the replay check would refuse a repeated number before anything else)."""
    head = _header(frames)
    if head is None or "q" not in head:
        return frames
    try:
        packed = msgpack.packb({**head, "q": seq}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return frames
    return [bytes(packed), *frames[1:]]


class _Attacker:
    """Site ``fz``'s connection, sending valid and mutated messages as fast as it may."""

    def __init__(
        self, endpoint: str, kit_dir: Path, params: dict[str, np.ndarray], seed: int
    ) -> None:
        self.params = params
        self.rng = random.Random(seed)
        self.mutator = Mutator(self.rng, max_size=1 << 18, tokens=[*SITES, ATTACKER, "fp32"])
        self.ctx: zmq.Context[Any] = zmq.Context()
        curve = load_site_kit(kit_dir, site_id=ATTACKER).curve
        assert curve.server_public is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.ROUTING_ID, f"{ATTACKER}/{os.urandom(16).hex()}".encode())
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        sock.connect(endpoint)
        self.sock = sock
        self.seq = 0
        self.session = SESSION
        self.frames_sent = 0
        self.mutated = 0
        self.blocked = 0
        self.by_type: Counter[str] = Counter()
        self.replies: Counter[str] = Counter()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def _messages(self, open_round: int) -> list[Message]:
        """One template's messages (a chunked update is several)."""
        rng, me = self.rng, ATTACKER
        digest = state_hash(self.params)
        delta = {k: np.full(v.shape, 1e-3, np.float32) for k, v in self.params.items()}
        update = Update(
            site_id=me,
            round_id=open_round,
            global_version=max(0, open_round - 1),
            fragment=0,
            weight=1.0,
            train_loss=1.0,
            compute_seconds=0.1,
            step_seconds=0.1,
            link_rtt_s=0.0,
            link_goodput_bps=0.0,
            payload=encode_tensors(delta, get_codec(rng.choice(("fp32", "int8", "topk:0.1")))),
        )
        kind = rng.randrange(12)
        if kind == 0:
            return [
                Join(site_id=me, model_fingerprint=FINGERPRINT, global_version=0, state_hash=digest)
            ]
        if kind == 1:
            return [Heartbeat(site_id=me, global_version=open_round, sent_at=time.monotonic())]
        if kind == 2:
            return [update]
        if kind == 3:
            return [Eval(site_id=me, global_version=open_round, val_loss=1.0, metrics={"acc": 0.5})]
        if kind == 4:
            return [
                rng.choice(
                    (SyncRequest(site_id=me, global_version=0), Leave(site_id=me, reason="fuzz"))
                )
            ]
        if kind == 5:
            payload = encode_tensors(self.params, get_codec("fp32"))
            return [InitParams(site_id=me, model_fingerprint=FINGERPRINT, payload=payload)]
        if kind in (6, 7):
            frames = to_wire(update, session=self.session, seq=self._next())
            return list(split_frames(frames, 2048))
        if kind == 8:
            return [ChunkAck(transfer_id=os.urandom(8).hex(), next_index=1, credit_bytes=4096)]
        if kind == 9:
            return [
                replace(update, site_id="eu"),
                Join(
                    site_id="eu", model_fingerprint=FINGERPRINT, global_version=0, state_hash=digest
                ),
            ]
        if kind == 10:
            return [
                Welcome(
                    site_id=me,
                    session_id="x",
                    global_version=0,
                    heartbeat_interval_s=1.0,
                    need_init=True,
                )
            ]
        return [
            Global(
                round_id=open_round,
                base_version=0,
                global_version=open_round,
                fragment=0,
                merged=(me,),
                is_full=True,
                state_hash=digest,
                signature=b"",
                evaluate=False,
                payload=update.payload,
            )
        ]

    def step(self, open_round: int) -> None:
        """One template's messages out, most of them mutated; then whatever came back."""
        for msg in self._messages(open_round):
            wire = to_wire(msg, session=self.session, seq=self._next())
            frames = [bytes(memoryview(f).cast("B")) for f in wire]
            if self.rng.random() < MUTATED:
                data = self.mutator.mutate(pack_frames(frames), "frames")
                frames = unpack_frames(data) or [data or b"\0"]
                if self.rng.random() < 0.9:
                    frames = _renumbered(frames, self._next())
                head = _header(frames)
                if head is not None and head.get("s", self.session) != self.session:
                    # The coordinator may now count our session as ended (a restarted peer):
                    # go on in a new one, or everything after is refused as a replay.
                    self.session = f"{SESSION}-{self._next()}"
                self.mutated += 1
            self.by_type[type(msg).__name__] += 1
            self._send(frames)
        self._drain()

    def _send(self, frames: list[bytes]) -> None:
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                self.frames_sent += 1
                return
            except zmq.Again:
                self.blocked += 1  # the coordinator is not draining: wait for room
                self._drain()
                self.sock.poll(50, zmq.POLLOUT)

    def _drain(self) -> None:
        while self.sock.poll(0):
            reply = self.sock.recv_multipart()
            try:
                msg = from_wire(reply)
            except WireError:
                self.replies["undecodable"] += 1
                continue
            if isinstance(msg, Error):
                known = msg.code in ErrorCode._value2member_map_
                self.replies[ErrorCode(msg.code).name.lower() if known else str(msg.code)] += 1
            else:
                self.replies[type(msg).__name__] += 1


# --------------------------------------------------------------------------------------------
# The run


def _wait(cond: Any, timeout_s: float, coord: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        if coord.poll() is not None:
            return False
        time.sleep(0.05)
    return bool(cond())


def run_live(seconds: float, *, seed: int, workdir: Path) -> dict[str, Any]:
    """Fuzz a live coordinator for ``seconds``; its report (``findings`` empty when it held)."""
    workdir.mkdir(parents=True, exist_ok=True)
    kit = init_kit(workdir / "kit")
    for site in (*SITES, ATTACKER):
        issue_site(kit, site, days=2, out_dir=workdir / f"kit-{site}")
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    config = _write_config(workdir, kit, port)
    params = _model()
    log_path = workdir / "coordinator.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    findings: list[dict[str, Any]] = []
    report: dict[str, Any] = {"seconds": seconds}
    with log_path.open("wb") as log:
        coord = subprocess.Popen(
            [sys.executable, "-m", "crossdc", "coordinator", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        sites = _SiteThread(endpoint, workdir, params)
        attacker: _Attacker | None = None
        try:
            sites.start()
            closed = sites.seen.rounds_closed
            if not _wait(lambda: len(closed) >= 1 or sites.seen.failure, STARTUP_S, coord):
                raise RuntimeError(f"no round closed within {STARTUP_S:.0f}s of the start")
            if sites.seen.failure:
                raise RuntimeError(f"the simulated sites failed: {sites.seen.failure}")
            attacker = _Attacker(endpoint, workdir / f"kit-{ATTACKER}", params, seed)
            before, started = len(closed), time.monotonic()
            while time.monotonic() - started < seconds and coord.poll() is None:
                attacker.step(sites.seen.open_round)
            stopped = time.monotonic()
            during = len(closed) - before
            attacker.close()
            recovered = _wait(lambda: bool(closed) and closed[-1] > stopped, RECOVERY_S, coord)
            report.update(
                frames_sent=attacker.frames_sent,
                frames_mutated=attacker.mutated,
                frames_per_second=round(attacker.frames_sent / max(stopped - started, 1e-9)),
                sends_blocked=attacker.blocked,
                messages_by_type=dict(attacker.by_type),
                coordinator_replies=dict(attacker.replies),
                rounds_closed_while_fuzzing=during,
                rounds_closed_per_minute=round(60.0 * during / max(stopped - started, 1e-9), 1),
                round_closed_after=recovered,
                site_errors=dict(sites.seen.errors),
            )
            if during == 0:
                findings.append(
                    _finding("no_progress", "no round closed while the frames were sent")
                )
            if not recovered:
                findings.append(
                    _finding("no_recovery", f"no round closed within {RECOVERY_S:.0f}s after")
                )
        finally:
            sites.stop.set()
            sites.join(timeout=10)
            if attacker is not None and not attacker.sock.closed:
                attacker.close()
            alive = coord.poll() is None
            report["coordinator_alive"] = alive
            if alive:
                coord.terminate()
                try:
                    coord.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    coord.kill()
                    coord.wait()
            else:
                findings.append(_finding("coordinator_exit", f"exited with {coord.returncode}"))
    report["coordinator_exit_code"] = coord.returncode
    text = log_path.read_text(errors="replace")
    if "Traceback" in text:
        at = text.index("Traceback")
        findings.append(_finding("traceback", text[at : at + 2000]))
    try:
        status = json.loads((workdir / "coordinator" / "status.json").read_text())
        report["coordinator_rejected"] = status.get("rejected", {})
        report["rounds_completed"] = status.get("rounds_completed", 0)
    except (OSError, ValueError):
        pass
    report["findings"] = findings
    return report


def _finding(kind: str, message: str) -> dict[str, Any]:
    return {
        "target": "live",
        "kind": kind,
        "error": kind,
        "where": "coordinator",
        "message": message,
    }
