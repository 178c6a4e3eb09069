"""Messages from sites into the coordinator: joins, the initial model, updates, evaluations.

Each function takes the running :class:`~coordinator.service.Coordinator` and one message: it
validates the message, asks the lifecycle whether it may be accepted, and records it (decoded
tensors stay here; the lifecycle keeps only who sent what). A refusal is an Error to the sender
and a counter, never a change of state.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from comm.security.common import AuthError
from comm.security.masking import WEIGHT_KEY, Peer
from comm.wire.frames import WireError
from comm.wire.schema import (
    ErrorCode,
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
from comm.wire.tensors import decode_tensors
from coordinator import delivery, redelivery
from coordinator.aggregate import RunningSum
from coordinator.decisions import (
    Refusal,
)
from coordinator.membership import Member
from coordinator.model_spec import first_difference, spec_from_capabilities, spec_from_params
from coordinator.rounds import OpenRound
from coordinator.scheduler import SiteView
from coordinator.strategy import Arrays, global_norm

if TYPE_CHECKING:
    from coordinator.service import Coordinator

log = logging.getLogger("crossdc.coordinator")


@dataclass(frozen=True)
class Accepted:
    """An update taken in, as the round's summary needs it (its tensors went into the round's
    running sum)."""

    site_id: str
    round_id: int
    weight: float
    train_loss: float
    compute_seconds: float
    nbytes: int


def on_join(c: Coordinator, peer: bytes, msg: Join) -> None:
    if not authentic(c, peer, msg.site_id):
        return
    fingerprint = c.state.model_fingerprint if c.state else c._init_fingerprint
    declared = spec_from_capabilities(msg.capabilities)
    if fingerprint is not None and msg.model_fingerprint != fingerprint:
        known = c._model_spec or (spec_from_params(c.state.params) if c.state else None)
        why = f": {first_difference(declared, known)}" if declared and known else ""
        c._reject(
            peer,
            ErrorCode.MODEL_MISMATCH,
            f"site model {msg.model_fingerprint} != federation model {fingerprint}{why}",
            msg.site_id,
        )
        return
    if c._model_spec is None and declared is not None:
        c._model_spec = declared
    now = c.clock()
    old = c.book.members.get(msg.site_id)
    if old is not None and old.peer != peer:
        assert c.chan is not None
        c.chan.forget(old.peer)
    in_sync = (
        c.state is not None
        and msg.global_version == c.state.global_version
        and msg.state_hash == c._hash()
    )
    record_secagg_peer(c, peer, msg)
    c.book.join(now, msg.site_id, peer, in_sync_version=msg.global_version if in_sync else None)
    c._undelivered.discard(msg.site_id)  # a join is answered with what it needs
    c._missed_result.discard(msg.site_id)
    c._claims[msg.site_id] = (msg.global_version, msg.state_hash)
    c.metrics.joins.inc()
    c.metrics.members.set(len(c.book.members))
    need_init = False
    if c.state is None and (c._init_site is None or c._init_site not in c.book.members):
        c._init_site, c._init_fingerprint = msg.site_id, msg.model_fingerprint
        need_init = True
    log.info(
        "[coordinator site=%s] joined version=%d in_sync=%s need_init=%s",
        msg.site_id,
        msg.global_version,
        in_sync,
        need_init,
    )
    c._send(
        peer,
        Welcome(
            site_id=msg.site_id,
            session_id=c.session_id,
            global_version=c.state.global_version if c.state else -1,
            heartbeat_interval_s=c.cfg.channel.heartbeat_interval_s,
            need_init=need_init,
        ),
    )
    if c.state is not None and not in_sync:
        delivery.send_catch_up(c, msg.site_id, msg.global_version, msg.state_hash)


def record_secagg_peer(c: Coordinator, peer: bytes, msg: Join) -> None:
    """A joining site's masking keys: its session key, and its certified CURVE key."""
    announced = msg.capabilities.get("secagg_session_public")
    if c.cfg.secure_aggregation is None or not isinstance(announced, str):
        c._secagg_peers.pop(msg.site_id, None)
        return
    static = None
    if c.registry is not None and c.chan is not None:
        identity = c.chan.identities.get(peer)
        cert = c.registry.certificate(identity.serial) if identity else None
        static = cert.curve_public if cert is not None else None
    try:
        c._secagg_peers[msg.site_id] = Peer(
            session_public=bytes.fromhex(announced), static_public=static
        )
    except ValueError:
        c._secagg_peers.pop(msg.site_id, None)


