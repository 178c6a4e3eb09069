"""Closing rounds: the strategy's outer step over the round's updates (late ones down-weighted),
the new state persisted, and, once it is durable, its result announced to every member.

Functions over the running :class:`~coordinator.service.Coordinator`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.security.secagg import unmask_mean
from comm.security.signing import sign_blob
from comm.wire.schema import Global, Shutdown
from comm.wire.tensors import decode_tensors, encode_tensors, global_signed_bytes
from coordinator.decisions import (
    Close,
)
from coordinator.intake import Accepted
from coordinator.scheduler import RoundPlan
from coordinator.state import (
    GlobalState,
)
from coordinator.strategy import Arrays, OuterResult

if TYPE_CHECKING:
    from coordinator.service import Coordinator

log = logging.getLogger("crossdc.coordinator")


@dataclass(frozen=True)
class Announcement:
    """A closed round's result, waiting for its state to be durable before it is sent."""

    decision: Close
    state: GlobalState
    """The state the round produced."""
    base_version: int
    encoded: tuple[EncodedTensor, ...]
    delta: Arrays
    entry: dict[str, Any]
    result: OuterResult
    late: list[Accepted]


def measure_arrivals(
    c: Coordinator, round_id: int, merged: tuple[str, ...], plan: RoundPlan
) -> None:
    """How early each on-time update of the closed round landed before its last one."""
    arrived = c._arrived.pop(round_id, {})
    on_time = {s: arrived[s] for s in merged if s in arrived}
    if not on_time:
        return
    last = max(on_time.values())
    early = {s: last - t for s, t in on_time.items()}
    c._early_s = early
    c._early_extra = {s: plan.extra_steps.get(s, 0) for s in early}
    c._early_round = round_id


def close(c: Coordinator, now: float, decision: Close) -> None:
    """Merge the round's updates, persist the new state, and announce it once durable."""
    assert c.state is not None
    r, st = decision.round, c.state
    fresh, late, updates = gather(c, decision)
    plan = c._round_plan.pop(r.round_id)
    c._round_starts.pop(r.round_id, None)
    # Inner steps behind the model this round produces: every completed slot and this one.
    inner_steps = sum(int(h["num_inner_steps"]) for h in st.history) + plan.num_inner_steps
    # The run's last round: no round will start from what it produces. Only with one
    # fragment: with several, aborts shift which round is a fragment's last.
    final = c.cfg.outer_final_mean and c.cfg.num_fragments == 1 and decision.final
    names = c._fragment_names[r.fragment]
    result = c.strategy.outer_step(
        {k: st.params[k] + st.residual[k] for k in names},
        {k: st.momentum[k] for k in names},
        updates,
        inner_steps=inner_steps,
        final=final,
        averaged=c._model_spec.averaged if c._model_spec is not None else (),
    )
    delta = {k: result.params[k] - st.params[k] for k in names}
    encoded = encode_tensors(delta, get_codec(plan.downlink))
    decoded = decode_tensors(encoded)
    new_params, residual, momentum = dict(st.params), dict(st.residual), dict(st.momentum)
    for k in names:
        new_params[k] = st.params[k] + decoded[k]
        residual[k] = result.params[k] - new_params[k]
        momentum[k] = result.momentum[k]
    entry = history_entry(c, now, decision, plan, result, fresh, late, inner_steps)
    new_state = replace(
        st,
        params=new_params,
        momentum=momentum,
        residual=residual,
        global_version=r.round_id,
        history=(*st.history, entry),
    )
    c.state = new_state
    c._persist(new_state)  # durable before announced
    measure_arrivals(c, r.round_id, decision.merged, plan)
    done = Announcement(decision, new_state, st.global_version, encoded, delta, entry, result, late)
    c._later(lambda: announce(c, done))


