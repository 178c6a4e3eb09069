"""The coordinator service: thin I/O around membership, round decisions and the strategy.

The loop receives one message at a time, records it, then ``tick``s: expire silent sites, ask
``rounds.decide`` what to do, and carry the decision out. All math is in ``strategy``; every
decision is a pure function; durable writes happen before anything is announced:

- opening a round persists the round counter first (round ids are never reused);
- closing a round persists θ_{t+1}, momentum and residual first, then sends Global.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import zmq

from comm.channel import RouterChannel
from comm.compress import EncodedTensor, get_codec
from comm.keys import (
    AuthError,
    CertificateRegistry,
    CoordinatorKit,
    load_coordinator_kit,
    sign_blob,
)
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
    RoundCancel,
    RoundStart,
    Shutdown,
    SyncRequest,
    Update,
    Welcome,
)
from comm.secagg import WEIGHT_KEY, MaskingPlan, Peer, decide_attempt, unmask_mean
from comm.tensors import (
    decode_tensors,
    encode_tensors,
    fragments,
    global_signed_bytes,
    state_hash,
)
from comm.wire import WireError
from comm.zap import ZapHandler
from coordinator.config import CoordinatorConfig
from coordinator.lifecycle import (
    Abort,
    Close,
    Lifecycle,
    LifecycleConfig,
    Open,
    Refusal,
    Remove,
    Rerun,
)
from coordinator.membership import Member
from coordinator.metrics import CoordinatorMetrics
from coordinator.rounds import OpenRound
from coordinator.scheduler import RoundPlan, SchedulePolicy, SiteView, plan_round
from coordinator.state import (
    STATUS_HISTORY_TAIL,
    FileStateStore,
    GlobalState,
    StateStore,
    StateWriter,
    StatusBoard,
    write_endpoint,
)
from coordinator.strategy import Arrays, DiLoCo, OuterResult, Strategy, global_norm

log = logging.getLogger("crossdc.coordinator")


@dataclass(frozen=True)
class _Accepted:
    site_id: str
    round_id: int
    weight: float
    delta: Arrays
    train_loss: float
    compute_seconds: float
    nbytes: int


@dataclass(frozen=True)
class _Announcement:
    """A closed round's result, waiting for its state to be durable before it is sent."""

    decision: Close
    state: GlobalState
    """The state the round produced."""
    base_version: int
    encoded: tuple[EncodedTensor, ...]
    delta: Arrays
    entry: dict[str, Any]
    result: OuterResult
    late: list[_Accepted]


def lifecycle_config(cfg: CoordinatorConfig) -> LifecycleConfig:
    """What the round lifecycle needs of the coordinator's configuration."""
    return LifecycleConfig(
        min_sites=cfg.min_sites,
        quorum_fraction=cfg.quorum_fraction,
        max_rounds=cfg.max_rounds,
        max_open=2 if cfg.overlap else 1,
        num_fragments=cfg.num_fragments,
        max_staleness_rounds=cfg.max_staleness_rounds,
        round_deadline_s=cfg.round_deadline_s,
        site_timeout_s=cfg.site_timeout_s,
        grace_floor_s=cfg.grace_floor_s,
        grace_ceiling_s=cfg.grace_ceiling_s,
        secure_aggregation=cfg.secure_aggregation is not None,
    )


def next_fragment(history: Sequence[Mapping[str, Any]], num_fragments: int) -> int:
    """The fragment a resumed coordinator syncs first: the one after the last completed round's,
    so a restart keeps the rotation instead of syncing fragment 0 out of turn. 0 without history
    or when the fragment count has changed since."""
    if not history:
        return 0
    last = history[-1]
    if last.get("num_fragments") != num_fragments or not isinstance(last.get("fragment"), int):
        return 0
    return (int(last["fragment"]) + 1) % num_fragments


