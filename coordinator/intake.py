"""Messages from sites into the coordinator: joins, the initial model, updates, evaluations,
sync requests and leaves.

:class:`Intake` authenticates each message (CURVE mode: the connection's certificate must name
the site), refreshes the member in the :class:`~coordinator.membership.Membership`, and handles
it. A join from a second connection for a member whose connection is alive is refused and the
member kept (:mod:`coordinator.conflicts` counts and logs the conflict); a join the federation's
aggregator cannot take (``Aggregator.check_join``) is refused with ``BAD_KEY``. It owns what
sites said at their join (the version and hash they hold) and who was asked for the initial
model. An update's reported figures are checked (:mod:`coordinator.reported`), then its round takes it
(``Lifecycle.take`` -> ``Round.take``: round, fragment, duplicate, then the aggregator's checks of
the payload, then the fold); the planner learns a site's step time and link only from an update
its round accepted. A refusal is an Error to the sender and a counter, never a change of state.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from comm.codecs.base import EncodedTensor
from comm.security.common import AuthError
from comm.wire.frames import WireError
from comm.wire.schema import (
    ERROR_MEANINGS,
    Error,
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
from comm.wire.tensors import check_slices, decode_tensors
from coordinator.aggregate import Aggregator
from coordinator.allowance import hold_update
from coordinator.conflicts import ClaimVerdict, IdentityConflicts
from coordinator.delivery import Delivery
from coordinator.global_model import GlobalModel
from coordinator.lifecycle import Lifecycle
from coordinator.membership import Member, Membership
from coordinator.metrics import CoordinatorMetrics
from coordinator.model_spec import (
    averaged_difference,
    first_difference,
    spec_from_capabilities,
    spec_from_params,
)
from coordinator.planner import Planner
from coordinator.post import PostOffice
from coordinator.reported import check_reported
from coordinator.round import Taken, UpdateRefusal
from coordinator.scheduler import SiteView

log = logging.getLogger("crossdc.coordinator")

MAX_EVAL_METRICS = 32
INITIAL_MODEL_CODECS = frozenset({"fp32"})


class Intake:
    """``handle(peer, msg)`` for every message the socket delivers."""

    def __init__(
        self,
        *,
        session_id: str,
        heartbeat_interval_s: float,
        clock: Callable[[], float],
        members: Membership,
        rounds: Lifecycle,
        model: GlobalModel,
        post: PostOffice,
        delivery: Delivery,
        planner: Planner,
        aggregator: Aggregator,
        conflicts: IdentityConflicts,
        metrics: CoordinatorMetrics,
        on_leave: Callable[[str], None],
        on_changed: Callable[[], None],
    ) -> None:
        self._session_id = session_id
        self._heartbeat_interval_s = heartbeat_interval_s  # told to each site at its join
        self._clock = clock
        self._members = members
        self._rounds = rounds
        self._model = model
        self._post = post
        self._delivery = delivery
        self._planner = planner
        self._aggregator = aggregator
        self._conflicts = conflicts
        self._metrics = metrics
        self._on_leave = on_leave
        self._on_changed = on_changed  # a state worth publishing (the model, a validation)
        self.on_update: Callable[[Update, str | None], None] | None = None
        """A coordinator of several shards: told of every update to an open round, with why it
        was refused (None: taken), so that shard 0 learns which parts every shard holds."""
        self.on_initial: Callable[[bytes, str, dict[str, np.ndarray], str], None] | None = None
        """A coordinator of several shards: handed θ0's part a site uploaded (checked, not
        installed) with the site's id and model fingerprint; the shard installs it
        (:meth:`install_initial`) once shard 0 checked every shard's part."""
        self.any_initiator = False
        """A shard other than shard 0 takes θ0's part from whichever member uploads it (shard
        0 asked that site, and its Welcome is the one the site follows)."""
        self.claims: dict[str, tuple[int, str]] = {}
        """What each member said it holds at its join (version, state hash): before the initial
        model exists, a site that built the same θ0 is in sync once it does."""
        self._init_site: str | None = None
        self._init_fingerprint: str | None = None
        self._left: dict[str, bytes] = {}
        """The connection each site that left said LEAVE on, until it joins again."""

    def forget(self, site_id: str) -> None:
        """Everything kept about a member that left or was removed."""
        self.claims.pop(site_id, None)
        self._conflicts.forget(site_id)
        self._aggregator.forget(site_id)
        self._planner.forget(site_id)

    def initiator_gone(self) -> None:
        """Before θ0 exists: the site asked for it left, so the next one to join is asked."""
        if self._init_site is not None and self._init_site not in self._members:
            self._init_site = self._init_fingerprint = None
            self._model.spec = None

    # ---- dispatch --------------------------------------------------------------------------

    def handle(self, peer: bytes, msg: Message) -> None:
        self._metrics.wire_bytes.labels(direction="in").inc(0)  # label exists from the start
        if isinstance(msg, Join):
            self._on_join(peer, msg)
            return
        if not isinstance(msg, Heartbeat | InitParams | Update | Eval | SyncRequest | Leave):
            self._post.reject(peer, ErrorCode.UNEXPECTED, f"{type(msg).__name__} is not for me")
            return
        if isinstance(msg, Heartbeat) and self._left.get(msg.site_id) == peer:
            # A site that left asks for the acknowledgement of its LEAVE: the echo carries it,
            # while its certificate is still good.
            if self._authentic(peer, msg.site_id):
                self._post.send(peer, msg)
            return
        if self._member_for(peer, msg.site_id) is None:
            if isinstance(msg, Update) and self.on_update is not None:
                # Refused unread: this process never folds this part (a shard's round is void
                # for the site on every shard).
                self.on_update(msg, f"site {msg.site_id!r} must join")
            return
        if isinstance(msg, Heartbeat):
            self._post.send(peer, msg)  # echoed: the site measures its round trip
        elif isinstance(msg, InitParams):
            self._on_init(peer, msg)
        elif isinstance(msg, Update):
            self._on_update(peer, msg)
        elif isinstance(msg, Eval):
            self._on_eval(msg)
        elif isinstance(msg, SyncRequest):
            if self._model.state is not None:
                self._members.holds(msg.site_id, -1, in_sync=False)
                self._delivery.send_full(msg.site_id)
        else:
            log.info("[coordinator site=%s] left: %s", msg.site_id, msg.reason)
            self._left[msg.site_id] = peer
            self._on_leave(msg.site_id)

    def _authentic(self, peer: bytes, site_id: str) -> bool:
        """CURVE mode: the connection's certificate must be valid now and name ``site_id``."""
        registry = self._post.registry
        if registry is None:
            return True
        identity = self._post.identity(peer)
        try:
            if identity is None:
                raise AuthError("unknown_key", "no certified identity on this connection")
            registry.check_peer(
                user_id=identity.site_id,
                serial=identity.serial,
                claimed_site_id=site_id,
                now=time.time(),
            )
        except AuthError as exc:
            self._post.reject(
                peer, ErrorCode.UNAUTHENTICATED, exc.detail, site_id, reason=exc.reason
            )
            return False
        return True

    def _member_for(self, peer: bytes, site_id: str) -> Member | None:
        if not self._authentic(peer, site_id):
            return None
        now, before = self._clock(), self._members.get(site_id)
        m = self._members.touch(now, site_id, peer)
        if m is None:
            self._post.reject(peer, ErrorCode.NOT_JOINED, f"site {site_id!r} must join", site_id)
        elif before is not None:
            self._conflicts.heard_from(m)
        return m

    # ---- joins and the initial model -------------------------------------------------------

    def _refuse_other_model(self, peer: bytes, msg: Join) -> bool:
        """A site whose model is not the federation's is refused, naming the first difference;
        so is one that would average other tensors than the federation's first join declared."""
        st = self._model.state
        fingerprint = st.model_fingerprint if st else self._init_fingerprint
        declared = spec_from_capabilities(msg.capabilities)
        if fingerprint is None or msg.model_fingerprint == fingerprint:
            if self._model.spec is None:
                self._model.spec = declared
                return False
            differs = averaged_difference(declared, self._model.spec) if declared else None
            if differs is None:
                return False
            self._post.reject(peer, ErrorCode.MODEL_MISMATCH, differs, msg.site_id)
            return True
        known = self._model.spec or (spec_from_params(st.params) if st else None)
        why = f": {first_difference(declared, known)}" if declared and known else ""
        self._post.reject(
            peer,
            ErrorCode.MODEL_MISMATCH,
            f"site model {msg.model_fingerprint} != federation model {fingerprint}{why}",
            msg.site_id,
        )
        return True

    def _admit(self, peer: bytes, site_id: str, old: Member | None) -> bool:
        """Whether a join of ``site_id`` from ``peer`` may take the member's place: not while
        another connection holds the site id and is alive (``coordinator.conflicts``). Whether
        it still is, the socket answers: a message to it fails once it is closed."""
        now = self._clock()
        verdict, why = self._conflicts.judge(now, old, peer)
        if verdict is ClaimVerdict.SAME:
            assert old is not None
            self._conflicts.heard_from(old)
        elif verdict is not ClaimVerdict.NEW:
            assert old is not None
            if verdict is ClaimVerdict.CONTESTED:
                detail = (
                    f"another connection claimed site {site_id!r} and was refused: this one is "
                    "kept. If this site's agent runs only here, its key is in other hands"
                )
                notice = Error(
                    code=int(ErrorCode.UNEXPECTED),
                    detail=f"{ERROR_MEANINGS[ErrorCode.UNEXPECTED]}: {detail}",
                )
                if self._post.probe(old.peer, notice):
                    self._conflicts.claimed(now, site_id, peer)
                    detail = f"site {site_id!r} is held by another connection: {why}"
                    self._post.reject(
                        peer, ErrorCode.UNAUTHENTICATED, detail, site_id, "identity_conflict"
                    )
                    return False
                why = "its connection is closed"
            log.info(
                "[coordinator site=%s] %s replaces %s: %s",
                site_id,
                self._post.describe(peer),
                self._post.describe(old.peer),
                why,
            )
        self._conflicts.forget(site_id)
        self._conflicts.watch(site_id)
        return True

    def _on_join(self, peer: bytes, msg: Join) -> None:
        if not self._authentic(peer, msg.site_id):
            return
        try:
            self._aggregator.check_join(msg)
        except ValueError as exc:
            self._post.reject(peer, ErrorCode.BAD_KEY, str(exc), msg.site_id)
            return
        old = self._members.get(msg.site_id)
        if not self._admit(peer, msg.site_id, old) or self._refuse_other_model(peer, msg):
            return
        if old is not None and old.peer != peer:
            self._post.forget(old.peer)
        st = self._model.state
        in_sync = (
            st is not None
            and msg.global_version == st.global_version
            and msg.state_hash == self._model.site_hash()
        )
        self._aggregator.joined(peer, msg)
        self._left.pop(msg.site_id, None)
        self._rounds.rejoined(msg.site_id)
        self._members.join(
            self._clock(),
            msg.site_id,
            peer,
            in_sync_version=msg.global_version if in_sync else None,
            evaluates=msg.capabilities.get("evaluates", True) is not False,
        )
        self.claims[msg.site_id] = (msg.global_version, msg.state_hash)
        self._metrics.joins.inc()
        self._metrics.members.set(len(self._members))
        need_init = False
        if st is None and (self._init_site is None or self._init_site not in self._members):
            self._init_site, self._init_fingerprint = msg.site_id, msg.model_fingerprint
            need_init = True
        log.info(
            "[coordinator site=%s] joined version=%d in_sync=%s need_init=%s",
            msg.site_id,
            msg.global_version,
            in_sync,
            need_init,
        )
        welcome = Welcome(
            site_id=msg.site_id,
            session_id=self._session_id,
            global_version=st.global_version if st else -1,
            heartbeat_interval_s=self._heartbeat_interval_s,
            need_init=need_init,
        )
        self._post.send(peer, welcome)
        if st is not None and not in_sync:
            self._delivery.send_catch_up(msg.site_id, msg.global_version, msg.state_hash)

    def _on_init(self, peer: bytes, msg: InitParams) -> None:
        asked = msg.site_id == self._init_site or self.any_initiator
        if self._model.state is not None or not asked:
            self._post.reject(
                peer, ErrorCode.UNEXPECTED, "initial parameters not requested", msg.site_id
            )
            return
        try:
            # θ0 has no shapes to check against: only fp32 (what sites send), whose decoded
            # size is the size received.
            params = received_model(msg.payload)
        except WireError as exc:
            self._post.reject(peer, exc.code, exc.detail, msg.site_id)
            return
        if self.on_initial is not None:
            self.on_initial(peer, msg.site_id, params, msg.model_fingerprint)
            return
        self.install_initial(msg.site_id, params, msg.model_fingerprint)

    def install_initial(
        self, site_id: str, params: dict[str, np.ndarray], fingerprint: str
    ) -> None:
        """θ0 as site ``site_id`` uploaded it (checked): the model's version 0; every member
        that proved it holds the same is in sync, every other one is sent it."""
        # The state holds the tensors where they arrived (θ0 is not held twice).
        self._model.install(params, fingerprint, owned=True)
        self._rounds.set_model(0)
        self._members.holds(site_id, 0, in_sync=True)
        digest = self._model.site_hash()
        for member, other in sorted(self._members.items()):
            if other.in_sync:
                continue
            if self.claims.get(member) == (0, digest):
                # It built the same θ0 from the federation's seed and proved it by hash at its
                # join: nothing to download.
                self._members.holds(member, 0, in_sync=True)
            else:
                self._delivery.send_full(member)
        self._on_changed()

    # ---- updates ---------------------------------------------------------------------------

    def _take(self, peer: bytes, msg: Update) -> UpdateRefusal | Taken:
        """The update to its round (``Lifecycle.take``). Where the rounds hold updates as they
        came, its encoded bytes are charged to its sender's account from now until its round
        lets go of them (``coordinator.allowance``): past the sender's allowance it is refused
        (``oversize``, counted as ``update_over_allowance``) and nothing changes."""
        chan = self._post.chan
        if not self._aggregator.holds_updates or chan is None:
            return self._rounds.take(self._clock(), msg)
        try:
            charge = hold_update(chan.charges, peer, sum(enc.nbytes for enc in msg.payload))
        except WireError as exc:
            return UpdateRefusal(exc.code, exc.detail, reason="update_over_allowance")
        return self._rounds.take(self._clock(), msg, charge)

    def _on_update(self, peer: bytes, msg: Update) -> None:
        """An update, to its round (``Lifecycle.take``); counted and logged once taken."""
        if self._model.state is None:
            # A member may send anything; before θ0 exists no round is open to take it.
            detail = "no global model yet: the initial parameters come first"
            self._post.reject(peer, ErrorCode.UNEXPECTED, detail, msg.site_id)
            return
        cpu = time.thread_time()
        taken = check_reported(msg) or self._take(peer, msg)
        if self.on_update is not None and (isinstance(taken, UpdateRefusal) or not taken.late):
            self.on_update(msg, taken.detail if isinstance(taken, UpdateRefusal) else None)
        if isinstance(taken, UpdateRefusal):
            self._post.reject(peer, taken.code, taken.detail, msg.site_id, reason=taken.reason)
            return
        self._metrics.fold_cpu_seconds.inc(time.thread_time() - cpu)
        self._metrics.fold_parameter_updates.inc(sum(enc.numel for enc in msg.payload))
        # The site's figures are finite and in range (coordinator.reported): the planner may
        # divide by them.
        self._planner.observe(
            SiteView(msg.site_id, msg.step_seconds, msg.link_rtt_s, msg.link_goodput_bps)
        )
        m, nbytes = self._metrics, taken.update.nbytes
        m.updates_accepted.labels(site=msg.site_id).inc()
        m.update_size.observe(nbytes)
        m.payload_bytes.labels(direction="in").inc(nbytes)
        m.payload_raw_bytes.labels(direction="in").inc(
            sum(4 * int(np.prod(enc.shape)) for enc in msg.payload)
        )
        if taken.late:
            m.late_updates.inc()
            log.info(
                "[coordinator site=%s round=%d] late update kept for the next sync of fragment %d",
                msg.site_id,
                msg.round_id,
                msg.fragment,
            )
            return
        log.info(
            "[coordinator site=%s round=%d] update accepted weight=%.0f loss=%.4f %s",
            msg.site_id,
            msg.round_id,
            msg.weight,
            msg.train_loss,
            taken.note,
        )

    # ---- evaluations -----------------------------------------------------------------------

    def _on_eval(self, msg: Eval) -> None:
        st = self._model.state
        if st is None:
            self._metrics.rejected.labels(reason="unexpected").inc()
            return
        if not np.isfinite(msg.val_loss):
            self._metrics.rejected.labels(reason="non_finite").inc()
            return
        metrics = eval_metrics(msg.metrics)
        if metrics is None:
            self._metrics.rejected.labels(reason="malformed").inc()
            log.warning("[coordinator site=%s] Eval with bad metrics ignored", msg.site_id)
            return
        if not self._model.record_eval(msg.global_version, msg.val_loss, metrics):
            return
        if msg.global_version == st.global_version:
            self._metrics.val_loss.set(msg.val_loss)
        log.info(
            "[coordinator site=%s] val_loss=%.4f at v%d",
            msg.site_id,
            msg.val_loss,
            msg.global_version,
        )
        self._on_changed()


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