def on_init(c: Coordinator, peer: bytes, msg: InitParams) -> None:
    if c.state is not None or msg.site_id != c._init_site:
        c._reject(peer, ErrorCode.UNEXPECTED, "initial parameters not requested", msg.site_id)
        return
    try:
        params = decode_tensors(msg.payload)
    except WireError as exc:
        c._reject(peer, exc.code, exc.detail, msg.site_id)
        return
    c.install_initial(params, msg.model_fingerprint)
    c.book.holds(msg.site_id, 0, in_sync=True)
    digest = c._hash()
    for site_id, other in sorted(c.book.members.items()):
        if other.in_sync:
            continue
        if c._claims.get(site_id) == (0, digest):
            # It built the same θ0 from the federation's seed and proved it by hash at its
            # join: nothing to download.
            c.book.holds(site_id, 0, in_sync=True)
        else:
            delivery.send_full(c, site_id)
    c._publish_status()


def on_update(c: Coordinator, peer: bytes, msg: Update) -> None:
    assert c.state is not None
    c._views[msg.site_id] = SiteView(
        msg.site_id, msg.step_seconds, msg.link_rtt_s, msg.link_goodput_bps
    )
    verdict = c.book.check_update(msg.site_id, msg.round_id, msg.fragment, msg.global_version)
    if isinstance(verdict, Refusal):
        c._reject(peer, verdict.code, verdict.detail, msg.site_id)
        return
    if not (np.isfinite(msg.weight) and msg.weight > 0 and np.isfinite(msg.train_loss)):
        c._reject(peer, ErrorCode.NON_FINITE, f"weight {msg.weight}", msg.site_id)
        return
    names = c._fragment_names[verdict.fragment]
    if c.cfg.secure_aggregation is not None:
        r = c.book.open_round(msg.round_id)
        assert r is not None  # a masked update is never admitted late
        on_masked_update(c, peer, msg, r, names)
        return
    decoded = decode_update(c, peer, msg, names)
    if decoded is not None:
        record_update(c, msg, decoded[0], decoded[1], late=verdict.late, fragment=verdict.fragment)


def decode_update(
    c: Coordinator, peer: bytes, msg: Update, names: list[str]
) -> tuple[Arrays, float] | None:
    """The update's tensors and their norm; None (and an Error to the site) when they do not
    decode into the fragment's shapes or exceed the norm bound."""
    assert c.state is not None
    try:
        delta = decode_tensors(msg.payload, {n: c.state.params[n].shape for n in names})
    except WireError as exc:
        c._reject(peer, exc.code, exc.detail, msg.site_id)
        return None
    norm = global_norm(delta)
    if norm > c.cfg.max_update_norm:
        detail = f"update norm {norm:.3g} > bound {c.cfg.max_update_norm:.3g}"
        c._reject(peer, ErrorCode.BAD_PAYLOAD, detail, msg.site_id)
        return None
    return delta, norm


