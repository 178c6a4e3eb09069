"""The attacker of ``crossdc bench fuzz --live`` (``crossdc.bench.fuzz_live`` runs it beside the
honest sites of ``crossdc.bench.fuzz_live_sites``).

:class:`Attacker` is site ``fz``, certified like the honest sites: over its connection go valid
messages of every type (``TEMPLATES``), nine in ten mutated by ``crossdc.bench.fuzz_mutate`` and
renumbered so the replay check lets them through to what is behind it; it counts the
coordinator's replies by kind.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from comm.codecs.registry import get_codec
from comm.security.rolekits import load_site_kit
from comm.wire.chunking import split_frames
from comm.wire.frames import WireError, from_wire, to_wire
from comm.wire.schema import (
    ChunkAck,
    Error,
    Eval,
    Global,
    Heartbeat,
    InitParams,
    Join,
    Leave,
    Message,
    SyncRequest,
    Update,
    Welcome,
)
from comm.wire.tensors import encode_tensors, state_hash
from crossdc.bench.fuzz_live_sites import FINGERPRINT, SITES, code_name
from crossdc.bench.fuzz_mutate import Mutator
from crossdc.bench.fuzz_seeds import pack_frames, unpack_frames

ATTACKER = "fz"
SESSION = "fz-live"
MUTATED = 0.9
"""The share of the attacker's messages that are mutated (the rest go out valid)."""
SEND_WAIT_S = 5.0
"""Longest wait for room to send one message; then it is counted abandoned, so the run's
time bound holds even when the connection is down for good."""


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


class Attacker:
    """Site ``fz``'s connection, sending valid and mutated messages as fast as it may."""

    def __init__(
        self, endpoint: str, kit_dir: Path, params: dict[str, np.ndarray], seed: int
    ) -> None:
        self.params = params
        self.digest = state_hash(params)
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
        self.abandoned = 0
        self.by_type: Counter[str] = Counter()
        self.replies: Counter[str] = Counter()

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(linger=0)
            self.ctx.term()

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def update(self, open_round: int) -> Update:
        """An update of ``fz`` for the open round, in a codec of its choice."""
        delta = {k: np.full(v.shape, 1e-3, np.float32) for k, v in self.params.items()}
        codec = get_codec(self.rng.choice(("fp32", "int8", "topk:0.1")))
        return Update(
            site_id=ATTACKER,
            round_id=open_round,
            global_version=max(0, open_round - 1),
            fragment=0,
            weight=1.0,
            train_loss=1.0,
            compute_seconds=0.1,
            step_seconds=0.1,
            link_rtt_s=0.0,
            link_goodput_bps=0.0,
            payload=encode_tensors(delta, codec),
        )

    def step(self, open_round: int) -> None:
        """One template's messages out, most of them mutated; then whatever came back."""
        for msg in self.rng.choice(TEMPLATES)(self, open_round):
            wire = to_wire(msg, session=self.session, seq=self.next_seq())
            frames = [bytes(memoryview(f).cast("B")) for f in wire]
            if self.rng.random() < MUTATED:
                data = self.mutator.mutate(pack_frames(frames), "frames")
                frames = unpack_frames(data) or [data or b"\0"]
                if self.rng.random() < 0.9:
                    frames = _renumbered(frames, self.next_seq())
                head = _header(frames)
                if head is not None and head.get("s", self.session) != self.session:
                    # The coordinator may now count our session as ended (a restarted peer):
                    # go on in a new one, or everything after is refused as a replay.
                    self.session = f"{SESSION}-{self.next_seq()}"
                self.mutated += 1
            self.by_type[type(msg).__name__] += 1
            self._send(frames)
        self._drain()

    def _send(self, frames: list[bytes]) -> None:
        deadline = time.monotonic() + SEND_WAIT_S
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                self.frames_sent += 1
                return
            except zmq.Again:
                self.blocked += 1
                self._drain()
                if time.monotonic() >= deadline:
                    self.abandoned += 1
                    return
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
                self.replies[code_name(msg.code)] += 1
            else:
                self.replies[type(msg).__name__] += 1


# ---- what the attacker sends: one template's messages at a time -------------------------------


def _join(a: Attacker, open_round: int) -> list[Message]:
    return [
        Join(site_id=ATTACKER, model_fingerprint=FINGERPRINT, global_version=0, state_hash=a.digest)
    ]


def _heartbeat(a: Attacker, open_round: int) -> list[Message]:
    return [Heartbeat(site_id=ATTACKER, global_version=open_round, sent_at=time.monotonic())]


def _update(a: Attacker, open_round: int) -> list[Message]:
    return [a.update(open_round)]


def _eval(a: Attacker, open_round: int) -> list[Message]:
    return [Eval(site_id=ATTACKER, global_version=open_round, val_loss=1.0, metrics={"acc": 0.5})]


def _sync_or_leave(a: Attacker, open_round: int) -> list[Message]:
    sync = SyncRequest(site_id=ATTACKER, global_version=0)
    return [a.rng.choice((sync, Leave(site_id=ATTACKER, reason="fuzz")))]


def _initial_model(a: Attacker, open_round: int) -> list[Message]:
    payload = encode_tensors(a.params, get_codec("fp32"))
    return [InitParams(site_id=ATTACKER, model_fingerprint=FINGERPRINT, payload=payload)]


def _chunked(a: Attacker, open_round: int) -> list[Message]:
    """An update cut into chunks, as a channel sends a large message."""
    frames = to_wire(a.update(open_round), session=a.session, seq=a.next_seq())
    return list(split_frames(frames, 2048))


def _ack(a: Attacker, open_round: int) -> list[Message]:
    return [ChunkAck(transfer_id=os.urandom(8).hex(), next_index=1, credit_bytes=4096)]


def _claims(a: Attacker, open_round: int) -> list[Message]:
    """Messages as site ``eu``, which ``fz``'s certificate does not name."""
    join = Join(site_id="eu", model_fingerprint=FINGERPRINT, global_version=0, state_hash=a.digest)
    return [replace(a.update(open_round), site_id="eu"), join]


def _for_sites(a: Attacker, open_round: int) -> list[Message]:
    """What only a coordinator sends."""
    welcome = Welcome(
        site_id=ATTACKER, session_id="x", global_version=0, heartbeat_interval_s=1.0, need_init=True
    )
    result = Global(
        round_id=open_round,
        base_version=0,
        global_version=open_round,
        fragment=0,
        merged=(ATTACKER,),
        is_full=True,
        state_hash=a.digest,
        signature=b"",
        evaluate=False,
        payload=a.update(open_round).payload,
    )
    return [a.rng.choice((welcome, result))]


TEMPLATES = (
    _join,
    _heartbeat,
    _update,
    _eval,
    _sync_or_leave,
    _initial_model,
    _chunked,
    _chunked,
    _ack,
    _claims,
    _for_sites,
)
