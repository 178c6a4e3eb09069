"""The attacks of ``crossdc bench hostile``: one certified site per class of attack.

Each attack runs in a thread of its own with its own ZeroMQ context, as a site whose
certificate the federation's CA issued (``comm.security.kits.issue_site``), so the coordinator
charges each one to its own account. An attack returns one :class:`Outcome` per thing it tried,
and ``refused`` is what it measured: an Error the coordinator sent back, a refusal the
coordinator logged naming the attacker's routing id (``rejected message from b'<site>/...'``,
``[coordinator site=<site>] rejected``, ``[site=<site>] cut off``), its connection cut, or a
transfer of its dropped (its acknowledgement going back). Nothing is counted refused on the
strength of what the code is meant to do.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
import zstandard

from comm.codecs.registry import get_codec
from comm.security.kits import revoke_site
from comm.transport.profile import ChannelConfig
from comm.wire.chunking import chunk_digest
from comm.wire.schema import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Chunk,
    ChunkAck,
    Eval,
    Heartbeat,
    InitParams,
    Join,
    Leave,
    Message,
    SyncRequest,
    Update,
    Welcome,
)
from comm.wire.tensors import encode_tensors
from crossdc.bench.hostile_peer import HostilePeer

REPLY_WAIT_S = 10.0
"""How long an attack waits for the coordinator's answer to one message."""
ZERO_KEY = "00" * 32
"""An all-zero X25519 session key: every honest site's key exchange with it fails."""
TRICKLE_EVERY_S = 2.0
"""The trickle attack sends one chunk this often."""


@dataclass
class Outcome:
    """What one attack measured."""

    name: str
    finding: int
    """The class of attack, numbered as in docs/security.md section 9 (0: a connection that
    never joins)."""
    site_id: str
    refused: bool = False
    cause: str = ""
    """The coordinator's reason: its Error reply, its log line, or what was seen."""
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "finding": self.finding,
            "site_id": self.site_id,
            "refused": self.refused,
            "cause": self.cause,
            **self.evidence,
        }


@dataclass
class AttackEnv:
    """What every attack needs: where, with which keys, for how long, and what it may read."""

    endpoint: str
    workdir: Path
    """Holds ``kit/`` (the federation's kit: revocation) and each site's ``kit-<site>``."""
    coordinator_log: Path
    fingerprint: str
    secure_aggregation: bool
    open_round: Callable[[], int]
    """The round the coordinator has open now (its status), or 0."""
    deadline: float
    """``time.monotonic()`` by which every attack ends."""
    peak_rss: Callable[[], int] = lambda: 0
    """The coordinator's peak resident bytes so far (``VmHWM``)."""

    def peer(self, site_id: str, suffix: str | None = None, **kw: Any) -> HostilePeer:
        return HostilePeer(
            self.endpoint, self.workdir / f"kit-{site_id}", site_id, routing_suffix=suffix, **kw
        )

    def refusals(self, routing_prefix: str) -> list[str]:
        """The coordinator's log lines that refuse or cut off what ``routing_prefix`` (a site
        id, or ``site/suffix``) sent, in order, each from its reason on."""
        try:
            text = self.coordinator_log.read_text(errors="replace")
        except OSError:
            return []
        site = routing_prefix.split("/", 1)[0]
        pats = [
            re.compile(rf"rejected message from b'{re.escape(routing_prefix)}[^']*': (.*)$"),
            re.compile(rf"\[coordinator site={re.escape(site)}\] rejected: (.*)$"),
            re.compile(rf"\[site={re.escape(site)}\] (cut off .*)$"),
            re.compile(rf"peer b'{re.escape(routing_prefix)}[^']*': ((?:dropped|gave up) .*)$"),
            re.compile(rf"peer=b'{re.escape(routing_prefix)}[^']*'\] (.*)$"),
        ]
        out = []
        for line in text.splitlines():
            for pat in pats:
                m = pat.search(line)
                if m:
                    out.append(m.group(1).strip())
                    break
        return out


# --------------------------------------------------------------------------------------------
# Helpers


