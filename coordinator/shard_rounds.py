"""The rounds of a shard that follows shard 0: opened, frozen, closed and aborted as told.

A coordinator of several shards decides its rounds on shard 0 (``coordinator.lifecycle`` there
as on a single coordinator); every other shard runs the same rounds over its own tensors, each
one a :class:`~coordinator.round.Round` in its own :class:`~coordinator.lifecycle.Lifecycle`,
taking the sites' parts through the same ``take``. Only the transitions come from shard 0's
messages instead of the lifecycle's own decision (a follower never calls ``Lifecycle.tick``):
:func:`open_as_told` (``ShardOpen``), :func:`freeze` (``ShardFreeze``: no more parts, and
whose it holds), :func:`close_as_told` (``ShardClose``: what it holds of a site shard 0 leaves
out is let go, :func:`leave_out`), :func:`abort_as_told`
(``ShardAbort``). Each checks that shard 0's word fits what this shard holds and raises
ValueError when it does not (this shard is out of step and must meet shard 0 again).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import replace

from comm.wire.schema import ShardAbort, ShardClose, ShardOpen
from coordinator.decisions import Abort, Close
from coordinator.lifecycle import Lifecycle
from coordinator.round import Round
from coordinator.shard_peers import plan_of

log = logging.getLogger("crossdc.coordinator.shards")


def open_as_told(
    book: Lifecycle, now: float, msg: ShardOpen, tensors: Mapping[str, tuple[int, ...]]
) -> Round:
    """Open shard 0's round ``msg`` over this shard's ``tensors``: the same id, participants,
    quorum, deadline and plan. The round counter moves to its id (persist it before saying
    ``ShardOpened``: an id is never reused)."""
    if msg.round_id <= book.round_counter:
        raise ValueError(
            f"shard 0 opened round {msg.round_id}, this shard has counted to {book.round_counter}"
        )
    if msg.fragment != 0 or book.cfg.num_fragments != 1:
        raise ValueError(f"round {msg.round_id}: shards sync the whole model, not fragments")
    latest = max([book.global_version] + [r.round_id for r in book.open_rounds])
    if msg.base_version != latest:
        raise ValueError(
            f"round {msg.round_id} builds on version {msg.base_version}, this shard's latest is "
            f"{latest}"
        )
    participants = tuple(msg.participants)
    r = Round(
        round_id=msg.round_id,
        fragment=0,
        num_fragments=1,
        base_version=msg.base_version,
        participants=participants,
        opened_at=now,
        deadline_at=now + msg.deadline_s,
        quorum=msg.quorum,
        aggregator=book.aggregator,
        fold=book.aggregator.fold(msg.round_id, participants),
        plan=plan_of(msg.plan),
        tensors=dict(tensors),
    )
    book.round_counter = msg.round_id
    book.open_rounds.append(r)
    return r


def _open(book: Lifecycle, round_id: int) -> Round:
    r = book.open_round(round_id)
    if r is None:
        raise ValueError(f"round {round_id} is not open on this shard")
    return r


def freeze(book: Lifecycle, round_id: int) -> frozenset[str]:
    """Round ``round_id`` takes no more parts; the sites whose parts it holds."""
    r = _open(book, round_id)
    r.frozen = True
    return r.received


def close_as_told(book: Lifecycle, msg: ShardClose) -> Close:
    """Close the frozen round over exactly shard 0's ``merged`` (which this shard must hold),
    as the lifecycle closes one: the decision the closing carries out. What it holds of any
    other site is let go first (:func:`leave_out`)."""
    r = _open(book, msg.round_id)
    if not r.frozen:
        raise ValueError(f"round {msg.round_id} is closed before it was frozen")
    if r is not book.open_rounds[0]:
        raise ValueError(f"round {msg.round_id} is closed before an older round")
    if not frozenset(msg.merged) <= r.received:
        raise ValueError(
            f"round {msg.round_id}: shard 0 merges {sorted(msg.merged)}, this shard holds "
            f"{sorted(r.received)}"
        )
    leave_out(r, msg.merged)
    decision = book.close(r, tuple(msg.merged), "shard 0 closed it")
    return replace(decision, final=msg.final)


def leave_out(r: Round, merged: Collection[str]) -> tuple[str, ...]:
    """Let go of what the frozen round ``r`` holds of every site not in ``merged`` (the
    shards agreed to merge it nowhere): its fold drops it, its sender's charge is given back.
    The sites left out, by id."""
    left = tuple(sorted(r.received - frozenset(merged)))
    for site_id in left:
        r.leave_out(site_id)
        log.info(
            "[coordinator site=%s round=%d] its part held here let go: merged on no shard",
            site_id,
            r.round_id,
        )
    return left


def abort_as_told(book: Lifecycle, msg: ShardAbort) -> Abort | None:
    """Abort the rounds shard 0 aborted: every round open here, since later ones build on the
    oldest (None when none of them is open here any more)."""
    if not any(book.open_round(i) is not None for i in msg.round_ids):
        return None
    return book.abort(f"shard 0: {msg.reason}")
