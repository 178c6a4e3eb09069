"""The coordinator's log of broadcast deltas: chains that prove their start and bridge the gap,
bounded by a model's worth of bytes."""

from __future__ import annotations

import numpy as np
import pytest

from comm.codecs.floats import Fp32Codec
from comm.wire.schema import Global
from comm.wire.tensors import encode_tensors
from coordinator.deltalog import DeltaLog

pytestmark = pytest.mark.timeout(30)


def delta(base: int, version: int, numel: int = 4) -> Global:
    payload = encode_tensors({"w": np.full(numel, float(version), np.float32)}, Fp32Codec())
    return Global(
        round_id=version,
        base_version=base,
        global_version=version,
        fragment=0,
        merged=("eu",),
        is_full=False,
        state_hash=f"h{version}",
        signature=b"",
        evaluate=True,
        payload=payload,
    )


def test_a_chain_from_a_proven_version_to_the_target() -> None:
    log = DeltaLog(max_bytes=1000)
    log.start(0, "h0")
    for v in (1, 2, 4):  # round 3 aborted: version 4 builds on 2
        log.record(delta(v - 1 if v < 4 else 2, v))
    chain = log.chain(0, "h0", 4)
    assert chain is not None and [m.global_version for m in chain] == [1, 2, 4]
    assert not any(m.evaluate for m in chain)  # a replay asks for no evaluation
    got = log.chain(2, "h2", 4)
    assert got is not None and [m.global_version for m in got] == [4]
    assert log.chain(1, "h1", 2) is not None  # a target below the newest works too


@pytest.mark.parametrize(
    ("version", "digest", "target"),
    [
        (1, "not-h1", 2),  # the site's state is not the federation's v1
        (1, "", 2),  # no hash claimed
        (3, "h3", 4),  # v3 never existed
        (2, "h2", 2),  # nothing to catch up
        (0, "h0", 9),  # the log does not reach the target
    ],
)
def test_no_chain_without_proof_or_bridge(version: int, digest: str, target: int) -> None:
    log = DeltaLog(max_bytes=1000)
    log.start(0, "h0")
    for v in (1, 2, 4):
        log.record(delta(v - 1 if v < 4 else 2, v))
    assert log.chain(version, digest, target) is None


def test_the_log_keeps_at_most_a_models_worth_of_bytes() -> None:
    one = sum(e.nbytes for e in delta(0, 1).payload)
    log = DeltaLog(max_bytes=3 * one)
    log.start(0, "h0")
    for v in range(1, 7):
        log.record(delta(v - 1, v))
        assert log.nbytes <= 3 * one
    # The oldest went: v0..v2 cannot be bridged any more, v3 onward can.
    assert log.chain(0, "h0", 6) is None and log.chain(2, "h2", 6) is None
    chain = log.chain(3, "h3", 6)
    assert chain is not None and [m.global_version for m in chain] == [4, 5, 6]


def test_a_delta_that_does_not_follow_the_log_restarts_the_chain() -> None:
    log = DeltaLog(max_bytes=1000)
    log.start(5, "h5")
    log.record(delta(7, 8))  # after a gap the log cannot vouch for v7
    assert log.chain(7, "h7", 8) is None
    log.record(delta(8, 9))
    chain = log.chain(8, "h8", 9)
    assert chain is not None and [m.global_version for m in chain] == [9]