def _wait_for(peer: HostilePeer, cond: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        peer.poll(0.05)
        if cond():
            return True
    return cond()


def _error_after(peer: HostilePeer, msg: Message, timeout_s: float = REPLY_WAIT_S) -> str | None:
    """Send ``msg`` and wait for the Error it draws: ``"code: detail"``, or None."""
    before = len(peer.replies.errors)
    peer.send(msg)
    if not _wait_for(peer, lambda: len(peer.replies.errors) > before, timeout_s):
        return None
    code, detail = peer.replies.errors[before]
    return f"{code}: {detail}"


def _join(env: AttackEnv, peer: HostilePeer, session_key: str | None = None) -> Join:
    """A join that proves no model (``global_version=-1``): the site is a member, not in sync,
    so no round plans it in."""
    caps: dict[str, Any] = {}
    if env.secure_aggregation:
        caps["secagg_session_public"] = session_key or _x25519_public().hex()
    return Join(
        site_id=peer.site_id,
        model_fingerprint=env.fingerprint,
        global_version=-1,
        state_hash="",
        capabilities=caps,
    )


def _x25519_public() -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _become_member(env: AttackEnv, peer: HostilePeer) -> bool:
    peer.send(_join(env, peer))
    return _wait_for(peer, lambda: peer.replies.by_type["Welcome"] > 0, REPLY_WAIT_S)


def _update(site_id: str, round_id: int, nbytes: int = 4096, **figures: float) -> Update:
    delta = {"w": np.zeros(max(1, nbytes // 4), np.float32)}
    fields: dict[str, float] = {
        "weight": 1.0,
        "train_loss": 1.0,
        "compute_seconds": 0.1,
        "step_seconds": 0.1,
        "link_rtt_s": 0.05,
        "link_goodput_bps": 1e8,
        **figures,
    }
    return Update(
        site_id=site_id,
        round_id=round_id,
        global_version=max(0, round_id - 1),
        fragment=0,
        payload=encode_tensors(delta, get_codec("fp32")),
        **fields,
    )


def _chunk(transfer_id: str, index: int, total: int, stride: int) -> Chunk:
    """Chunk ``index`` of a transfer of ``total`` bytes cut every ``stride`` bytes."""
    size = min(stride, total - index * stride)
    data = os.urandom(size)
    return Chunk(
        transfer_id=transfer_id,
        index=index,
        num_chunks=-(-total // stride),
        offset=index * stride,
        total_bytes=total,
        digest=chunk_digest(data),
        data=data,
    )


def _logged(env: AttackEnv, prefix: str, since: int = 0) -> list[str]:
    return env.refusals(prefix)[since:]


def rounds_planned_in(env: AttackEnv, site_id: str) -> int:
    """Rounds the coordinator opened with ``site_id`` among their participants (its log)."""
    try:
        text = env.coordinator_log.read_text(errors="replace")
    except OSError:
        return 0
    return sum(1 for ln in text.splitlines() if "] open: " in ln and f" {site_id}: " in ln)


def _settle(peer: HostilePeer, seconds: float = 2.0) -> None:
    """Read replies for a while (refusals are logged as the coordinator reads)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        peer.poll(0.1)


# --------------------------------------------------------------------------------------------
# 1. Reassembly


def reassembly(env: AttackEnv) -> list[Outcome]:
    """A trickled transfer (opened first, kept alive one chunk at a time), a first chunk
    claiming 4 GiB, then 8 routing ids of the same site opening 16 transfers each."""
    site = "hx-reasm"
    trickle = env.peer(site, "trickle")
    claim = env.peer(site, "claim")
    rids = [env.peer(site, f"rid{i}") for i in range(8)]
    try:
        total, stride = 32 << 10, 64
        tid = "trickle-" + os.urandom(4).hex()
        trickle.send(_chunk(tid, 0, total, stride))
        sent_index, next_at, started = 0, time.monotonic() + TRICKLE_EVERY_S, time.monotonic()

        big_tid = "claim-" + os.urandom(4).hex()
        claim.send(_chunk(big_tid, 0, 4 << 30, 4096))
        _settle(claim, 2.0)
        claim_acks = [a for a in claim.replies.chunk_acks if a.transfer_id == big_tid]
        claim_log = _logged(env, f"{site}/claim")
        out = [
            Outcome(
                "reassembly_claim_4gib",
                1,
                site,
                refused=not claim_acks and bool(claim_log),
                cause=claim_log[0] if claim_log else "no refusal logged",
                evidence={"claimed_bytes": 4 << 30, "acks": len(claim_acks)},
            )
        ]

        each_total, each_stride = 8 << 10, 1 << 10
        for peer in rids:
            for _ in range(16):
                peer.send(_chunk("rid-" + os.urandom(4).hex(), 0, each_total, each_stride))
        for peer in rids:
            _settle(peer, 0.3)
        _settle(rids[-1], 1.5)
        opened = sum(len({a.transfer_id for a in p.replies.chunk_acks}) for p in rids)
        rid_log = _logged(env, f"{site}/rid")
        out.append(
            Outcome(
                "reassembly_routing_ids",
                1,
                site,
                refused=opened < 128 and bool(rid_log),
                cause=rid_log[0] if rid_log else "no refusal logged",
                evidence={
                    "transfers_sent": 128,
                    "transfers_opened": opened,
                    "claimed_bytes_opened": opened * (each_total + each_total // each_stride),
                    "refusals_logged": len(rid_log),
                },
            )
        )

        # The trickle: one 64-byte chunk every TRICKLE_EVERY_S until the deadline, or until
        # an acknowledgement says the coordinator no longer holds what came before.
        dropped_after: float | None = None
        while time.monotonic() < env.deadline - 1.0 and dropped_after is None:
            trickle.poll(0.1)
            acks = [a for a in trickle.replies.chunk_acks if a.transfer_id == tid]
            if acks and acks[-1].next_index < sent_index + 1:
                dropped_after = time.monotonic() - started
            elif time.monotonic() >= next_at and sent_index + 1 < total // stride:
                sent_index += 1
                trickle.send(_chunk(tid, sent_index, total, stride))
                next_at += TRICKLE_EVERY_S
        trickle_log = _logged(env, f"{site}/trickle")
        elapsed = time.monotonic() - started
        if dropped_after is not None:
            cause = (
                f"the coordinator dropped the trickled transfer after {dropped_after:.0f} s "
                f"(its acknowledgement went back to chunk {acks[-1].next_index})"
            )
        elif trickle_log:
            cause = trickle_log[0]
        else:
            cause = f"still held after {elapsed:.0f} s of one {stride}-byte chunk per {TRICKLE_EVERY_S:.0f} s"
        out.append(
            Outcome(
                "reassembly_trickle",
                1,
                site,
                refused=dropped_after is not None or bool(trickle_log),
                cause=cause,
                evidence={"chunks_sent": sent_index + 1, "seconds": round(elapsed, 1)},
            )
        )
        return out
    finally:
        for peer in (trickle, claim, *rids):
            peer.close()


# --------------------------------------------------------------------------------------------
# 2. Decompression bombs


def _index_bomb(peer: HostilePeer, objects: int) -> list[bytes]:
    """An Update whose compressed payload index expands to a list of ``objects`` nils."""
    packed = b"\xdd" + objects.to_bytes(4, "big") + b"\xc0" * objects
    index = zstandard.ZstdCompressor(level=19).compress(packed)
    update = _update(peer.site_id, 1)
    fields = {f.name: getattr(update, f.name) for f in dataclasses.fields(update)}
    del fields["payload"]
    head = {
        "v": PROTOCOL_VERSION,
        "t": int(MESSAGE_TYPES[Update]),
        "s": peer.session,
        "q": peer.next_seq(),
        "f": fields,
        "p": index,
    }
    return [msgpack.packb(head, use_bin_type=True)]


def _more_errors(peer: HostilePeer, before: int) -> Callable[[], bool]:
    return lambda: len(peer.replies.errors) > before


def _header_bomb(peer: HostilePeer, objects: int) -> list[bytes]:
    """A Heartbeat whose header holds a list of ``objects`` empty lists (a byte each)."""
    head = {
        "v": PROTOCOL_VERSION,
        "t": int(MESSAGE_TYPES[Heartbeat]),
        "s": peer.session,
        "q": peer.next_seq(),
        "f": {"site_id": peer.site_id, "global_version": 0, "sent_at": 0.0},
        "p": [[] for _ in range(objects)],
    }
    return [msgpack.packb(head, use_bin_type=True)]


def decompression_bomb(env: AttackEnv) -> list[Outcome]:
    """A compressed payload index of 16M objects, a header of 300k (as many one-byte objects
    as a frame within ``MAXMSGSIZE`` holds): each followed by a
    heartbeat, whose refusal (``not_joined``) times how long the coordinator took to get past
    the bomb."""
    site = "hx-bomb"
    peer = env.peer(site)
    out = []
    try:
        for name, frames, objects in (
            ("decompression_bomb_index", _index_bomb(peer, (16 << 20) - 8), (16 << 20) - 8),
            ("decompression_bomb_header", _header_bomb(peer, 300_000), 300_000),
        ):
            before_log = len(_logged(env, site))
            before_err = len(peer.replies.errors)
            t0 = time.monotonic()
            peer.send_frames(frames)
            peer.heartbeat()
            answered = _wait_for(peer, _more_errors(peer, before_err), 30.0)
            reply_s = time.monotonic() - t0
            _settle(peer, 0.5)
            logged = _logged(env, site, before_log)
            bomb_log = [line for line in logged if "not_joined" not in line]
            out.append(
                Outcome(
                    name,
                    2,
                    site,
                    refused=bool(bomb_log),
                    cause=bomb_log[0] if bomb_log else "no refusal logged",
                    evidence={
                        "message_bytes": sum(len(f) for f in frames),
                        "objects_promised": objects,
                        "next_reply_after_s": round(reply_s, 3) if answered else None,
                    },
                )
            )
        return out
    finally:
        peer.close()


# --------------------------------------------------------------------------------------------
# 3. Crash: site-reported figures, a round not open


def crash(env: AttackEnv) -> list[Outcome]:
    """A member's updates reporting ``link_rtt_s = inf``, ``step_seconds = 5e-324`` and one
    for a round that is not open; each must draw an Error, and rounds must go on closing."""
    site = "hx-crash"
    peer = env.peer(site)
    out = []
    try:
        if not _become_member(env, peer):
            why = peer.replies.errors[0] if peer.replies.errors else ("", "no Welcome")
            return [Outcome("crash_join", 3, site, cause=f"could not join: {why}")]
        open_round = env.open_round() or 1
        for name, msg in (
            ("crash_rtt_inf", _update(site, open_round, link_rtt_s=math.inf)),
            ("crash_step_5e-324", _update(site, env.open_round() or 1, step_seconds=5e-324)),
            ("crash_round_not_open", _update(site, (env.open_round() or 1) + 100_000)),
        ):
            error = _error_after(peer, msg)
            out.append(
                Outcome(
                    name,
                    3,
                    site,
                    refused=error is not None,
                    cause=error or f"no Error within {REPLY_WAIT_S:.0f} s",
                )
            )
            peer.heartbeat()
        peer.send(Leave(site_id=site, reason="bench hostile: done"))
        _settle(peer, 1.0)
        return out
    finally:
        peer.close()


# --------------------------------------------------------------------------------------------
# 4. Secure aggregation: an all-zero session key


def secagg_zero_key(env: AttackEnv) -> list[Outcome]:
    site = "hx-secagg"
    if not env.secure_aggregation:
        return [
            Outcome(
                "secagg_zero_key",
                4,
                site,
                cause="not applicable: the federation runs without secure aggregation",
            )
        ]
    peer = env.peer(site)
    try:
        error = _error_after(peer, _join(env, peer, session_key=ZERO_KEY))
        welcomed = peer.replies.by_type["Welcome"] > 0
        return [
            Outcome(
                "secagg_zero_key",
                4,
                site,
                refused=error is not None and not welcomed,
                cause=error or f"no Error within {REPLY_WAIT_S:.0f} s (welcomed: {welcomed})",
            )
        ]
    finally:
        peer.close()


# --------------------------------------------------------------------------------------------
# 5. Held behind a gap


def held_behind_gap(env: AttackEnv) -> list[Outcome]:
    """64 numbered updates of 200 KiB from a connection that never joined, number 1 missing:
    12.5 MiB the coordinator would hold behind the gap."""
    site = "hx-gap"
    peer = env.peer(site)
    try:
        count, nbytes = 64, 200 << 10
        for number in range(2, 2 + count):
            peer.send(_update(site, 1, nbytes), delivery=(number, 0))
        _settle(peer, 3.0)
        logged = _logged(env, site)
        refused = [line for line in logged if "not_joined" not in line]
        return [
            Outcome(
                "held_behind_gap",
                5,
                site,
                refused=bool(refused),
                cause=refused[0] if refused else "no refusal logged",
                evidence={
                    "messages_sent": count,
                    "bytes_sent": count * nbytes,
                    "refusals_logged": len(refused),
                },
            )
        ]
    finally:
        peer.close()


# --------------------------------------------------------------------------------------------
# 6. Message size


def message_size(env: AttackEnv) -> list[Outcome]:
    """One message of 256 frames of 1 MiB each (each frame over ``MAXMSGSIZE``, the
    whole-message bound: libzmq must drop the connection), then one of as many frames of the
    largest size libzmq lets through, 256 x about ``max_message_bytes`` (libzmq holds it whole until
    its last frame; the coordinator must refuse it by name)."""
    site = "hx-size"
    outcomes: list[Outcome] = []
    bound = ChannelConfig().max_message_bytes
    # Under CURVE a frame travels with its box's overhead: 4 KiB under the bound passes.
    largest = bound - 4096
    for name, frame_bytes in (("message_256_frames", 1 << 20), ("message_256_frames_max", largest)):
        peer = env.peer(site)
        try:
            frame = b"\0" * frame_bytes
            head = peer.frames(_update(site, 1, 64))[0]
            before = env.peak_rss()
            since = len(_logged(env, site))
            peer.send_frames([head, *([frame] * 255)])
            _settle(peer, 5.0)
            growth = env.peak_rss() - before
            logged = _logged(env, site)[since:]
            dropped = peer.replies.first_disconnect_at is not None
            if logged:
                cause = logged[0]
            elif dropped:
                cause = (
                    f"connection dropped by libzmq: a frame of {frame_bytes} > MAXMSGSIZE {bound}"
                )
            else:
                cause = "no refusal logged"
            outcomes.append(
                Outcome(
                    name,
                    6,
                    site,
                    refused=bool(logged) or dropped,
                    cause=cause,
                    evidence={
                        "frames": 256,
                        "bytes_sent": 256 * frame_bytes,
                        "coordinator_peak_rss_growth_bytes": growth,
                    },
                )
            )
        finally:
            peer.close()
    return outcomes


# --------------------------------------------------------------------------------------------
# 7. Revocation


def revocation(env: AttackEnv) -> list[Outcome]:
    """A member heartbeating every 0.5 s whose certificate is revoked: its connection must be
    cut, and nothing it sends after handled (no echo)."""
    site = "hx-revoke"
    peer = env.peer(site)
    try:
        if not _become_member(env, peer):
            return [Outcome("revocation", 7, site, cause="could not join")]
        for _ in range(4):
            peer.heartbeat()
            _settle(peer, 0.5)
        echoes_before = peer.replies.by_type["Heartbeat"]
        revoked_at = time.monotonic()
        serials = revoke_site(env.workdir / "kit", site)
        echoes_after_cut = 0
        beats_after_cut = 0
        end = min(revoked_at + 20.0, env.deadline)
        while time.monotonic() < end:
            cut_seen = peer.replies.first_disconnect_at is not None
            echoes = peer.replies.by_type["Heartbeat"]
            try:
                peer.sock.send_multipart(
                    peer.frames(
                        Heartbeat(site_id=site, global_version=-1, sent_at=time.monotonic())
                    ),
                    flags=zmq.NOBLOCK,
                )
                beats_after_cut += cut_seen
            except zmq.Again:
                pass
            _settle(peer, 0.5)
            if cut_seen:
                echoes_after_cut += peer.replies.by_type["Heartbeat"] - echoes
            if cut_seen and beats_after_cut >= 6:
                break
        cut_at = peer.replies.first_disconnect_at
        logged = [line for line in _logged(env, site) if "cut off" in line or "revoked" in line]
        cut_after = None if cut_at is None else round(cut_at - revoked_at, 3)
        refused = cut_at is not None and echoes_after_cut == 0
        if cut_at is None:
            cause = f"connection not cut within {end - revoked_at:.0f} s of the revocation"
        else:
            cause = logged[0] if logged else f"connection cut after {cut_after} s"
        return [
            Outcome(
                "revocation",
                7,
                site,
                refused=refused,
                cause=cause,
                evidence={
                    "revoked_serials": serials,
                    "echoes_before": echoes_before,
                    "cut_after_s": cut_after,
                    "heartbeats_after_cut": beats_after_cut,
                    "echoes_after_cut": echoes_after_cut,
                    "handshakes_refused_after": peer.replies.auth_failures,
                },
            )
        ]
    finally:
        peer.close()


# --------------------------------------------------------------------------------------------
# 8. Send queue: zero credit


def _zero_credit(chunk: Chunk) -> ChunkAck:
    """Every chunk acknowledged as received, and no credit for the next one."""
    return ChunkAck(transfer_id=chunk.transfer_id, next_index=chunk.index + 1, credit_bytes=0)


def send_queue(env: AttackEnv) -> list[Outcome]:
    """A member that answers every chunk of what the coordinator sends it (its catch-up model)
    with zero credit, heartbeating to stay a member, until the deadline."""
    site = "hx-credit"
    peer = env.peer(site, answer_chunk=_zero_credit)
    try:
        if not _become_member(env, peer):
            return [Outcome("send_queue_zero_credit", 8, site, cause="could not join")]
        started = time.monotonic()
        while time.monotonic() < env.deadline - 1.0:
            peer.heartbeat()
            _settle(peer, 1.0)
            if peer.replies.errors or peer.replies.disconnects:
                break
        logged = _logged(env, site)
        given_up = [line for line in logged if "not_joined" not in line]
        refused = bool(given_up) or bool(peer.replies.errors) or peer.replies.disconnects > 0
        if given_up:
            cause = given_up[0]
        elif peer.replies.errors:
            cause = ": ".join(peer.replies.errors[0])
        elif peer.replies.disconnects:
            cause = "connection cut"
        else:
            cause = f"still queued for after {time.monotonic() - started:.0f} s"
        return [
            Outcome(
                "send_queue_zero_credit",
                8,
                site,
                refused=refused,
                cause=cause,
                evidence={
                    "chunks_received": peer.replies.chunks,
                    "rounds_planned_in": rounds_planned_in(env, site),
                },
            )
        ]
    finally:
        peer.close()


# --------------------------------------------------------------------------------------------
# Never joins


def _not_a_join(site: str, round_id: int) -> Iterator[Message]:
    yield Heartbeat(site_id=site, global_version=0, sent_at=1.0)
    yield _update(site, round_id)
    yield Eval(site_id=site, global_version=0, val_loss=1.0)
    yield SyncRequest(site_id=site, global_version=0)
    yield InitParams(site_id=site, model_fingerprint="x", payload=_update(site, 1).payload)
    yield Welcome(
        site_id=site, session_id="x", global_version=0, heartbeat_interval_s=1.0, need_init=False
    )
    yield Leave(site_id=site, reason="never joined")


def never_joins(env: AttackEnv) -> list[Outcome]:
    """An authenticated connection that sends one of everything but a join."""
    site = "hx-nojoin"
    peer = env.peer(site)
    try:
        answers: dict[str, str | None] = {}
        for msg in _not_a_join(site, env.open_round() or 1):
            answers[type(msg).__name__] = _error_after(peer, msg)
        handled = {k: v for k, v in peer.replies.by_type.items() if k not in ("Error",)}
        unanswered = sorted(k for k, v in answers.items() if v is None)
        codes = sorted({v.split(":", 1)[0] for v in answers.values() if v})
        return [
            Outcome(
                "never_joins",
                0,
                site,
                refused=not unanswered and not handled,
                cause="; ".join(f"{k}: {(v or '').split(':', 1)[0]}" for k, v in answers.items())
                + (f" ({next(v for v in answers.values() if v)})" if any(answers.values()) else "")
                if not unanswered
                else f"no Error for {unanswered}",
                evidence={"error_codes": codes, "other_replies": handled},
            )
        ]
    finally:
        peer.close()


ATTACKS: tuple[Callable[[AttackEnv], list[Outcome]], ...] = (
    reassembly,
    decompression_bomb,
    crash,
    secagg_zero_key,
    held_behind_gap,
    message_size,
    revocation,
    send_queue,
    never_joins,
)
ATTACKER_SITES = (
    "hx-reasm",
    "hx-bomb",
    "hx-crash",
    "hx-secagg",
    "hx-gap",
    "hx-size",
    "hx-revoke",
    "hx-credit",
    "hx-nojoin",
)
"""Each attack's certified site (issued before the coordinator starts)."""
JOINING_SITES = ("hx-crash", "hx-revoke", "hx-credit")
"""The attackers that become members; the others never join (or are refused at the join)."""


def outcome_of_failure(attack: Callable[..., Any], exc: BaseException) -> Outcome:
    """An attack that raised: reported, never counted refused."""
    return replace(
        Outcome(attack.__name__, -1, "?"), cause=f"the attack failed: {type(exc).__name__}: {exc}"
    )
