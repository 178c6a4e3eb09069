"""The global model to one site outside a broadcast: after a join, a SyncRequest or a result
that failed to reach it. The broadcast deltas since the version the site holds when the delta
log proves its hash and bridges the gap, else the whole model; either once the state it shows is
durable."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from coordinator import closing
from coordinator.state import GlobalState

if TYPE_CHECKING:
    from coordinator.service import Coordinator

log = logging.getLogger("crossdc.coordinator")


def send_full(c: Coordinator, site_id: str) -> None:
    """The whole current model (sent once the latest save, which covers it, is durable)."""
    state = c.state
    assert state is not None
    c._later(lambda: _full_now(c, site_id, state))


def send_catch_up(c: Coordinator, site_id: str, version: int, digest: str) -> None:
    """Bring a site that holds ``version`` (state hash ``digest``) to the current model: the
    broadcast deltas since, when the log proves its hash and bridges the gap, else the model."""
    state = c.state
    assert state is not None
    c._later(lambda: _catch_up_now(c, site_id, version, digest, state))


def _catch_up_now(
    c: Coordinator, site_id: str, version: int, digest: str, state: GlobalState
) -> None:
    m = c.book.members.get(site_id)
    if m is None or m.in_sync:
        return  # left, or a broadcast in between brought it up to date
    chain = c.deltas.chain(version, digest, state.global_version)
    if chain is None:
        _full_now(c, site_id, state)
        return
    if all(c._send_now(m.peer, msg) for msg in chain):
        c.book.holds(site_id, state.global_version, in_sync=True)
        c.metrics.catch_up_deltas.inc(len(chain))
        log.info(
            "[coordinator site=%s] caught up v%d -> v%d with %d deltas (%d bytes)",
            site_id,
            version,
            state.global_version,
            len(chain),
            sum(enc.nbytes for msg in chain for enc in msg.payload),
        )


def _full_now(c: Coordinator, site_id: str, state: GlobalState) -> None:
    m = c.book.members.get(site_id)
    if m is None:
        return  # left while its model waited for a save
    version = state.global_version
    if c._send_now(m.peer, closing.full_global(c, state, round_id=version)):
        c.book.holds(site_id, version, in_sync=True)
        log.info("[coordinator site=%s] sent full model v%d", site_id, version)
