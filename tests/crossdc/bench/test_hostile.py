"""``crossdc bench hostile``'s attacks against an in-process coordinator with a key kit (CURVE,
certificates, ZAP) and secure aggregation: each attacker is a certified site of its own, and
what the bench reports as refused is what the coordinator answered or logged about it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from comm.security.kits import init_kit, issue_site
from comm.security.rolekits import SecurityConfig
from coordinator.service import InitialModel
from crossdc.bench.hostile import longest_gap
from crossdc.bench.hostile_attacks import (
    AttackEnv,
    crash,
    decompression_bomb,
    held_behind_gap,
    never_joins,
    secagg_zero_key,
)
from tests.support.coordinator import PARAMS, running

pytestmark = pytest.mark.timeout(120)

FINGERPRINT = "bench-hostile-test"
SITES = ("hx-bomb", "hx-crash", "hx-secagg", "hx-gap", "hx-nojoin")


@pytest.fixture
def env(tmp_path: Path) -> Iterator[AttackEnv]:
    kit = init_kit(tmp_path / "kit")
    for site in SITES:
        issue_site(kit, site, 1, out_dir=tmp_path / f"kit-{site}")
    log_path = tmp_path / "coordinator.log"
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    loggers = [logging.getLogger(name) for name in ("comm", "crossdc", "coordinator")]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    stop = threading.Event()
    with running(
        security=SecurityConfig(kit_dir=str(kit)),
        secure_aggregation={"clip_bound": 64.0},
        initial=InitialModel(PARAMS, FINGERPRINT),
    ) as h:
        loop = threading.Thread(target=h.coord.run, args=(stop,), daemon=True)
        loop.start()
        try:
            yield AttackEnv(
                endpoint=h.coord.endpoint,
                workdir=tmp_path,
                coordinator_log=log_path,
                fingerprint=FINGERPRINT,
                secure_aggregation=True,
                open_round=lambda: 0,
                deadline=time.monotonic() + 60.0,
            )
        finally:
            stop.set()
            loop.join(timeout=10)
            for lg in loggers:
                lg.removeHandler(handler)
            handler.close()


def test_each_attack_is_refused_by_name(env: AttackEnv) -> None:
    outcomes = {
        o.name: o
        for attack in (decompression_bomb, crash, secagg_zero_key, held_behind_gap, never_joins)
        for o in attack(env)
    }
    assert set(outcomes) == {
        "decompression_bomb_index",
        "decompression_bomb_header",
        "crash_rtt_inf",
        "crash_step_5e-324",
        "crash_round_not_open",
        "secagg_zero_key",
        "held_behind_gap",
        "never_joins",
    }
    not_refused = {n: o.cause for n, o in outcomes.items() if not o.refused}
    assert not not_refused
    assert outcomes["decompression_bomb_index"].cause.startswith("malformed")
    assert outcomes["crash_rtt_inf"].cause.startswith("non_finite")
    assert outcomes["crash_step_5e-324"].cause.startswith("out_of_range")
    assert outcomes["crash_round_not_open"].cause.startswith("stale_round")
    assert outcomes["secagg_zero_key"].cause.startswith("bad_key")
    assert outcomes["held_behind_gap"].cause.startswith("oversize")
    assert "not_joined" in outcomes["never_joins"].cause


def test_an_attack_not_refused_says_so(env: AttackEnv) -> None:
    plain = AttackEnv(**{**env.__dict__, "secure_aggregation": False})
    (outcome,) = secagg_zero_key(plain)
    assert not outcome.refused
    assert outcome.cause.startswith("not applicable")


def test_the_longest_gap_counts_a_phase_that_closed_nothing() -> None:
    assert longest_gap([1.0, 2.0, 4.0], 1.5, 5.0) == 2.0
    assert longest_gap([1.0], 2.0, 10.0) == 9.0
    assert longest_gap([], 2.0, 10.0) == 8.0