def record_update(
    c: Coordinator, msg: Update, delta: Arrays, norm: float, *, late: bool, fragment: int
) -> None:
    """A validated update: counted, told to the lifecycle, kept until its round (or, late, its
    fragment's next sync) closes."""
    nbytes = sum(enc.nbytes for enc in msg.payload)
    raw = sum(4 * int(np.prod(enc.shape)) for enc in msg.payload)
    acc = Accepted(
        msg.site_id, msg.round_id, msg.weight, msg.train_loss, msg.compute_seconds, nbytes
    )
    c.metrics.updates_accepted.labels(site=msg.site_id).inc()
    c.metrics.update_size.observe(nbytes)
    c.metrics.payload_bytes.labels(direction="in").inc(nbytes)
    c.metrics.payload_raw_bytes.labels(direction="in").inc(raw)
    now = c.clock()
    c.book.accept(now, msg.site_id, msg.round_id)
    # Folded in at once: the coordinator never keeps a site's update (memory O(model)). Late
    # updates of one round share their staleness weight, so they share one sum too.
    sums = c._late_sums if late else c._sums
    sums.setdefault(msg.round_id, RunningSum()).add(msg.weight, delta)
    if late:
        c._late[(msg.site_id, msg.round_id)] = acc
        c.metrics.late_updates.inc()
        log.info(
            "[coordinator site=%s round=%d] late update kept for the next sync of fragment %d",
            msg.site_id,
            msg.round_id,
            fragment,
        )
        return
    c._accepted.setdefault(msg.round_id, {})[msg.site_id] = acc
    c._arrived.setdefault(msg.round_id, {})[msg.site_id] = now
    log.info(
        "[coordinator site=%s round=%d] update accepted weight=%.0f loss=%.4f norm=%.4g",
        msg.site_id,
        msg.round_id,
        msg.weight,
        msg.train_loss,
        norm,
    )


def on_masked_update(
    c: Coordinator, peer: bytes, msg: Update, r: OpenRound, names: list[str]
) -> None:
    """A masked update: checked for shape and attempt only (its values are hidden)."""
    assert c.state is not None and c.cfg.secure_aggregation is not None
    plan = c._masking[r.round_id]
    expected = {n: tuple(c.state.params[n].shape) for n in names}
    expected[WEIGHT_KEY] = (1,)
    dtype = c.cfg.secure_aggregation.dtype
    got = {enc.name: enc for enc in msg.payload}
    problem = ""
    if set(got) != set(expected):
        problem = f"masked tensors {sorted(got)[:3]}... do not match the fragment"
    elif any(e.meta.get("attempt") != plan.attempt or e.codec != "secagg" for e in got.values()):
        problem = f"not masked for attempt {plan.attempt}"
    elif msg.site_id not in plan.participants:
        problem = f"not in the masking set of attempt {plan.attempt}"
    else:
        for name, enc in got.items():
            if len(enc.buffers) != 1 or enc.buffers[0].dtype != dtype:
                problem = f"{name!r} is not one {dtype} buffer"
            elif tuple(enc.shape) != expected[name] or enc.buffers[0].size != int(
                np.prod(expected[name])
            ):
                problem = f"{name!r} has shape {enc.shape}, expected {expected[name]}"
            if problem:
                break
    if problem:
        c._reject(peer, ErrorCode.BAD_PAYLOAD, problem, msg.site_id)
        return
    c._masked.setdefault(r.round_id, {})[msg.site_id] = {
        name: np.asarray(enc.buffers[0]).reshape(expected[name]) for name, enc in got.items()
    }
    c._accepted.setdefault(r.round_id, {})[msg.site_id] = Accepted(
        msg.site_id,
        r.round_id,
        msg.weight,
        msg.train_loss,
        msg.compute_seconds,
        sum(enc.nbytes for enc in msg.payload),
    )
    c.book.accept(c.clock(), msg.site_id, r.round_id)
    c.metrics.updates_accepted.labels(site=msg.site_id).inc()
    log.info(
        "[coordinator site=%s round=%d] masked update accepted (attempt %d)",
        msg.site_id,
        r.round_id,
        plan.attempt,
    )