def received_model(payload: Sequence[EncodedTensor]) -> dict[str, np.ndarray]:
    """θ0's tensors, checked as :func:`~comm.wire.tensors.decode_tensors` checks an fp32
    payload (each tensor named once, whole, fp32, finite): a tensor that arrived as one
    writable float32 buffer of its size (a message reassembled from chunks) is that buffer,
    reshaped, where it lies; any other is decoded into a new array. Raises
    :class:`WireError` naming the first tensor wrong."""
    out: dict[str, np.ndarray] = {}
    for name, pieces in check_slices(payload, None).items():
        view = _received_view(pieces[0])
        if view is None:
            out[name] = decode_tensors(pieces, codecs=INITIAL_MODEL_CODECS)[name]
        elif not np.isfinite(view).all():
            raise WireError(ErrorCode.NON_FINITE, f"{name!r} holds NaN or Inf")
        else:
            out[name] = view
    return out


def _received_view(enc: EncodedTensor) -> np.ndarray | None:
    """``enc``'s values as the state may keep them without a copy: its one buffer when that is
    writable, contiguous native float32 of the tensor's size, with nothing to decode; None
    otherwise."""
    if enc.codec not in INITIAL_MODEL_CODECS or enc.rows is not None or enc.meta:
        return None
    if len(enc.buffers) != 1 or any(int(d) < 0 for d in enc.shape):
        return None
    buf = enc.buffers[0]
    if (
        not isinstance(buf, np.ndarray)
        or buf.dtype != np.dtype(np.float32)
        or not buf.dtype.isnative
        or not buf.flags.writeable
        or not buf.flags.c_contiguous
        or buf.size != enc.numel
    ):
        return None
    return buf.reshape(enc.shape)