def gather(
    c: Coordinator, decision: Close
) -> tuple[list[Accepted], list[Accepted], list[tuple[str, float, Arrays]]]:
    """The round's on-time and late updates, and what the strategy merges: the running mean of
    the on-time ones, and each late update once, down-weighted by how many syncs of its fragment
    it missed (late updates of one round share that weight, so they come as one mean); with
    secure aggregation, only the unmasked weighted mean (the sites' updates are never seen)."""
    r = decision.round
    accepted = c._accepted.pop(r.round_id, {})
    fresh = [accepted[s] for s in decision.merged]
    late = [c._late.pop((u.site_id, u.round_id)) for u in decision.late]
    updates: list[tuple[str, float, Arrays]] = []
    on_time = c._sums.pop(r.round_id, None)
    if on_time is not None and on_time.count:
        updates.append((f"round {r.round_id}", on_time.weight, on_time.mean()))
    for origin in sorted({u.round_id for u in late}):
        late_sum = c._late_sums.pop(origin)
        staleness = max(1, (r.round_id - origin) // c.cfg.num_fragments)
        updates.append((f"late@{origin}", late_sum.weight / (1 + staleness), late_sum.mean()))
    if c.cfg.secure_aggregation is not None:
        masked = c._masked.pop(r.round_id)
        masking = c._masking.pop(r.round_id)
        mean, total = unmask_mean(masked, masking, c.cfg.secure_aggregation)
        updates = [("secure-aggregate", total, mean)]
    return fresh, late, updates


def _bytes_by_site(updates: list[Accepted]) -> dict[str, int]:
    out: dict[str, int] = {}
    for u in updates:
        out[u.site_id] = out.get(u.site_id, 0) + u.nbytes
    return out


def history_entry(
    c: Coordinator,
    now: float,
    decision: Close,
    plan: RoundPlan,
    result: OuterResult,
    fresh: list[Accepted],
    late: list[Accepted],
    inner_steps: int,
) -> dict[str, Any]:
    """The closed round's summary, as the durable history keeps it."""
    assert c.state is not None and c.chan is not None
    r, merged = decision.round, decision.merged
    total_weight = sum(u.weight for u in fresh) or 1.0
    return {
        "round_id": r.round_id,
        "global_version": r.round_id,
        "base_version": c.state.global_version,
        "fragment": r.fragment,
        "num_fragments": c.cfg.num_fragments,
        "num_inner_steps": plan.num_inner_steps,
        "extra_steps": {s: n for s, n in plan.extra_steps.items() if s in merged},
        "inner_steps_total": inner_steps,
        "outer_rule": result.rule,
        "participants": list(r.participants),
        "merged": list(merged),
        "late_merged": [[u.site_id, u.round_id] for u in late],
        "train_loss": sum(u.weight * u.train_loss for u in fresh) / total_weight,
        "tokens": sum(u.weight for u in fresh),
        "outer_grad_norm": result.outer_grad_norm,
        "uplink_codecs": {s: plan.uplink[s] for s in merged},
        "downlink_codec": plan.downlink,
        "update_bytes": sum(u.nbytes for u in fresh + late),
        "update_bytes_by_site": _bytes_by_site(fresh + late),
        "compute_seconds_max": max((u.compute_seconds for u in fresh), default=0.0),
        "duration_s": now - r.opened_at,
        "finished_unix": time.time(),
    }


def announce(c: Coordinator, a: Announcement) -> None:
    """Send a closed round's result (its state is durable) and account for it."""
    assert c.chan is not None
    r, entry = a.decision.round, a.entry
    c.cfg.faults.point("close", r.round_id)
    out_before = c.chan.stats.bytes_sent
    in_sync = broadcast(c, a)
    # Everything on the socket since the previous round's result went out (the first round:
    # since the start), joins, control and heartbeats included: the rounds' figures add up to
    # the socket's totals.
    received, sent = c.chan.stats.bytes_received, c.chan.stats.bytes_sent
    entry["wire_bytes_in"] = received - c._bytes_mark[0]
    entry["wire_bytes_out"] = sent - c._bytes_mark[1]
    c._bytes_mark = (received, sent)
    entry["broadcast_bytes"] = sent - out_before
    payload_bytes = sum(enc.nbytes for enc in a.encoded)
    c.metrics.payload_bytes.labels(direction="out").inc(payload_bytes * len(in_sync))
    c.metrics.payload_raw_bytes.labels(direction="out").inc(
        sum(4 * v.size for v in a.delta.values()) * len(in_sync)
    )
    c.metrics.rounds.inc()
    c.metrics.round_duration.observe(entry["duration_s"])
    c.metrics.quorum_size.set(len(a.decision.merged))
    c.metrics.outer_grad_norm.set(a.result.outer_grad_norm)
    c.metrics.train_loss.set(entry["train_loss"])
    c.metrics.global_version.set(r.round_id)
    log.info(
        "[coordinator round=%d] closed: %s; merged=%s late=%d loss=%.4f outer_norm=%.4g "
        "outer=%s %.1fs",
        r.round_id,
        a.decision.why,
        a.decision.merged,
        len(a.late),
        entry["train_loss"],
        a.result.outer_grad_norm,
        a.result.rule,
        entry["duration_s"],
    )
    c._publish_status()


def broadcast(c: Coordinator, a: Announcement) -> list[str]:
    """The result to every member: the compressed delta to those holding the round's base, the
    whole model to the others; one site on time is asked to evaluate. Returns the sites that
    held the base (they got the delta)."""
    r, merged = a.decision.round, a.decision.merged
    digest = c._hash(a.state)
    in_sync = c.book.in_sync(a.base_version)
    wants_eval = r.round_id % c.cfg.eval_every_rounds == 0 or a.decision.final
    # Ask a site that was on time: evaluating costs the evaluator some compute.
    candidates = [s for s in in_sync if s in merged] or in_sync
    evaluator = candidates[0] if candidates and wants_eval else None
    merged_all = tuple(merged) + tuple(f"{u.site_id}@{u.round_id}" for u in a.late)
    delta = Global(
        round_id=r.round_id,
        base_version=a.base_version,
        global_version=r.round_id,
        fragment=r.fragment,
        merged=merged_all,
        is_full=False,
        state_hash=digest,
        signature=sign(c, r.round_id, a.base_version, r.fragment, digest),
        evaluate=False,
        payload=a.encoded,
    )
    c.deltas.record(delta)  # for sites that rejoin behind
    for site_id, m in sorted(c.book.members.items()):
        if site_id in in_sync:
            msg = replace(delta, evaluate=site_id == evaluator)
        else:
            msg = full_global(c, a.state, r.round_id, wants_eval and evaluator is None)
        ok = c._send(m.peer, msg)
        # A failed send leaves the site on what it held: it is sent what it missed once it is
        # heard from again (``redelivery``).
        c.book.holds(site_id, r.round_id if ok else m.global_version, in_sync=ok)
        if not ok:
            c._missed_result.add(site_id)
    return in_sync


def maybe_finish(c: Coordinator, now: float) -> None:
    assert c.state is not None and c._finish_started is not None
    have_final = c.state.global_version in c.state.val_losses
    if not have_final and now - c._finish_started < c.cfg.final_eval_wait_s:
        return
    for m in c.book.members.values():
        c._send(m.peer, Shutdown(reason=f"completed {len(c.state.history)} rounds"))
    c.finished = True
    c._publish_status()
    log.info("[coordinator] finished at v%d", c.state.global_version)


def full_global(
    c: Coordinator, state: GlobalState, round_id: int, evaluate: bool = False
) -> Global:
    """The whole of ``state``'s model (a durable one: the caller waited for its save)."""
    digest = c._hash(state)
    return Global(
        round_id=round_id,
        base_version=-1,
        global_version=state.global_version,
        fragment=-1,
        merged=(),
        is_full=True,
        state_hash=digest,
        signature=sign(c, state.global_version, -1, -1, digest),
        evaluate=evaluate,
        payload=encode_tensors(state.params, get_codec("fp32")),
    )


def sign(c: Coordinator, version: int, base: int, fragment: int, digest: str) -> bytes:
    if c.kit is None:
        return b""
    data = global_signed_bytes(version, base, fragment, digest)
    return sign_blob(c.kit.signing_key, data, context="global")
