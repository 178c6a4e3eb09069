"""The site's session with its coordinator: the link, who the site says it is when it joins, and
what the link's counters tell (acceptance, silences and drops, bytes, round trips, goodput).

The link (``comm.transport.dealer.SiteLink``) runs on its own thread, so heartbeats continue while
the site computes; this object is used from the agent's thread only. It decides nothing about
rounds: :meth:`Session.check_link` says when what was in flight may be lost, and the agent has it
sent again.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from comm.codecs.registry import get_codec
from comm.security.rolekits import SiteKit
from comm.transport.dealer import SiteLink
from comm.transport.profile import ChannelConfig
from comm.transport.stats import ChannelStats
from comm.wire.schema import (
    ERROR_MEANINGS,
    Error,
    ErrorCode,
    Heartbeat,
    InitParams,
    Join,
    Leave,
    Message,
    Welcome,
)
from comm.wire.tensors import encode_tensors
from site_agent.authwatch import AuthWatch
from site_agent.config import SiteConfig, resolve_device
from site_agent.exits import EXIT_AUTH_REFUSED
from site_agent.metrics import SiteMetrics
from site_agent.trainer import SiteTrainer

log = logging.getLogger("crossdc.site")

REJOIN_INTERVAL_S = 1.0
"""A site joins again at most this often when the coordinator says it does not know it (each
of the messages in flight then draws the same answer)."""


class ErrorResponse(enum.Enum):
    """What the site does about an error the coordinator sent."""

    CARRY_ON = "carry on"
    JOIN_AGAIN = "join again"
    """The coordinator does not know this site (it restarted, or timed the site out)."""
    STOP_FATAL = "stop, not worth a restart"
    """The coordinator refuses this site's model."""
    STOP_AUTH_REFUSED = "stop, the credentials are refused for good"


class CoordinatorLink(Protocol):
    """The site's end of its connection to the coordinator (``SiteLink``, or a test's script)."""

    @property
    def stats(self) -> ChannelStats: ...

    def send(self, msg: Message) -> None: ...

    def recv(self, timeout_s: float) -> Message | None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SiteIdentity:
    """What the coordinator compares at the join: the site, its job's factory and federated
    state, and how the site trains it."""

    site_id: str
    fingerprint: str
    capabilities: dict[str, Any]

    @classmethod
    def of(cls, cfg: SiteConfig, trainer: SiteTrainer) -> SiteIdentity:
        spec = trainer.state_spec()
        return cls(
            site_id=cfg.site_id,
            fingerprint=trainer.fingerprint(cfg.job.factory),
            capabilities={
                "job": cfg.job.factory,
                "state_spec": [[name, list(shape), dtype] for name, shape, dtype in spec],
                "averaged": trainer.buffer_names(),
                "stages": cfg.stages,
                "replicas": cfg.replicas,
                "device": resolve_device(cfg.device),
                "evaluates": trainer.evaluates,
            },
        )


def read_endpoint_file(path: str, timeout_s: float) -> str:
    """Wait for a local coordinator's ``endpoint.json`` and return the endpoint in it."""
    deadline = time.monotonic() + timeout_s
    p = Path(path)
    while True:
        if p.exists():
            try:
                endpoint = json.loads(p.read_text())["endpoint"]
                return str(endpoint).replace("0.0.0.0", "127.0.0.1")
            except (ValueError, KeyError):
                pass  # a half-written file from a non-atomic writer; retry
        if time.monotonic() > deadline:
            raise ValueError(f"site.coordinator_endpoint_file {path!r} did not appear")
        time.sleep(0.1)


