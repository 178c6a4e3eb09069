"""The honest peers of ``crossdc bench fuzz --live`` (``crossdc.bench.fuzz_live`` runs them).

:class:`SiteThread` is the two honest sites, ``eu`` and ``us``, on their own CURVE connections in
a thread: ``eu`` uploads θ0, ``us`` proves it by hash, both answer every plan with an update
(no training) and heartbeat, so rounds close continuously. The attacker beside them is
``crossdc.bench.fuzz_live_peers``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from comm.codecs.registry import get_codec
from comm.security.rolekits import load_site_kit
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.schema import (
    Error,
    ErrorCode,
    Eval,
    Global,
    Heartbeat,
    InitParams,
    Join,
    Message,
    RoundStart,
    Update,
    Welcome,
)
from comm.wire.tensors import encode_tensors, state_hash

FINGERPRINT = "bench-fuzz-live"
SITES = ("eu", "us")
ANSWER_AFTER_S = 0.25
"""A simulated site answers a plan this long after it came: a few rounds a second, not hundreds."""


def code_name(code: int) -> str:
    try:
        return ErrorCode(code).name.lower()
    except ValueError:
        return str(code)


# --------------------------------------------------------------------------------------------
# The simulated sites


@dataclass
class SitesSeen:
    """What the sites' thread saw; written by that thread only."""

    rounds_closed: list[float] = field(default_factory=list)
    """When each round's result reached ``eu`` (monotonic)."""
    open_round: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    failure: str = ""


class SiteThread(threading.Thread):
    """``eu`` and ``us`` on their own CURVE connections, serving rounds until stopped."""

    def __init__(self, endpoint: str, kits: Path, params: dict[str, np.ndarray]) -> None:
        super().__init__(name="fuzz-live-sites", daemon=True)
        self.endpoint, self.kits, self.params = endpoint, kits, params
        self.seen = SitesSeen()
        self.stop = threading.Event()

    def run(self) -> None:
        chans: dict[str, DealerChannel] = {}
        try:
            for site in SITES:
                curve = load_site_kit(self.kits / f"kit-{site}", site_id=site).curve
                cfg = ChannelConfig(linger_s=0.1, curve=curve)
                chans[site] = DealerChannel(cfg, identity=site)
                chans[site].connect(self.endpoint)
            self._serve(chans)
        except Exception as exc:  # reported as the run's failure, not raised in a thread
            self.seen.failure = f"{type(exc).__name__}: {exc}"
        finally:
            for chan in chans.values():
                chan.close(flush_timeout_s=0)

    def _join(self, chans: dict[str, DealerChannel], site: str) -> None:
        first = site == SITES[0]
        chans[site].send(
            Join(
                site_id=site,
                model_fingerprint=FINGERPRINT,
                global_version=-1 if first else 0,
                state_hash="" if first else state_hash(self.params),
            )
        )

    def _serve(self, chans: dict[str, DealerChannel]) -> None:
        self._join(chans, SITES[0])
        joined: set[str] = set()
        plans: list[tuple[float, str, RoundStart]] = []
        beat_at = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= beat_at:
                beat_at = now + 1.0
                for site in joined:
                    chans[site].send(Heartbeat(site_id=site, global_version=0, sent_at=now))
            for site, chan in chans.items():
                msg = chan.recv(0.0)
                if msg is not None:
                    self._answer(chans, site, msg, joined, plans)
            for due, site, rs in [p for p in plans if p[0] <= now]:
                plans.remove((due, site, rs))
                chans[site].send(self._update(site, rs))
            time.sleep(0.002)

    def _answer(
        self,
        chans: dict[str, DealerChannel],
        site: str,
        msg: Message,
        joined: set[str],
        plans: list[tuple[float, str, RoundStart]],
    ) -> None:
        if isinstance(msg, Welcome):
            joined.add(site)
            if msg.need_init:
                payload = encode_tensors(self.params, get_codec("fp32"))
                chans[site].send(
                    InitParams(site_id=site, model_fingerprint=FINGERPRINT, payload=payload)
                )
            if site == SITES[0] and SITES[1] not in joined:
                self._join(chans, SITES[1])
        elif isinstance(msg, RoundStart):
            self.seen.open_round = max(self.seen.open_round, msg.round_id)
            plans.append((time.monotonic() + ANSWER_AFTER_S, site, msg))
        elif isinstance(msg, Global):
            if site == SITES[0]:
                self.seen.rounds_closed.append(time.monotonic())
            if msg.evaluate:
                chans[site].send(
                    Eval(site_id=site, global_version=msg.global_version, val_loss=1.0)
                )
        elif isinstance(msg, Error):
            self.seen.errors[f"{site}:{code_name(msg.code)}"] += 1
            if msg.code == ErrorCode.NOT_JOINED:
                joined.discard(site)
                self._join(chans, site)

    def _update(self, site: str, rs: RoundStart) -> Update:
        rng = np.random.default_rng(rs.round_id)
        delta = {
            k: (1e-3 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in self.params.items()
        }
        return Update(
            site_id=site,
            round_id=rs.round_id,
            global_version=rs.fragment_base_version,
            fragment=rs.fragment,
            weight=1.0,
            train_loss=1.0,
            compute_seconds=0.1,
            step_seconds=0.1,
            link_rtt_s=0.0,
            link_goodput_bps=0.0,
            payload=encode_tensors(delta, get_codec(rs.codec)),
        )
