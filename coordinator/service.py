"""The coordinator service: thin I/O around membership, round decisions and the strategy.

The loop receives one message at a time, records it, then ``tick``s: expire silent sites, ask
``rounds.decide`` what to do, and carry the decision out. All math is in ``strategy``; every
decision is a pure function; durable writes happen before anything is announced:

- opening a round persists the round counter first (round ids are never reused);
- closing a round persists θ_{t+1}, momentum and residual first, then sends Global.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from comm.channel import RouterChannel
from comm.compress import get_codec
from comm.schema import (
    ERROR_MEANINGS,
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
    Shutdown,
    SyncRequest,
    Update,
    Welcome,
)
from comm.tensors import decode_tensors, encode_tensors, spec_of, state_hash
from comm.wire import WireError
from coordinator.config import CoordinatorConfig
from coordinator.membership import Member, expired, ready_sites, touch
from coordinator.metrics import CoordinatorMetrics
from coordinator.rounds import Action, OpenRound, RoundPolicy, RoundSnapshot, decide
from coordinator.state import FileStateStore, GlobalState, StateStore, atomic_write
from coordinator.strategy import Arrays, DiLoCo, Strategy, global_norm

log = logging.getLogger("crossdc.coordinator")


@dataclass(frozen=True)
class _Accepted:
    weight: float
    delta: Arrays
    train_loss: float
    compute_seconds: float
    nbytes: int


class Coordinator:
    """One federation's coordinator. ``start``, then ``run`` (or ``step``), then ``close``."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        *,
        store: StateStore | None = None,
        strategy: Strategy | None = None,
        metrics: CoordinatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.store: StateStore = store or FileStateStore(cfg.state_dir, keep=cfg.keep_checkpoints)
        self.strategy: Strategy = strategy or DiLoCo(lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        self.metrics = metrics or CoordinatorMetrics()
        self.clock = clock
        self.policy = RoundPolicy(cfg.min_sites, cfg.quorum_fraction, cfg.max_rounds)
        self.session_id = os.urandom(8).hex()
        self.state: GlobalState | None = None
        self.members: dict[str, Member] = {}
        self.open_round: OpenRound | None = None
        self._accepted: dict[str, _Accepted] = {}
        self._round_bytes_at_open = (0, 0)
        self._init_site: str | None = None
        self._init_fingerprint: str | None = None
        self._finish_started: float | None = None
        self.finished = False
        self.endpoint = ""
        self.chan: RouterChannel | None = None
        self._hash_cache: tuple[int, str] | None = None
        self._status_lock = threading.Lock()
        self._status: dict[str, Any] = {}
        self._status_published_at = 0.0

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        """Load durable state, bind the socket; return the bound endpoint."""
        self.state = self.store.load()
        if self.state is not None:
            self.metrics.global_version.set(self.state.global_version)
            log.info(
                "[coordinator] resumed global_version=%d round_counter=%d",
                self.state.global_version,
                self.state.round_counter,
            )
        self.chan = RouterChannel(self.cfg.channel, on_reject=self._on_wire_reject)
        self.endpoint = self.chan.bind(self.cfg.bind)
        if self.cfg.state_dir:
            path = self.cfg.state_path / "endpoint.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            body = json.dumps({"endpoint": self.endpoint, "session_id": self.session_id}).encode()
            atomic_write(path, lambda fh: fh.write(body))
        log.info("[coordinator] listening on %s session=%s", self.endpoint, self.session_id)
        self._publish_status()
        return self.endpoint

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()
            self.chan = None

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until the federation finishes or ``stop`` is set."""
        while not self.finished and not (stop is not None and stop.is_set()):
            self.step(0.05)

    def step(self, timeout_s: float) -> None:
        """Handle at most one message (waiting up to ``timeout_s``), then tick."""
        assert self.chan is not None, "start() first"
        got = self.chan.recv(timeout_s)
        if got is not None:
            peer, msg = got
            self._handle(peer, msg)
        self.tick()

    # ---- helpers ---------------------------------------------------------------------------

    def _on_wire_reject(self, peer: bytes, code: ErrorCode, detail: str) -> None:
        self.metrics.rejected.labels(reason=code.name.lower()).inc()

    def _reject(self, peer: bytes, code: ErrorCode, detail: str, who: str = "?") -> None:
        self.metrics.rejected.labels(reason=code.name.lower()).inc()
        log.warning("[coordinator site=%s] rejected: %s: %s", who, code.name.lower(), detail)
        self._send(peer, Error(code=int(code), detail=f"{ERROR_MEANINGS[code]}: {detail}"))

    def _send(self, peer: bytes, msg: Message) -> bool:
        assert self.chan is not None
        before = self.chan.stats.bytes_sent
        ok = self.chan.send(peer, msg)
        self.metrics.wire_bytes.labels(direction="out").inc(self.chan.stats.bytes_sent - before)
        return ok

    def _hash(self) -> str:
        assert self.state is not None
        if self._hash_cache is None or self._hash_cache[0] != self.state.global_version:
            self._hash_cache = (self.state.global_version, state_hash(self.state.params))
        return self._hash_cache[1]

    def _full_global(self, round_id: int, evaluate: bool = False) -> Global:
        assert self.state is not None
        return Global(
            round_id=round_id,
            base_version=-1,
            global_version=self.state.global_version,
            is_full=True,
            state_hash=self._hash(),
            evaluate=evaluate,
            payload=encode_tensors(self.state.params, get_codec("fp32")),
        )

    def _member_for(self, peer: bytes, site_id: str) -> Member | None:
        m = self.members.get(site_id)
        if m is None or m.peer != peer:
            self._reject(peer, ErrorCode.NOT_JOINED, f"site {site_id!r} must join", site_id)
            return None
        self.members[site_id] = touch(m, self.clock(), peer)
        return self.members[site_id]

    # ---- message handling ------------------------------------------------------------------

    def _handle(self, peer: bytes, msg: Message) -> None:
        assert self.chan is not None
        self.metrics.wire_bytes.labels(direction="in").inc(0)  # label exists from the start
        if isinstance(msg, Join):
            self._on_join(peer, msg)
        elif isinstance(msg, Heartbeat):
            self._member_for(peer, msg.site_id)
        elif isinstance(msg, InitParams):
            if self._member_for(peer, msg.site_id) is not None:
                self._on_init(peer, msg)
        elif isinstance(msg, Update):
            if self._member_for(peer, msg.site_id) is not None:
                self._on_update(peer, msg)
        elif isinstance(msg, Eval):
            if self._member_for(peer, msg.site_id) is not None:
                self._on_eval(msg)
        elif isinstance(msg, SyncRequest):
            if self._member_for(peer, msg.site_id) is not None and self.state is not None:
                m = self.members[msg.site_id]
                self.members[msg.site_id] = replace(m, in_sync=False)
                self._send_full(msg.site_id)
        elif isinstance(msg, Leave):
            if self._member_for(peer, msg.site_id) is not None:
                log.info("[coordinator site=%s] left: %s", msg.site_id, msg.reason)
                self._remove(msg.site_id)
        else:
            self._reject(peer, ErrorCode.UNEXPECTED, f"{type(msg).__name__} is not for me")

    def _on_join(self, peer: bytes, msg: Join) -> None:
        fingerprint = self.state.model_fingerprint if self.state else self._init_fingerprint
        if fingerprint is not None and msg.model_fingerprint != fingerprint:
            self._reject(
                peer,
                ErrorCode.MODEL_MISMATCH,
                f"site model {msg.model_fingerprint} != federation model {fingerprint}",
                msg.site_id,
            )
            return
        now = self.clock()
        old = self.members.get(msg.site_id)
        if old is not None and old.peer != peer:
            assert self.chan is not None
            self.chan.forget(old.peer)
        in_sync = (
            self.state is not None
            and msg.global_version == self.state.global_version
            and msg.state_hash == self._hash()
        )
        self.members[msg.site_id] = Member(
            site_id=msg.site_id,
            peer=peer,
            joined_at=now,
            last_seen=now,
            global_version=msg.global_version if in_sync else -1,
            in_sync=in_sync,
        )
        self.metrics.joins.inc()
        self.metrics.members.set(len(self.members))
        need_init = False
        if self.state is None and (self._init_site is None or self._init_site not in self.members):
            self._init_site, self._init_fingerprint = msg.site_id, msg.model_fingerprint
            need_init = True
        log.info(
            "[coordinator site=%s] joined version=%d in_sync=%s need_init=%s",
            msg.site_id,
            msg.global_version,
            in_sync,
            need_init,
        )
        self._send(
            peer,
            Welcome(
                site_id=msg.site_id,
                session_id=self.session_id,
                global_version=self.state.global_version if self.state else -1,
                heartbeat_interval_s=self.cfg.channel.heartbeat_interval_s,
                need_init=need_init,
            ),
        )
        if self.state is not None and not in_sync:
            self._send_full(msg.site_id)

    def _send_full(self, site_id: str) -> None:
        assert self.state is not None
        m = self.members[site_id]
        if self._send(m.peer, self._full_global(round_id=self.state.global_version)):
            self.members[site_id] = replace(
                m, global_version=self.state.global_version, in_sync=True
            )
            log.info(
                "[coordinator site=%s] sent full model v%d", site_id, self.state.global_version
            )

    def _on_init(self, peer: bytes, msg: InitParams) -> None:
        if self.state is not None or msg.site_id != self._init_site:
            self._reject(
                peer, ErrorCode.UNEXPECTED, "initial parameters not requested", msg.site_id
            )
            return
        try:
            params = decode_tensors(msg.payload)
        except WireError as exc:
            self._reject(peer, exc.code, exc.detail, msg.site_id)
            return
        params = {k: np.array(v, dtype=np.float32) for k, v in params.items()}
        zeros = {k: np.zeros_like(v) for k, v in params.items()}
        self.state = GlobalState(
            params=params,
            momentum=zeros,
            residual={k: v.copy() for k, v in zeros.items()},
            global_version=0,
            round_counter=0,
            model_fingerprint=msg.model_fingerprint,
        )
        self.store.save(self.state)
        log.info(
            "[coordinator site=%s] initial model: %d tensors, %d parameters",
            msg.site_id,
            len(params),
            sum(v.size for v in params.values()),
        )
        m = self.members[msg.site_id]
        self.members[msg.site_id] = replace(m, global_version=0, in_sync=True)
        for site_id, other in sorted(self.members.items()):
            if not other.in_sync:
                self._send_full(site_id)
        self._publish_status()

    def _on_update(self, peer: bytes, msg: Update) -> None:
        r = self.open_round
        if r is None or msg.round_id != r.round_id:
            self._reject(
                peer, ErrorCode.STALE_ROUND, f"round {msg.round_id} is not open", msg.site_id
            )
            return
        if msg.site_id not in r.participants:
            self._reject(
                peer, ErrorCode.UNEXPECTED, f"not a participant of {r.round_id}", msg.site_id
            )
            return
        if msg.site_id in r.received:
            self._reject(peer, ErrorCode.DUPLICATE, f"round {r.round_id}", msg.site_id)
            return
        if msg.global_version != r.base_version:
            self._reject(
                peer,
                ErrorCode.STALE_ROUND,
                f"trained from v{msg.global_version}, round base is v{r.base_version}",
                msg.site_id,
            )
            return
        if not (np.isfinite(msg.weight) and msg.weight > 0 and np.isfinite(msg.train_loss)):
            self._reject(peer, ErrorCode.NON_FINITE, f"weight {msg.weight}", msg.site_id)
            return
        assert self.state is not None
        try:
            delta = decode_tensors(msg.payload, spec_of(self.state.params))
        except WireError as exc:
            self._reject(peer, exc.code, exc.detail, msg.site_id)
            return
        norm = global_norm(delta)
        if norm > self.cfg.max_update_norm:
            self._reject(
                peer,
                ErrorCode.BAD_PAYLOAD,
                f"update norm {norm:.3g} > bound {self.cfg.max_update_norm:.3g}",
                msg.site_id,
            )
            return
        nbytes = sum(enc.nbytes for enc in msg.payload)
        raw = sum(4 * int(np.prod(enc.shape)) for enc in msg.payload)
        self._accepted[msg.site_id] = _Accepted(
            msg.weight, delta, msg.train_loss, msg.compute_seconds, nbytes
        )
        self.open_round = replace(r, received=r.received | {msg.site_id})
        self.metrics.updates_accepted.labels(site=msg.site_id).inc()
        self.metrics.update_size.observe(nbytes)
        self.metrics.payload_bytes.labels(direction="in").inc(nbytes)
        self.metrics.payload_raw_bytes.labels(direction="in").inc(raw)
        log.info(
            "[coordinator site=%s round=%d] update accepted weight=%.0f loss=%.4f norm=%.4g",
            msg.site_id,
            r.round_id,
            msg.weight,
            msg.train_loss,
            norm,
        )

    def _on_eval(self, msg: Eval) -> None:
        assert self.state is not None
        if not np.isfinite(msg.val_loss):
            self.metrics.rejected.labels(reason="non_finite").inc()
            return
        if msg.global_version in self.state.val_losses:
            return
        val_losses = {**self.state.val_losses, msg.global_version: msg.val_loss}
        self.state = replace(self.state, val_losses=val_losses)
        self.store.save_counter(self.state)
        if msg.global_version == self.state.global_version:
            self.metrics.val_loss.set(msg.val_loss)
        log.info(
            "[coordinator site=%s] val_loss=%.4f at v%d",
            msg.site_id,
            msg.val_loss,
            msg.global_version,
        )
        self._publish_status()

    def _remove(self, site_id: str) -> None:
        m = self.members.pop(site_id, None)
        if m is not None and self.chan is not None:
            self.chan.forget(m.peer)
        self.metrics.members.set(len(self.members))

    # ---- the tick: decisions carried out ---------------------------------------------------

    def tick(self) -> None:
        now = self.clock()
        if now - self._status_published_at > 1.0:
            self._publish_status()
        gone, reason = expired(now, self.members, self.cfg.site_timeout_s)
        for site_id in gone:
            log.warning("[coordinator site=%s] removed: %s", site_id, reason)
            self.metrics.site_timeouts.inc()
            self._remove(site_id)
        if self.state is None:
            if self._init_site is not None and self._init_site not in self.members:
                self._init_site = self._init_fingerprint = None
            return
        if self.finished:
            return
        if self._finish_started is not None:
            self._maybe_finish(now)
            return
        snap = RoundSnapshot(
            open_round=self.open_round,
            ready=tuple(ready_sites(self.members, self.state.global_version)),
            alive=frozenset(self.members),
            completed_rounds=len(self.state.history),
        )
        decision, why = decide(now, snap, self.policy)
        if decision.action is Action.OPEN:
            self._open(now, decision.participants, why)
        elif decision.action is Action.CLOSE:
            self._close(now, decision.participants, why)
        elif decision.action is Action.ABORT:
            assert self.open_round is not None
            log.warning("[coordinator round=%d] aborted: %s", self.open_round.round_id, why)
            self.metrics.rounds_aborted.inc()
            self.open_round = None
            self._accepted.clear()
        elif decision.action is Action.FINISH:
            log.info("[coordinator] finishing: %s", why)
            self._finish_started = now
            self._maybe_finish(now)

    def _open(self, now: float, participants: tuple[str, ...], why: str) -> None:
        assert self.state is not None and self.chan is not None
        round_id = self.state.round_counter + 1
        self.state = replace(self.state, round_counter=round_id)
        self.store.save_counter(self.state)  # durable before announced: ids are never reused
        self.open_round = OpenRound(
            round_id=round_id,
            base_version=self.state.global_version,
            participants=participants,
            opened_at=now,
            deadline_at=now + self.cfg.round_deadline_s,
            received=frozenset(),
        )
        self._accepted.clear()
        self._round_bytes_at_open = (self.chan.stats.bytes_received, self.chan.stats.bytes_sent)
        evaluate_base = self.state.global_version not in self.state.val_losses
        log.info("[coordinator round=%d] open: %s; participants=%s", round_id, why, participants)
        for i, site_id in enumerate(participants):
            self._send(
                self.members[site_id].peer,
                RoundStart(
                    round_id=round_id,
                    global_version=self.state.global_version,
                    num_inner_steps=self.cfg.num_inner_steps,
                    codec=self.cfg.uplink_codec,
                    deadline_s=self.cfg.round_deadline_s,
                    participants=participants,
                    evaluate=evaluate_base and i == 0,
                ),
            )
        self.cfg.faults.point("open", round_id)

    def _close(self, now: float, merged: tuple[str, ...], why: str) -> None:
        assert self.state is not None and self.open_round is not None and self.chan is not None
        r = self.open_round
        st = self.state
        updates = [(s, self._accepted[s].weight, self._accepted[s].delta) for s in merged]
        exact_prev = {k: st.params[k] + st.residual[k] for k in st.params}
        result = self.strategy.outer_step(exact_prev, st.momentum, updates)
        codec = get_codec(self.cfg.downlink_codec)
        delta = {k: result.params[k] - st.params[k] for k in st.params}
        encoded = encode_tensors(delta, codec)
        decoded = decode_tensors(encoded)
        new_params = {k: st.params[k] + decoded[k] for k in st.params}
        residual = {k: result.params[k] - new_params[k] for k in st.params}
        total_weight = sum(self._accepted[s].weight for s in merged)
        train_loss = sum(self._accepted[s].weight * self._accepted[s].train_loss for s in merged)
        bytes_in = self.chan.stats.bytes_received - self._round_bytes_at_open[0]
        entry: dict[str, Any] = {
            "round_id": r.round_id,
            "global_version": r.round_id,
            "base_version": r.base_version,
            "participants": list(r.participants),
            "merged": list(merged),
            "train_loss": train_loss / total_weight,
            "tokens": total_weight,
            "outer_grad_norm": result.outer_grad_norm,
            "uplink_codec": self.cfg.uplink_codec,
            "downlink_codec": self.cfg.downlink_codec,
            "update_bytes": sum(self._accepted[s].nbytes for s in merged),
            "compute_seconds_max": max(self._accepted[s].compute_seconds for s in merged),
            "duration_s": now - r.opened_at,
            "finished_unix": time.time(),
        }
        new_state = replace(
            st,
            params=new_params,
            momentum=result.momentum,
            residual=residual,
            global_version=r.round_id,
            history=(*st.history, entry),
        )
        self.store.save(new_state)  # durable before announced
        self.cfg.faults.point("close", r.round_id)
        self.state = new_state
        self.open_round = None
        self._accepted.clear()
        digest = self._hash()
        in_sync = sorted(
            s for s, m in self.members.items() if m.in_sync and m.global_version == r.base_version
        )
        evaluator = in_sync[0] if in_sync else None
        out_before = self.chan.stats.bytes_sent
        for site_id, m in sorted(self.members.items()):
            if site_id in in_sync:
                msg: Global = Global(
                    round_id=r.round_id,
                    base_version=r.base_version,
                    global_version=r.round_id,
                    is_full=False,
                    state_hash=digest,
                    evaluate=site_id == evaluator,
                    payload=encoded,
                )
            else:
                msg = self._full_global(r.round_id, evaluate=evaluator is None and not in_sync)
            ok = self._send(m.peer, msg)
            self.members[site_id] = replace(m, global_version=r.round_id, in_sync=ok)
        entry["wire_bytes_in"] = bytes_in
        entry["wire_bytes_out"] = self.chan.stats.bytes_sent - self._round_bytes_at_open[1]
        entry["broadcast_bytes"] = self.chan.stats.bytes_sent - out_before
        payload_bytes = sum(enc.nbytes for enc in encoded)
        self.metrics.payload_bytes.labels(direction="out").inc(payload_bytes * len(in_sync))
        self.metrics.payload_raw_bytes.labels(direction="out").inc(
            sum(4 * v.size for v in delta.values()) * len(in_sync)
        )
        self.metrics.rounds.inc()
        self.metrics.round_duration.observe(entry["duration_s"])
        self.metrics.quorum_size.set(len(merged))
        self.metrics.outer_grad_norm.set(result.outer_grad_norm)
        self.metrics.train_loss.set(entry["train_loss"])
        self.metrics.global_version.set(r.round_id)
        log.info(
            "[coordinator round=%d] closed: %s; merged=%s train_loss=%.4f outer_norm=%.4g %.1fs",
            r.round_id,
            why,
            merged,
            entry["train_loss"],
            result.outer_grad_norm,
            entry["duration_s"],
        )
        self._publish_status()

    def _maybe_finish(self, now: float) -> None:
        assert self.state is not None and self._finish_started is not None
        have_final = self.state.global_version in self.state.val_losses
        if not have_final and now - self._finish_started < self.cfg.final_eval_wait_s:
            return
        for m in self.members.values():
            self._send(m.peer, Shutdown(reason=f"completed {len(self.state.history)} rounds"))
        self.finished = True
        self._publish_status()
        log.info("[coordinator] finished at v%d", self.state.global_version)

    # ---- status ----------------------------------------------------------------------------

    def _publish_status(self) -> None:
        st = self.state
        chan = self.chan
        status: dict[str, Any] = {
            "session_id": self.session_id,
            "endpoint": self.endpoint,
            "finished": self.finished,
            "global_version": st.global_version if st else None,
            "round_counter": st.round_counter if st else 0,
            "rounds_completed": len(st.history) if st else 0,
            "members": sorted(self.members),
            "open_round": self.open_round.round_id if self.open_round else None,
            "val_losses": {str(k): v for k, v in sorted(st.val_losses.items())} if st else {},
            "history": list(st.history) if st else [],
            "wire_bytes_in": chan.stats.bytes_received if chan else 0,
            "wire_bytes_out": chan.stats.bytes_sent if chan else 0,
            "rejected": dict(chan.stats.rejected) if chan else {},
            "num_parameters": int(sum(v.size for v in st.params.values())) if st else 0,
        }
        with self._status_lock:
            self._status = status
        self._status_published_at = self.clock()
        if self.cfg.state_dir:
            body = json.dumps(status, indent=1, sort_keys=True).encode()
            atomic_write(self.cfg.state_path / "status.json", lambda fh: fh.write(body))

    def status(self) -> dict[str, Any]:
        """The latest published status (safe to call from another thread)."""
        with self._status_lock:
            return dict(self._status)