class Session:
    """The link to the coordinator and what is known about it. ``start`` connects (unless a link
    was handed in), ``close`` disconnects."""

    def __init__(
        self,
        identity: SiteIdentity,
        *,
        channel: ChannelConfig,
        coordinator: str,
        endpoint_file: str,
        metrics: SiteMetrics,
        clock: Callable[[], float],
        heartbeat_version: Callable[[], int],
        link: CoordinatorLink | None = None,
        shards: tuple[str, ...] = (),
        shard_wait_s: float = 300.0,
    ) -> None:
        """``shards``: a sharded coordinator's endpoints, shard 0's first (``coordinator``);
        ``shard_wait_s``: ``site.shard_result_wait_s``."""
        self.identity = identity
        self.site_id = identity.site_id
        self._channel = channel
        self._coordinator, self._endpoint_file = coordinator, endpoint_file
        self._metrics = metrics
        self._clock = clock
        self._heartbeat_version = heartbeat_version
        self.link = link
        self._shards = shards
        self._shard_wait_s = shard_wait_s
        self.session_id = ""
        self.auth = AuthWatch()
        self._echoes_seen, self._last_echo_at = 0, clock()
        self._disconnects_seen = 0
        self._bytes_seen = (0, 0)
        self._last_join_at: float | None = None

    @classmethod
    def for_site(
        cls,
        cfg: SiteConfig,
        *,
        trainer: SiteTrainer,
        metrics: SiteMetrics,
        kit: SiteKit | None,
        clock: Callable[[], float],
        heartbeat_version: Callable[[], int],
        link: CoordinatorLink | None = None,
    ) -> Session:
        return cls(
            SiteIdentity.of(cfg, trainer),
            channel=dc_replace(cfg.channel, curve=kit.curve) if kit is not None else cfg.channel,
            coordinator=cfg.coordinator,
            endpoint_file=cfg.coordinator_endpoint_file,
            metrics=metrics,
            clock=clock,
            heartbeat_version=heartbeat_version,
            link=link,
            shards=cfg.coordinator_shards,
            shard_wait_s=cfg.shard_result_wait_s,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        """Connect (a link handed in is used as it is); returns the coordinator's endpoint."""
        if self.link is not None:
            return "the given link"
        endpoint = self._coordinator or read_endpoint_file(self._endpoint_file, timeout_s=120)
        if self._channel.curve is None:
            log.warning(
                "[site=%s] INSECURE MODE: no encryption, no authentication. "
                "For loopback experiments only.",
                self.site_id,
            )
        if self._shards:
            self.link = self._sharded_link()
            return ", ".join(self._shards)
        link = self._site_link(endpoint)
        link.start()
        self.link = link
        return endpoint

    def _site_link(self, endpoint: str) -> SiteLink:
        return SiteLink(
            self._channel,
            identity=self.site_id,
            endpoint=endpoint,
            heartbeat=lambda: Heartbeat(
                site_id=self.site_id,
                global_version=self._heartbeat_version(),
                sent_at=time.monotonic(),
            ),
            on_reject=lambda _p, code, _d: self._metrics.rejected(code.name.lower()),
        )

    def _sharded_link(self) -> CoordinatorLink:
        """One channel per shard of the coordinator, as one link (``site_agent.shard_links``),
        each shard sent its tensors of the model's cut (``comm.wire.partition``)."""
        from comm.wire.partition import partition
        from site_agent.shard_links import ShardedLink

        spec = {str(n): tuple(shape) for n, shape, _ in self.identity.capabilities["state_spec"]}
        links: list[SiteLink] = []
        try:
            for endpoint in self._shards:
                links.append(self._site_link(endpoint))
                links[-1].start()
        except BaseException:
            for started in links:
                started.close()
            raise
        parts = partition(spec, len(self._shards))
        return ShardedLink(links, parts, wait_s=self._shard_wait_s, clock=self._clock)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    # ---- messages --------------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        assert self.link is not None, "start() first"
        self.link.send(msg)

    def recv(self, timeout_s: float) -> Message | None:
        assert self.link is not None, "start() first"
        return self.link.recv(timeout_s)

    def join(self, *, global_version: int, state_hash: str, announce: Mapping[str, str]) -> None:
        """Join (or join again), announcing the site's capabilities and ``announce`` (what its
        payload form announces)."""
        self._last_join_at = self._clock()
        capabilities = {**self.identity.capabilities, **announce}
        self.send(
            Join(
                site_id=self.site_id,
                model_fingerprint=self.identity.fingerprint,
                global_version=global_version,
                state_hash=state_hash,
                capabilities=capabilities,
            )
        )

    def send_init(self, params: dict[str, np.ndarray]) -> None:
        """Hand a coordinator that holds no model yet this site's θ0."""
        payload = encode_tensors(params, get_codec("fp32"))
        self.send(
            InitParams(
                site_id=self.site_id, model_fingerprint=self.identity.fingerprint, payload=payload
            )
        )

    def leave(self, reason: str) -> None:
        self.send(Leave(site_id=self.site_id, reason=reason))

    # ---- what the coordinator and the link say ---------------------------------------------

    def accepted(self) -> None:
        """The coordinator accepted something of ours (anything but an error)."""
        self.auth.accepted()

    def welcomed(self, msg: Welcome) -> None:
        self.session_id = msg.session_id
        log.info(
            "[site=%s] welcomed by session %s (v%d)",
            self.site_id,
            msg.session_id,
            msg.global_version,
        )

    def on_error(self, msg: Error) -> ErrorResponse:
        try:
            code = ErrorCode(msg.code)
        except ValueError:
            log.warning("[site=%s] coordinator error %d: %s", self.site_id, msg.code, msg.detail)
            return ErrorResponse.CARRY_ON
        self._metrics.rejected(f"remote_{code.name.lower()}")
        if code is ErrorCode.NOT_JOINED:
            # Not again right after a join: the answers to what was sent before it say the same.
            last = self._last_join_at
            if last is not None and self._clock() - last <= REJOIN_INTERVAL_S:
                return ErrorResponse.CARRY_ON
            log.info("[site=%s] coordinator does not know us: joining again", self.site_id)
            return ErrorResponse.JOIN_AGAIN
        if code in (ErrorCode.MODEL_MISMATCH, ErrorCode.BAD_KEY):
            # Joining again would be refused the same way: another model, or secure
            # aggregation on at the coordinator and not here.
            log.error("[site=%s] %s", self.site_id, msg.detail)
            return ErrorResponse.STOP_FATAL
        if code is ErrorCode.UNAUTHENTICATED:
            return self._refused(msg.detail)
        log.warning(
            "[site=%s] coordinator rejected: %s (%s)",
            self.site_id,
            msg.detail,
            ERROR_MEANINGS[code],
        )
        return ErrorResponse.CARRY_ON

    def _refused(self, detail: str) -> ErrorResponse:
        """The coordinator refused our credentials: stop when that is final (revoked, expired,
        or refusals that persisted); otherwise warn once per run of refusals."""
        why = self.auth.refused(detail, self._clock())
        if why is not None:
            log.error(
                "[site=%s] the coordinator refuses this site's credentials (%s): %s; exiting "
                "with status %d (not restarted: renew or re-issue the site's kit)",
                self.site_id,
                why,
                detail,
                EXIT_AUTH_REFUSED,
            )
            return ErrorResponse.STOP_AUTH_REFUSED
        if self.auth.refusals == 1:
            log.warning("[site=%s] coordinator refused our credentials: %s", self.site_id, detail)
        return ErrorResponse.CARRY_ON

    def check_link(self) -> str | None:
        """Publish the link's counters; say why what was in flight may be lost (the connection
        dropped, or was silent for the heartbeat timeout, and is back), or None."""
        if self.link is None:
            return None
        stats = self.link.stats
        lost = None
        if stats.echoes_received != self._echoes_seen:
            self._echoes_seen = stats.echoes_received
            self.auth.accepted()  # the coordinator echoes only a member's heartbeats
            now = self._clock()
            # Only a dropped connection (reset, or given up after a silence as long as the
            # heartbeat timeout) can have lost what was in flight; a coordinator slow to echo
            # for a few seconds (busy, or starved of CPU) lost nothing, and resending would only
            # add bytes.
            silent_s = now - self._last_echo_at
            dropped = stats.disconnects != self._disconnects_seen
            self._disconnects_seen = stats.disconnects
            if dropped:
                lost = "the connection dropped"
            elif silent_s >= self._channel.heartbeat_timeout_s:
                lost = f"{silent_s:.1f}s of silence"
            self._last_echo_at = now
        sent, received = stats.bytes_sent, stats.bytes_received
        self._metrics.wire(sent - self._bytes_seen[0], received - self._bytes_seen[1])
        self._bytes_seen = (sent, received)
        # The channel's averages stay 0 until their first sample: not a measurement yet.
        rtt_s, goodput_bps = stats.rtt_s, stats.goodput_bps
        self._metrics.link(
            rtt_s=rtt_s,
            goodput_bytes_per_s=goodput_bps / 8.0,
            measured=rtt_s > 0 and goodput_bps > 0,
        )
        return lost

    def link_estimate(self) -> tuple[float, float]:
        """The link's measured round trip (s) and goodput (bits/s); 0 until measured."""
        if self.link is None:
            return 0.0, 0.0
        return self.link.stats.rtt_s, self.link.stats.goodput_bps

    def status(self) -> dict[str, Any]:
        stats = self.link.stats if self.link is not None else None
        return {
            "session_id": self.session_id,
            "link_rtt_s": stats.rtt_s if stats else 0.0,
            "link_goodput_bps": stats.goodput_bps if stats else 0.0,
            "wire_bytes_sent": stats.bytes_sent if stats else 0,
            "wire_bytes_received": stats.bytes_received if stats else 0,
        }