def on_eval(c: Coordinator, msg: Eval) -> None:
    if c.state is None:
        c.metrics.rejected.labels(reason="unexpected").inc()
        return
    if not np.isfinite(msg.val_loss):
        c.metrics.rejected.labels(reason="non_finite").inc()
        return
    metrics = eval_metrics(msg.metrics)
    if metrics is None:
        c.metrics.rejected.labels(reason="malformed").inc()
        log.warning("[coordinator site=%s] Eval with bad metrics ignored", msg.site_id)
        return
    if msg.global_version in c.state.val_losses:
        return
    val_losses = {**c.state.val_losses, msg.global_version: msg.val_loss}
    val_metrics = dict(c.state.val_metrics)
    if metrics:
        val_metrics[msg.global_version] = metrics
    c.state = replace(c.state, val_losses=val_losses, val_metrics=val_metrics)
    c._persist(c.state, counter_only=True)
    if msg.global_version == c.state.global_version:
        c.metrics.val_loss.set(msg.val_loss)
    log.info(
        "[coordinator site=%s] val_loss=%.4f at v%d",
        msg.site_id,
        msg.val_loss,
        msg.global_version,
    )
    c._publish_status()


MAX_EVAL_METRICS = 32


def eval_metrics(raw: Mapping[str, Any]) -> dict[str, float] | None:
    """A site's other validation metrics, or None when they are not a few finite numbers with
    names of letters, digits and '_'."""
    if len(raw) > MAX_EVAL_METRICS:
        return None
    out: dict[str, float] = {}
    for name, value in raw.items():
        if not (0 < len(name) <= 64 and name.replace("_", "").isalnum()) or name == "loss":
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if not math.isfinite(value):
            return None
        out[name] = float(value)
    return out


def handle(c: Coordinator, peer: bytes, msg: Message) -> None:
    assert c.chan is not None
    c.metrics.wire_bytes.labels(direction="in").inc(0)  # label exists from the start
    if isinstance(msg, Join):
        on_join(c, peer, msg)
    elif isinstance(msg, Heartbeat):
        if member_for(c, peer, msg.site_id) is not None:
            c._send(peer, msg)  # echoed: the site measures its round trip
    elif isinstance(msg, InitParams):
        if member_for(c, peer, msg.site_id) is not None:
            on_init(c, peer, msg)
    elif isinstance(msg, Update):
        if member_for(c, peer, msg.site_id) is not None:
            on_update(c, peer, msg)
    elif isinstance(msg, Eval):
        if member_for(c, peer, msg.site_id) is not None:
            on_eval(c, msg)
    elif isinstance(msg, SyncRequest):
        if member_for(c, peer, msg.site_id) is not None and c.state is not None:
            c.book.holds(msg.site_id, -1, in_sync=False)
            delivery.send_full(c, msg.site_id)
    elif isinstance(msg, Leave):
        if member_for(c, peer, msg.site_id) is not None:
            log.info("[coordinator site=%s] left: %s", msg.site_id, msg.reason)
            c._remove(msg.site_id)
    else:
        c._reject(peer, ErrorCode.UNEXPECTED, f"{type(msg).__name__} is not for me")


def authentic(c: Coordinator, peer: bytes, site_id: str) -> bool:
    """CURVE mode: the connection's certificate must be valid now and name ``site_id``."""
    if c.registry is None:
        return True
    assert c.chan is not None
    identity = c.chan.identities.get(peer)
    try:
        if identity is None:
            raise AuthError("unknown_key", "no certified identity on this connection")
        c.registry.check_peer(
            user_id=identity.site_id,
            serial=identity.serial,
            claimed_site_id=site_id,
            now=time.time(),
        )
    except AuthError as exc:
        c._reject(peer, ErrorCode.UNAUTHENTICATED, exc.detail, site_id, reason=exc.reason)
        return False
    return True


def member_for(c: Coordinator, peer: bytes, site_id: str) -> Member | None:
    if not authentic(c, peer, site_id):
        return None
    now, before = c.clock(), c.book.members.get(site_id)
    m = c.book.touch(now, site_id, peer)
    if m is None:
        c._reject(peer, ErrorCode.NOT_JOINED, f"site {site_id!r} must join", site_id)
    elif before is not None:
        redelivery.heard_from(c, m, now - before.last_seen)
    return m