class Coordinator:
    """One federation's coordinator. ``start``, then ``run`` (or ``step``), then ``close``.

    Rounds and membership live in a pure :class:`Lifecycle` (``self.book``); this class is the
    I/O around it: decoding and validating messages, the strategy's math, durable writes and
    sends, in the order the lifecycle's decisions give.
    """

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
        self.kit: CoordinatorKit | None = (
            load_coordinator_kit(cfg.security.kit_dir) if cfg.security.kit_dir else None
        )
        self.store: StateStore = store or FileStateStore(
            cfg.state_dir,
            keep=cfg.keep_checkpoints,
            signing_key=self.kit.signing_key if self.kit else None,
        )
        self.registry: CertificateRegistry | None = None
        self._zap: ZapHandler | None = None
        self.strategy: Strategy = strategy or DiLoCo(
            lr=cfg.outer_lr, momentum=cfg.outer_momentum, warmup_steps=cfg.outer_warmup_steps
        )
        self.metrics = metrics or CoordinatorMetrics()
        self.clock = clock
        self.book = Lifecycle(lifecycle_config(cfg))
        self.session_id = os.urandom(8).hex()
        self.state: GlobalState | None = None
        # Decoded updates: on time per open round, and late ones by (site, round).
        self._accepted: dict[int, dict[str, _Accepted]] = {}
        self._late: dict[tuple[str, int], _Accepted] = {}
        self._views: dict[str, SiteView] = {}
        self._round_plan: dict[int, RoundPlan] = {}
        # Arrival alignment: when each on-time update landed, per open round; how early each
        # site's landed in the latest closed round (``_early_round``) before its last one, and
        # the extra steps it had there.
        self._arrived: dict[int, dict[str, float]] = {}
        self._early_s: dict[str, float] = {}
        self._early_extra: dict[str, int] = {}
        self._early_round = 0
        self._fragment_names: list[list[str]] = []
        self._round_bytes_at_open: dict[int, tuple[int, int]] = {}
        # Secure aggregation: each site's announced masking keys, each round's masking plan
        # (its current attempt), and the masked vectors of that attempt.
        self._secagg_peers: dict[str, Peer] = {}
        self._masking: dict[int, MaskingPlan] = {}
        self._masked: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        self._init_site: str | None = None
        self._init_fingerprint: str | None = None
        self._finish_started: float | None = None
        self.finished = False
        self.endpoint = ""
        self.chan: RouterChannel | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._hash_cache: tuple[int, str] | None = None
        # Saves run on a writer thread; whatever reveals a state waits until it is durable:
        # sends and announcements queue behind the latest save's ticket (``_barrier``).
        self.writer: StateWriter | None = None
        self._barrier = 0
        self._outbox: deque[tuple[int, Callable[[], None]]] = deque()
        self._flushing = False
        self._status = StatusBoard(
            self.cfg.state_path / "status.json" if self.cfg.state_dir else None, self.clock
        )

    @property
    def members(self) -> dict[str, Member]:
        return self.book.members

    @property
    def open_rounds(self) -> list[OpenRound]:
        return self.book.open_rounds

    @property
    def open_round(self) -> OpenRound | None:
        """The oldest round in flight."""
        return self.book.open_rounds[0] if self.book.open_rounds else None

    def _set_model(self) -> None:
        """Fragment layout of the model (a pure function of its tensor names)."""
        assert self.state is not None
        self._fragment_names = fragments(list(self.state.params), self.cfg.num_fragments)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        """Load durable state, bind the socket; return the bound endpoint."""
        self.state = self.store.load()
        self.writer = StateWriter(self.store)
        if self.state is not None:
            self._set_model()
            self.book = Lifecycle.resume(
                lifecycle_config(self.cfg),
                global_version=self.state.global_version,
                round_counter=self.state.round_counter,
                completed_rounds=len(self.state.history),
                next_fragment=next_fragment(self.state.history, self.cfg.num_fragments),
            )
            self.metrics.global_version.set(self.state.global_version)
            log.info(
                "[coordinator] resumed global_version=%d round_counter=%d",
                self.state.global_version,
                self.state.round_counter,
            )
        self._ctx = zmq.Context()
        channel_cfg = self.cfg.channel
        if self.kit is not None:
            self.registry = CertificateRegistry.from_kit(self.kit.kit_dir)
            self._zap = ZapHandler(self._ctx, self.registry, on_reject=self._on_auth_reject)
            self._zap.start()  # before the bind: no handshake may race the handler
            channel_cfg = replace(channel_cfg, curve=self.kit.curve)
        else:
            log.warning(
                "[coordinator] INSECURE MODE: no encryption, no authentication. "
                "For loopback experiments only; never expose this endpoint."
            )
        self.chan = RouterChannel(channel_cfg, context=self._ctx, on_reject=self._on_wire_reject)
        self.endpoint = self.chan.bind(self.cfg.bind)
        if self.cfg.state_dir:
            write_endpoint(self.cfg.state_path, self.endpoint, self.session_id)
        log.info("[coordinator] listening on %s session=%s", self.endpoint, self.session_id)
        self._publish_status()
        return self.endpoint

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()  # everything submitted is written ...
            self._flush()  # ... so what waited on it goes out before the socket closes
            self.writer = None
            self._publish_status()  # the last state, now durable
        if self.chan is not None:
            self.chan.close()
            self.chan = None
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        if self._ctx is not None:
            # term() waits (up to the linger) until queued messages, e.g. Shutdown, are sent.
            self._ctx.term()
            self._ctx = None

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until the federation finishes or ``stop`` is set."""
        while not self.finished and not (stop is not None and stop.is_set()):
            self.step(0.05)
        if self.writer is not None:  # what waits on a save (Shutdown, say) goes out now
            self.writer.flush()
            self._flush()
            self._publish_status()

    def step(self, timeout_s: float) -> None:
        """Handle at most one message (waiting up to ``timeout_s``), then tick."""
        assert self.chan is not None, "start() first"
        self._flush()
        got = self.chan.recv(min(timeout_s, 0.002) if self._outbox else timeout_s)
        if got is not None:
            peer, msg = got
            self._handle(peer, msg)
        self.tick()
        self._flush()

    # ---- durability before announcement ------------------------------------------------------

    def _persist(self, state: GlobalState, *, counter_only: bool = False) -> None:
        """Queue a save; every later send waits until it is durable."""
        assert self.writer is not None, "start() first"
        submit = self.writer.submit_counter if counter_only else self.writer.submit
        self._barrier = submit(state)

    def _settled(self) -> bool:
        """Nothing waits on a save: every state so far is durable and announced."""
        return not self._outbox and (self.writer is None or self.writer.durable(self._barrier))

    def _later(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the latest save is durable (now, if it already is)."""
        if self._flushing or self._settled():
            action()
        else:
            self._outbox.append((self._barrier, action))

    def _flush(self) -> None:
        """Run, in order, the queued actions whose save is durable (a failed save raises)."""
        while self._outbox and (self.writer is None or self.writer.durable(self._outbox[0][0])):
            _, action = self._outbox.popleft()
            self._flushing = True
            try:
                action()
            finally:
                self._flushing = False

    # ---- helpers ---------------------------------------------------------------------------

    def _on_wire_reject(self, peer: bytes, code: ErrorCode, detail: str) -> None:
        self.metrics.rejected.labels(reason=code.name.lower()).inc()

    def _on_auth_reject(self, reason: str, detail: str) -> None:
        """A connection refused at the CURVE handshake (ZAP handler thread)."""
        self.metrics.rejected.labels(reason=reason).inc()

    def _reject(
        self, peer: bytes, code: ErrorCode, detail: str, who: str = "?", reason: str = ""
    ) -> None:
        reason = reason or code.name.lower()
        self.metrics.rejected.labels(reason=reason).inc()
        log.warning("[coordinator site=%s] rejected: %s: %s", who, reason, detail)
        self._send(peer, Error(code=int(code), detail=f"{ERROR_MEANINGS[code]}: {detail}"))

    def _send(self, peer: bytes, msg: Message) -> bool:
        """Send now, or after the latest save is durable (then True means queued)."""
        if not (self._flushing or self._settled()):
            self._outbox.append((self._barrier, lambda: self._send_queued(peer, msg)))
            return True
        return self._send_now(peer, msg)

    def _send_queued(self, peer: bytes, msg: Message) -> None:
        self._send_now(peer, msg)

    def _send_now(self, peer: bytes, msg: Message) -> bool:
        assert self.chan is not None
        before = self.chan.stats.bytes_sent
        ok = self.chan.send(peer, msg)
        self.metrics.wire_bytes.labels(direction="out").inc(self.chan.stats.bytes_sent - before)
        return ok

    def _hash(self, state: GlobalState | None = None) -> str:
        state = state or self.state
        assert state is not None
        if self._hash_cache is None or self._hash_cache[0] != state.global_version:
            self._hash_cache = (state.global_version, state_hash(state.params))
        return self._hash_cache[1]

    def _sign(self, version: int, base: int, fragment: int, digest: str) -> bytes:
        if self.kit is None:
            return b""
        data = global_signed_bytes(version, base, fragment, digest)
        return sign_blob(self.kit.signing_key, data, context="global")

    def _full_global(self, state: GlobalState, round_id: int, evaluate: bool = False) -> Global:
        """The whole of ``state``'s model (a durable one: the caller waited for its save)."""
        digest = self._hash(state)
        return Global(
            round_id=round_id,
            base_version=-1,
            global_version=state.global_version,
            fragment=-1,
            merged=(),
            is_full=True,
            state_hash=digest,
            signature=self._sign(state.global_version, -1, -1, digest),
            evaluate=evaluate,
            payload=encode_tensors(state.params, get_codec("fp32")),
        )

    def _authentic(self, peer: bytes, site_id: str) -> bool:
        """CURVE mode: the connection's certificate must be valid now and name ``site_id``."""
        if self.registry is None:
            return True
        assert self.chan is not None
        identity = self.chan.identities.get(peer)
        try:
            if identity is None:
                raise AuthError("unknown_key", "no certified identity on this connection")
            self.registry.check_peer(
                user_id=identity.site_id,
                serial=identity.serial,
                claimed_site_id=site_id,
                now=time.time(),
            )
        except AuthError as exc:
            self._reject(peer, ErrorCode.UNAUTHENTICATED, exc.detail, site_id, reason=exc.reason)
            return False
        return True

    def _member_for(self, peer: bytes, site_id: str) -> Member | None:
        if not self._authentic(peer, site_id):
            return None
        m = self.book.touch(self.clock(), site_id, peer)
        if m is None:
            self._reject(peer, ErrorCode.NOT_JOINED, f"site {site_id!r} must join", site_id)
        return m

    # ---- message handling ------------------------------------------------------------------

    def _handle(self, peer: bytes, msg: Message) -> None:
        assert self.chan is not None
        self.metrics.wire_bytes.labels(direction="in").inc(0)  # label exists from the start
        if isinstance(msg, Join):
            self._on_join(peer, msg)
        elif isinstance(msg, Heartbeat):
            if self._member_for(peer, msg.site_id) is not None:
                self._send(peer, msg)  # echoed: the site measures its round trip
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
                self.book.holds(msg.site_id, -1, in_sync=False)
                self._send_full(msg.site_id)
        elif isinstance(msg, Leave):
            if self._member_for(peer, msg.site_id) is not None:
                log.info("[coordinator site=%s] left: %s", msg.site_id, msg.reason)
                self._remove(msg.site_id)
        else:
            self._reject(peer, ErrorCode.UNEXPECTED, f"{type(msg).__name__} is not for me")

    def _on_join(self, peer: bytes, msg: Join) -> None:
        if not self._authentic(peer, msg.site_id):
            return
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
        old = self.book.members.get(msg.site_id)
        if old is not None and old.peer != peer:
            assert self.chan is not None
            self.chan.forget(old.peer)
        in_sync = (
            self.state is not None
            and msg.global_version == self.state.global_version
            and msg.state_hash == self._hash()
        )
        self._record_secagg_peer(peer, msg)
        self.book.join(
            now, msg.site_id, peer, in_sync_version=msg.global_version if in_sync else None
        )
        self.metrics.joins.inc()
        self.metrics.members.set(len(self.book.members))
        need_init = False
        if self.state is None and (
            self._init_site is None or self._init_site not in self.book.members
        ):
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

    def _record_secagg_peer(self, peer: bytes, msg: Join) -> None:
        """A joining site's masking keys: its session key, and its certified CURVE key."""
        announced = msg.capabilities.get("secagg_session_public")
        if self.cfg.secure_aggregation is None or not isinstance(announced, str):
            self._secagg_peers.pop(msg.site_id, None)
            return
        static = None
        if self.registry is not None and self.chan is not None:
            identity = self.chan.identities.get(peer)
            cert = self.registry.certificate(identity.serial) if identity else None
            static = cert.curve_public if cert is not None else None
        try:
            self._secagg_peers[msg.site_id] = Peer(
                session_public=bytes.fromhex(announced), static_public=static
            )
        except ValueError:
            self._secagg_peers.pop(msg.site_id, None)

    def _send_full(self, site_id: str) -> None:
        state = self.state  # the latest save covers it: sent once that save is durable
        assert state is not None
        self._later(lambda: self._send_full_now(site_id, state))

    def _send_full_now(self, site_id: str, state: GlobalState) -> None:
        m = self.book.members.get(site_id)
        if m is None:
            return  # left while its model waited for a save
        version = state.global_version
        if self._send_now(m.peer, self._full_global(state, round_id=version)):
            self.book.holds(site_id, version, in_sync=True)
            log.info("[coordinator site=%s] sent full model v%d", site_id, version)

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
        self._persist(self.state)
        self._set_model()
        log.info(
            "[coordinator site=%s] initial model: %d tensors, %d parameters",
            msg.site_id,
            len(params),
            sum(v.size for v in params.values()),
        )
        self.book.set_model(0)
        self.book.holds(msg.site_id, 0, in_sync=True)
        for site_id, other in sorted(self.book.members.items()):
            if not other.in_sync:
                self._send_full(site_id)
        self._publish_status()

    def _on_update(self, peer: bytes, msg: Update) -> None:
        assert self.state is not None
        self._views[msg.site_id] = SiteView(
            msg.site_id, msg.step_seconds, msg.link_rtt_s, msg.link_goodput_bps
        )
        verdict = self.book.check_update(
            msg.site_id, msg.round_id, msg.fragment, msg.global_version
        )
        if isinstance(verdict, Refusal):
            self._reject(peer, verdict.code, verdict.detail, msg.site_id)
            return
        if not (np.isfinite(msg.weight) and msg.weight > 0 and np.isfinite(msg.train_loss)):
            self._reject(peer, ErrorCode.NON_FINITE, f"weight {msg.weight}", msg.site_id)
            return
        names = self._fragment_names[verdict.fragment]
        if self.cfg.secure_aggregation is not None:
            r = self.book.open_round(msg.round_id)
            assert r is not None  # a masked update is never admitted late
            self._on_masked_update(peer, msg, r, names)
            return
        try:
            delta = decode_tensors(msg.payload, {n: self.state.params[n].shape for n in names})
        except WireError as exc:
            self._reject(peer, exc.code, exc.detail, msg.site_id)
            return
        norm = global_norm(delta)
        if norm > self.cfg.max_update_norm:
            detail = f"update norm {norm:.3g} > bound {self.cfg.max_update_norm:.3g}"
            self._reject(peer, ErrorCode.BAD_PAYLOAD, detail, msg.site_id)
            return
        nbytes = sum(enc.nbytes for enc in msg.payload)
        raw = sum(4 * int(np.prod(enc.shape)) for enc in msg.payload)
        acc = _Accepted(
            msg.site_id,
            msg.round_id,
            msg.weight,
            delta,
            msg.train_loss,
            msg.compute_seconds,
            nbytes,
        )
        self.metrics.updates_accepted.labels(site=msg.site_id).inc()
        self.metrics.update_size.observe(nbytes)
        self.metrics.payload_bytes.labels(direction="in").inc(nbytes)
        self.metrics.payload_raw_bytes.labels(direction="in").inc(raw)
        now = self.clock()
        self.book.accept(now, msg.site_id, msg.round_id)
        if verdict.late:
            self._late[(msg.site_id, msg.round_id)] = acc
            self.metrics.late_updates.inc()
            log.info(
                "[coordinator site=%s round=%d] late update kept for the next sync of fragment %d",
                msg.site_id,
                msg.round_id,
                verdict.fragment,
            )
            return
        self._accepted.setdefault(msg.round_id, {})[msg.site_id] = acc
        self._arrived.setdefault(msg.round_id, {})[msg.site_id] = now
        log.info(
            "[coordinator site=%s round=%d] update accepted weight=%.0f loss=%.4f norm=%.4g",
            msg.site_id,
            msg.round_id,
            msg.weight,
            msg.train_loss,
            norm,
        )

    def _on_masked_update(self, peer: bytes, msg: Update, r: OpenRound, names: list[str]) -> None:
        """A masked update: checked for shape and attempt only (its values are hidden)."""
        assert self.state is not None and self.cfg.secure_aggregation is not None
        plan = self._masking[r.round_id]
        expected = {n: tuple(self.state.params[n].shape) for n in names}
        expected[WEIGHT_KEY] = (1,)
        dtype = self.cfg.secure_aggregation.dtype
        got = {enc.name: enc for enc in msg.payload}
        problem = ""
        if set(got) != set(expected):
            problem = f"masked tensors {sorted(got)[:3]}... do not match the fragment"
        elif any(
            e.meta.get("attempt") != plan.attempt or e.codec != "secagg" for e in got.values()
        ):
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
            self._reject(peer, ErrorCode.BAD_PAYLOAD, problem, msg.site_id)
            return
        self._masked.setdefault(r.round_id, {})[msg.site_id] = {
            name: np.asarray(enc.buffers[0]).reshape(expected[name]) for name, enc in got.items()
        }
        self._accepted.setdefault(r.round_id, {})[msg.site_id] = _Accepted(
            msg.site_id,
            r.round_id,
            msg.weight,
            {},
            msg.train_loss,
            msg.compute_seconds,
            sum(enc.nbytes for enc in msg.payload),
        )
        self.book.accept(self.clock(), msg.site_id, r.round_id)
        self.metrics.updates_accepted.labels(site=msg.site_id).inc()
        log.info(
            "[coordinator site=%s round=%d] masked update accepted (attempt %d)",
            msg.site_id,
            r.round_id,
            plan.attempt,
        )

    def _secagg_plan_message(self, plan: MaskingPlan) -> dict[str, Any]:
        return {
            "attempt": plan.attempt,
            "peers": {
                s: [p.session_public.hex(), p.static_public.decode() if p.static_public else ""]
                for s, p in sorted(plan.participants.items())
            },
        }

    def _rerun_or_abandon(self, now: float, r: OpenRound, received: tuple[str, ...]) -> None:
        """Secure aggregation with missing vectors: re-run with the survivors, or abandon."""
        assert self.cfg.secure_aggregation is not None and self.state is not None
        plan = self._masking[r.round_id]
        decision, why = decide_attempt(plan, received, self.cfg.secure_aggregation)
        if decision.action != "rerun" or decision.plan is None:
            self._abort(self.book.abort(f"secure aggregation: {why}"))
            return
        rerun = decision.plan
        self._masking[r.round_id] = rerun
        self._masked.pop(r.round_id, None)
        self._accepted.pop(r.round_id, None)
        survivors = tuple(sorted(rerun.participants))
        self.book.rerun(now, r.round_id, survivors)
        log.warning("[coordinator round=%d] secure aggregation: %s", r.round_id, why)
        prev = self._round_plan[r.round_id]
        for site_id in survivors:
            self._send(
                self.book.members[site_id].peer,
                RoundStart(
                    round_id=r.round_id,
                    global_version=self.state.global_version,
                    fragment_base_version=r.base_version,
                    fragment=r.fragment,
                    num_fragments=self.cfg.num_fragments,
                    num_inner_steps=0,
                    overlap=prev.overlap,
                    codec="secagg",
                    deadline_s=self.cfg.round_deadline_s,
                    participants=survivors,
                    evaluate=False,
                    reason=why,
                    secagg=self._secagg_plan_message(rerun),
                ),
            )

    def _on_eval(self, msg: Eval) -> None:
        if self.state is None:
            self.metrics.rejected.labels(reason="unexpected").inc()
            return
        if not np.isfinite(msg.val_loss):
            self.metrics.rejected.labels(reason="non_finite").inc()
            return
        if msg.global_version in self.state.val_losses:
            return
        val_losses = {**self.state.val_losses, msg.global_version: msg.val_loss}
        self.state = replace(self.state, val_losses=val_losses)
        self._persist(self.state, counter_only=True)
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
        m = self.book.leave(site_id)
        if m is not None and self.chan is not None:
            self.chan.forget(m.peer)
        self.metrics.members.set(len(self.book.members))

    # ---- the tick: decisions carried out ---------------------------------------------------

    def tick(self) -> None:
        now = self.clock()
        if now - self._status.published_at > 1.0:
            self._publish_status()
        if self.state is None:
            self._expire(now)
            if self._init_site is not None and self._init_site not in self.book.members:
                self._init_site = self._init_fingerprint = None
            return
        if self.finished:
            return
        if self._finish_started is not None:
            self._expire(now)
            self._maybe_finish(now)
            return
        # Several decisions can follow at once (remove a silent site, close r, open r+2).
        for _ in range(8):
            decision = self.book.tick(now)
            if decision is None:
                return
            if isinstance(decision, Remove):
                self._on_removed(decision)
            elif isinstance(decision, Open):
                self._open(now, decision)
            elif isinstance(decision, Close):
                self._close(now, decision)
            elif isinstance(decision, Rerun):
                self._rerun_or_abandon(now, decision.round, decision.received)
            elif isinstance(decision, Abort):
                self._abort(decision)
            else:
                log.info("[coordinator] finishing: %s", decision.why)
                self._finish_started = now
                self._maybe_finish(now)
                return

    def _expire(self, now: float) -> None:
        """Silent sites are removed also when no round can run (before init, while finishing)."""
        removed = self.book.expire(now)
        if removed is not None:
            self._on_removed(removed)

    def _on_removed(self, decision: Remove) -> None:
        for m in decision.members:
            log.warning("[coordinator site=%s] removed: %s", m.site_id, decision.why)
            self.metrics.site_timeouts.inc()
            if self.chan is not None:
                self.chan.forget(m.peer)
        self.metrics.members.set(len(self.book.members))

    def _abort(self, decision: Abort) -> None:
        """Every open round was cancelled: drop what they gathered and tell every member."""
        ids = decision.round_ids
        log.warning("[coordinator round=%d] aborted: %s; cancelling %s", ids[0], decision.why, ids)
        self.metrics.rounds_aborted.inc()
        for round_id in ids:
            self._accepted.pop(round_id, None)
            self._arrived.pop(round_id, None)
            self._masking.pop(round_id, None)
            self._masked.pop(round_id, None)
            self._round_plan.pop(round_id, None)
            self._round_bytes_at_open.pop(round_id, None)
        for m in self.book.members.values():
            self._send(m.peer, RoundCancel(round_ids=ids, reason=decision.why))

    def _schedule(self, now: float, participants: tuple[str, ...]) -> tuple[RoundPlan, str]:
        assert self.state is not None
        cfg = self.cfg
        policy = SchedulePolicy(
            num_inner_steps=cfg.num_inner_steps,
            num_fragments=cfg.num_fragments,
            overlap=cfg.overlap,
            target_utilization=cfg.target_utilization,
            sync_fraction=cfg.sync_fraction,
            ladder=cfg.codec_ladder,
            fixed_uplink=cfg.site_uplink_codecs,
            default_uplink=None if cfg.uplink_codec == "auto" else cfg.uplink_codec,
            fixed_downlink=None if cfg.downlink_codec == "auto" else cfg.downlink_codec,
            unmeasured_codec=cfg.unmeasured_codec,
            max_inner_steps=cfg.max_inner_steps,
            model_numel=sum(int(v.size) for v in self.state.params.values()),
            align_arrivals=cfg.align_arrivals,
        )
        views = [self._aligned_view(s) for s in participants]
        return plan_round(now, views, policy)

    def _measure_arrivals(self, round_id: int, merged: tuple[str, ...], plan: RoundPlan) -> None:
        """How early each on-time update of the closed round landed before its last one."""
        arrived = self._arrived.pop(round_id, {})
        on_time = {s: arrived[s] for s in merged if s in arrived}
        if not on_time:
            return
        last = max(on_time.values())
        early = {s: last - t for s, t in on_time.items()}
        self._early_s = early
        self._early_extra = {s: plan.extra_steps.get(s, 0) for s in early}
        self._early_round = round_id

    def _aligned_view(self, site_id: str) -> SiteView:
        """The site's measured view, with how early its update would land in the round being
        planned if it trained no extra steps there, judged from the latest closed round.

        Blocking rounds all start from the same result, so a round's earliness is its own: the
        measured one plus what that round's extra steps took. With overlap a site's slots follow
        each other, so earliness carries over: the measured one less what the extra steps of the
        rounds opened since will take."""
        view = self._views.get(site_id, SiteView(site_id))
        if site_id not in self._early_s or view.step_seconds <= 0:
            return view
        early = self._early_s[site_id]
        if not self.cfg.overlap:
            early += self._early_extra.get(site_id, 0) * view.step_seconds
            return replace(view, early_s=max(0.0, early))
        planned = sum(
            plan.extra_steps.get(site_id, 0)
            for round_id, plan in self._round_plan.items()
            if round_id > self._early_round
        )
        return replace(view, early_s=max(0.0, early - planned * view.step_seconds))

    def _open(self, now: float, decision: Open) -> None:
        assert self.state is not None and self.chan is not None
        round_id, participants, why = decision.round_id, decision.participants, decision.why
        fragment, base = decision.fragment, decision.base_version
        self.state = replace(self.state, round_counter=round_id)
        self._persist(self.state, counter_only=True)  # durable before announced: never reused
        plan, plan_why = self._schedule(now, participants)
        self._round_plan[round_id] = plan
        for site_id, steps in plan.extra_steps.items():
            self.metrics.extra_steps.labels(site=site_id).inc(steps)
        secagg: dict[str, Any] = {}
        if self.cfg.secure_aggregation is not None:
            missing = [s for s in participants if s not in self._secagg_peers]
            if missing:
                log.warning("[coordinator round=%d] no masking keys from %s", round_id, missing)
            masking = MaskingPlan(
                round_id=round_id,
                attempt=0,
                participants={s: self._secagg_peers[s] for s in participants if s not in missing},
            )
            self._masking[round_id] = masking
            secagg = self._secagg_plan_message(masking)
        self._round_bytes_at_open[round_id] = (
            self.chan.stats.bytes_received,
            self.chan.stats.bytes_sent,
        )
        evaluate_base = (
            not self.state.history and self.state.global_version not in self.state.val_losses
        )
        log.info(
            "[coordinator round=%d] open: %s; fragment %d/%d on v%d; plan: %s",
            round_id,
            why,
            fragment,
            self.cfg.num_fragments,
            base,
            plan_why,
        )
        for i, site_id in enumerate(participants):
            self._send(
                self.book.members[site_id].peer,
                RoundStart(
                    round_id=round_id,
                    global_version=self.state.global_version,
                    fragment_base_version=base,
                    fragment=fragment,
                    num_fragments=self.cfg.num_fragments,
                    num_inner_steps=plan.site_steps(site_id),
                    overlap=plan.overlap,
                    codec=plan.uplink[site_id],
                    deadline_s=self.cfg.round_deadline_s,
                    participants=participants,
                    evaluate=evaluate_base and i == 0 and len(self.book.open_rounds) == 1,
                    reason=plan_why,
                    secagg=secagg,
                ),
            )
        self._later(lambda: self.cfg.faults.point("open", round_id))

    def _is_last(self, completed_rounds: int) -> bool:
        """Whether ``completed_rounds`` reaches ``max_rounds`` (never when it is 0)."""
        return bool(self.cfg.max_rounds) and completed_rounds >= self.cfg.max_rounds

    def _close(self, now: float, decision: Close) -> None:
        assert self.state is not None and self.chan is not None
        r, merged = decision.round, decision.merged
        st = self.state
        names = self._fragment_names[r.fragment]
        accepted = self._accepted.pop(r.round_id, {})
        fresh = [accepted[s] for s in merged]
        late = [self._late.pop((u.site_id, u.round_id)) for u in decision.late]
        frags = self.cfg.num_fragments
        # A late update is merged once, down-weighted by how many syncs of its fragment it missed.
        updates = [(u.site_id, u.weight, u.delta) for u in fresh]
        for u in late:
            staleness = max(1, (r.round_id - u.round_id) // frags)
            updates.append((f"{u.site_id}@{u.round_id}", u.weight / (1 + staleness), u.delta))
        if self.cfg.secure_aggregation is not None:
            # Only the sum is ever seen: the weighted mean stands for the sites' updates.
            masked = self._masked.pop(r.round_id)
            masking = self._masking.pop(r.round_id)
            mean, total = unmask_mean(masked, masking, self.cfg.secure_aggregation)
            updates = [("secure-aggregate", total, mean)]
        exact_prev = {k: st.params[k] + st.residual[k] for k in names}
        plan = self._round_plan.pop(r.round_id)
        # Inner steps behind the model this round produces: every completed slot and this one.
        inner_steps = sum(int(h["num_inner_steps"]) for h in st.history) + plan.num_inner_steps
        # The run's last round: no round will start from what it produces. Only with one
        # fragment: with several, aborts shift which round is a fragment's last.
        final = self.cfg.outer_final_mean and frags == 1 and self._is_last(len(st.history) + 1)
        result = self.strategy.outer_step(
            exact_prev,
            {k: st.momentum[k] for k in names},
            updates,
            inner_steps=inner_steps,
            final=final,
        )
        delta = {k: result.params[k] - st.params[k] for k in names}
        encoded = encode_tensors(delta, get_codec(plan.downlink))
        decoded = decode_tensors(encoded)
        new_params, residual, momentum = dict(st.params), dict(st.residual), dict(st.momentum)
        for k in names:
            new_params[k] = st.params[k] + decoded[k]
            residual[k] = result.params[k] - new_params[k]
            momentum[k] = result.momentum[k]
        total_weight = sum(u.weight for u in fresh) or 1.0
        opened_in = self._round_bytes_at_open[r.round_id][0]
        entry: dict[str, Any] = {
            "round_id": r.round_id,
            "global_version": r.round_id,
            "base_version": st.global_version,
            "fragment": r.fragment,
            "num_fragments": frags,
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
            "compute_seconds_max": max((u.compute_seconds for u in fresh), default=0.0),
            "duration_s": now - r.opened_at,
            "finished_unix": time.time(),
            "wire_bytes_in": self.chan.stats.bytes_received - opened_in,
        }
        new_state = replace(
            st,
            params=new_params,
            momentum=momentum,
            residual=residual,
            global_version=r.round_id,
            history=(*st.history, entry),
        )
        self.state = new_state
        self._persist(new_state)  # durable before announced
        self._measure_arrivals(r.round_id, merged, plan)
        self._later(
            lambda: self._announce(
                _Announcement(
                    decision, new_state, st.global_version, encoded, delta, entry, result, late
                )
            )
        )

    def _announce(self, a: _Announcement) -> None:
        """Send a closed round's result (its state is durable) and account for it."""
        assert self.state is not None and self.chan is not None
        r, merged, why = a.decision.round, a.decision.merged, a.decision.why
        entry, result, late, encoded = a.entry, a.result, a.late, a.encoded
        self.cfg.faults.point("close", r.round_id)
        opened_out = self._round_bytes_at_open.pop(r.round_id)[1]
        digest = self._hash(a.state)
        in_sync = self.book.in_sync(a.base_version)
        last = a.decision.final
        wants_eval = r.round_id % self.cfg.eval_every_rounds == 0 or last
        # Ask a site that was on time: evaluating costs the evaluator some compute.
        candidates = [s for s in in_sync if s in merged] or in_sync
        evaluator = candidates[0] if candidates and wants_eval else None
        merged_all = tuple(merged) + tuple(f"{u.site_id}@{u.round_id}" for u in late)
        out_before = self.chan.stats.bytes_sent
        for site_id, m in sorted(self.book.members.items()):
            if site_id in in_sync:
                msg: Global = Global(
                    round_id=r.round_id,
                    base_version=a.base_version,
                    global_version=r.round_id,
                    fragment=r.fragment,
                    merged=merged_all,
                    is_full=False,
                    state_hash=digest,
                    signature=self._sign(r.round_id, a.base_version, r.fragment, digest),
                    evaluate=site_id == evaluator,
                    payload=encoded,
                )
            else:
                msg = self._full_global(a.state, r.round_id, wants_eval and evaluator is None)
            ok = self._send(m.peer, msg)
            self.book.holds(site_id, r.round_id, in_sync=ok)
        entry["wire_bytes_out"] = self.chan.stats.bytes_sent - opened_out
        entry["broadcast_bytes"] = self.chan.stats.bytes_sent - out_before
        payload_bytes = sum(enc.nbytes for enc in encoded)
        self.metrics.payload_bytes.labels(direction="out").inc(payload_bytes * len(in_sync))
        self.metrics.payload_raw_bytes.labels(direction="out").inc(
            sum(4 * v.size for v in a.delta.values()) * len(in_sync)
        )
        self.metrics.rounds.inc()
        self.metrics.round_duration.observe(entry["duration_s"])
        self.metrics.quorum_size.set(len(merged))
        self.metrics.outer_grad_norm.set(result.outer_grad_norm)
        self.metrics.train_loss.set(entry["train_loss"])
        self.metrics.global_version.set(r.round_id)
        log.info(
            "[coordinator round=%d] closed: %s; merged=%s late=%d loss=%.4f outer_norm=%.4g "
            "outer=%s %.1fs",
            r.round_id,
            why,
            merged,
            len(late),
            entry["train_loss"],
            result.outer_grad_norm,
            result.rule,
            entry["duration_s"],
        )
        self._publish_status()

    def _maybe_finish(self, now: float) -> None:
        assert self.state is not None and self._finish_started is not None
        have_final = self.state.global_version in self.state.val_losses
        if not have_final and now - self._finish_started < self.cfg.final_eval_wait_s:
            return
        for m in self.book.members.values():
            self._send(m.peer, Shutdown(reason=f"completed {len(self.state.history)} rounds"))
        self.finished = True
        self._publish_status()
        log.info("[coordinator] finished at v%d", self.state.global_version)

    # ---- status ----------------------------------------------------------------------------

    def _publish_status(self) -> None:
        if self.writer is not None and not self.writer.durable(self._barrier):
            return  # the status shows durable states only; the next tick publishes this one
        st = self.state
        chan = self.chan
        status: dict[str, Any] = {
            "session_id": self.session_id,
            "endpoint": self.endpoint,
            "finished": self.finished,
            "global_version": st.global_version if st else None,
            "round_counter": st.round_counter if st else 0,
            "rounds_completed": len(st.history) if st else 0,
            "members": sorted(self.book.members),
            "open_round": self.open_round.round_id if self.open_round else None,
            "open_rounds": [r.round_id for r in self.book.open_rounds],
            "val_losses": {str(k): v for k, v in sorted(st.val_losses.items())} if st else {},
            "history": list(st.history[-STATUS_HISTORY_TAIL:]) if st else [],
            "history_count": len(st.history) if st else 0,
            "wire_bytes_in": chan.stats.bytes_received if chan else 0,
            "wire_bytes_out": chan.stats.bytes_sent if chan else 0,
            "rejected": dict(chan.stats.rejected) if chan else {},
            "num_parameters": int(sum(v.size for v in st.params.values())) if st else 0,
        }
        self._status.publish(status)

    def status(self) -> dict[str, Any]:
        """The latest published status (safe to call from another thread)."""
        return self._status.get()
