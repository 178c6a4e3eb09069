"""Updates into the coordinator: each one validated (a global model to update, the site's
reported figures (``coordinator.reported``), round, fragment, shapes, norm bound; under secure
aggregation shape and attempt only, its values being hidden), told to the lifecycle, and folded
into its round's sum in the ledger. A refusal is an Error to the sender and a counter, never a
change of state: the planner learns a site's step time and link only from an update admitted to
its round.
"""

from __future__ import annotations

import logging

import numpy as np

from comm.security.masking import WEIGHT_KEY
from comm.wire.frames import WireError
from comm.wire.schema import ErrorCode, Update
from comm.wire.tensors import decode_tensors
from coordinator.config import CoordinatorConfig
from coordinator.decisions import UpdateRefusal
from coordinator.global_model import GlobalModel
from coordinator.ledger import Accepted, RoundLedger
from coordinator.lifecycle import Lifecycle
from coordinator.metrics import CoordinatorMetrics
from coordinator.planner import Planner
from coordinator.post import PostOffice
from coordinator.reported import check_reported
from coordinator.scheduler import SiteView
from coordinator.strategy import Arrays, global_norm

log = logging.getLogger("crossdc.coordinator")


class UpdateIntake:
    """``on_update`` for each Update from a member."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        *,
        book: Lifecycle,
        model: GlobalModel,
        ledger: RoundLedger,
        planner: Planner,
        post: PostOffice,
        metrics: CoordinatorMetrics,
    ) -> None:
        self._cfg = cfg
        self._book = book
        self._model = model
        self._ledger = ledger
        self._planner = planner
        self._post = post
        self._metrics = metrics

    def on_update(self, now: float, peer: bytes, msg: Update) -> None:
        if self._model.state is None:
            # A member may send anything; before θ0 exists no round is open to take it.
            detail = "no global model yet: the initial parameters come first"
            self._post.reject(peer, ErrorCode.UNEXPECTED, detail, msg.site_id)
            return
        verdict = check_reported(msg) or self._book.check_update(
            msg.site_id, msg.round_id, msg.fragment, msg.global_version
        )
        if isinstance(verdict, UpdateRefusal):
            self._post.reject(peer, verdict.code, verdict.detail, msg.site_id)
            return
        # The site's figures are finite and in range (coordinator.reported): the planner may
        # divide by them.
        self._planner.observe(
            SiteView(msg.site_id, msg.step_seconds, msg.link_rtt_s, msg.link_goodput_bps)
        )
        names = self._model.fragment_names[verdict.fragment]
        if self._cfg.secure_aggregation is not None:
            self._on_masked(now, peer, msg, names)
            return
        decoded = self._decode(peer, msg, names)
        if decoded is not None:
            self._record(
                now, msg, decoded[0], decoded[1], late=verdict.late, fragment=verdict.fragment
            )

    def _decode(self, peer: bytes, msg: Update, names: list[str]) -> tuple[Arrays, float] | None:
        """The update's tensors and their norm; None (and an Error to the site) when they do not
        decode into the fragment's shapes or exceed the norm bound."""
        st = self._model.state
        assert st is not None
        try:
            delta = decode_tensors(msg.payload, {n: st.params[n].shape for n in names})
        except WireError as exc:
            self._post.reject(peer, exc.code, exc.detail, msg.site_id)
            return None
        norm = global_norm(delta)
        if norm > self._cfg.max_update_norm:
            detail = f"update norm {norm:.3g} > bound {self._cfg.max_update_norm:.3g}"
            self._post.reject(peer, ErrorCode.BAD_PAYLOAD, detail, msg.site_id)
            return None
        return delta, norm

    def _accepted(self, msg: Update) -> Accepted:
        nbytes = sum(enc.nbytes for enc in msg.payload)
        self._metrics.updates_accepted.labels(site=msg.site_id).inc()
        return Accepted(
            msg.site_id,
            msg.round_id,
            msg.weight,
            msg.train_loss,
            msg.compute_seconds,
            nbytes,
            msg.payload if self._cfg.broadcast == "sparse" else (),
        )

    def _record(
        self, now: float, msg: Update, delta: Arrays, norm: float, *, late: bool, fragment: int
    ) -> None:
        """A validated update: counted, told to the lifecycle, folded into its round's sum (or,
        late, kept for its fragment's next sync)."""
        acc = self._accepted(msg)
        raw = sum(4 * int(np.prod(enc.shape)) for enc in msg.payload)
        self._metrics.update_size.observe(acc.nbytes)
        self._metrics.payload_bytes.labels(direction="in").inc(acc.nbytes)
        self._metrics.payload_raw_bytes.labels(direction="in").inc(raw)
        self._book.accept(now, msg.site_id, msg.round_id)
        if late:
            self._ledger.accept_late(acc, delta)
            self._metrics.late_updates.inc()
            log.info(
                "[coordinator site=%s round=%d] late update kept for the next sync of fragment %d",
                msg.site_id,
                msg.round_id,
                fragment,
            )
            return
        self._ledger.accept(acc, now, delta)
        log.info(
            "[coordinator site=%s round=%d] update accepted weight=%.0f loss=%.4f norm=%.4g",
            msg.site_id,
            msg.round_id,
            msg.weight,
            msg.train_loss,
            norm,
        )

    def _on_masked(self, now: float, peer: bytes, msg: Update, names: list[str]) -> None:
        """A masked update: checked for shape and attempt only (its values are hidden), then
        folded into the attempt's modular sum."""
        record = self._ledger.get(msg.round_id)
        assert record is not None and record.masking is not None  # never admitted late
        st, secagg = self._model.state, self._cfg.secure_aggregation
        assert st is not None and secagg is not None
        plan = record.masking
        expected = {n: tuple(st.params[n].shape) for n in names}
        expected[WEIGHT_KEY] = (1,)
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
                if len(enc.buffers) != 1 or enc.buffers[0].dtype != secagg.dtype:
                    problem = f"{name!r} is not one {secagg.dtype} buffer"
                elif tuple(enc.shape) != expected[name] or enc.buffers[0].size != int(
                    np.prod(expected[name])
                ):
                    problem = f"{name!r} has shape {enc.shape}, expected {expected[name]}"
                if problem:
                    break
        if problem:
            self._post.reject(peer, ErrorCode.BAD_PAYLOAD, problem, msg.site_id)
            return
        vectors = {
            name: np.asarray(enc.buffers[0]).reshape(expected[name]) for name, enc in got.items()
        }
        self._ledger.accept_masked(self._accepted(msg), vectors)
        self._book.accept(now, msg.site_id, msg.round_id)
        log.info(
            "[coordinator site=%s round=%d] masked update accepted (attempt %d)",
            msg.site_id,
            msg.round_id,
            plan.attempt,
        )
