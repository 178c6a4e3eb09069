"""The coordinator's log of broadcast deltas: chains that prove their start and bridge the gap,
bounded by a model's worth of bytes."""

from __future__ import annotations

from pathlib import Path

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


def durable(tmp_path: Path, versions: range) -> DeltaLog:
    log = DeltaLog(max_bytes=1000, directory=tmp_path / "deltas")
    log.start(0, "h0")
    for v in versions:
        log.record(delta(v - 1, v))
    return log


def test_a_durable_log_resumes_the_chain_that_ends_at_the_resumed_version(
    tmp_path: Path,
) -> None:
    durable(tmp_path, range(1, 5))
    again = DeltaLog(max_bytes=1000, directory=tmp_path / "deltas")
    again.resume(4, "h4")
    chain = again.chain(0, "h0", 4)
    assert chain is not None and [m.global_version for m in chain] == [1, 2, 3, 4]
    assert chain[0].payload[0].buffers[0].tobytes() == delta(0, 1).payload[0].buffers[0].tobytes()
    assert again.nbytes == durable(tmp_path / "same", range(1, 5)).nbytes
    again.record(delta(4, 5))  # and goes on from there
    chain = again.chain(2, "h2", 5)
    assert chain is not None and [m.global_version for m in chain] == [3, 4, 5]


def test_deltas_past_the_resumed_version_are_dropped(tmp_path: Path) -> None:
    """A crash after the broadcast of v4 but before its checkpoint: the coordinator resumes v3."""
    durable(tmp_path, range(1, 5))
    again = DeltaLog(max_bytes=1000, directory=tmp_path / "deltas")
    again.resume(3, "h3")
    chain = again.chain(1, "h1", 3)
    assert chain is not None and [m.global_version for m in chain] == [2, 3]
    assert again.chain(3, "h3", 4) is None
    assert sorted(p.name for p in (tmp_path / "deltas").glob("d-*")) == [
        "d-00000000.msg",
        "d-00000001.msg",
        "d-00000002.msg",
    ]


@pytest.mark.parametrize("damage", ["other_model", "truncated", "garbage_start", "gap"])
def test_a_durable_log_that_cannot_be_trusted_starts_again(tmp_path: Path, damage: str) -> None:
    durable(tmp_path, range(1, 5))
    d = tmp_path / "deltas"
    digest = "h4"
    if damage == "other_model":
        digest = "not-h4"  # the resumed state is not the one the log leads to
    elif damage == "truncated":
        path = d / "d-00000002.msg"
        path.write_bytes(path.read_bytes()[:-3])
    elif damage == "garbage_start":
        (d / "start.json").write_text("[1, 2]")
    else:
        (d / "d-00000001.msg").unlink()
    again = DeltaLog(max_bytes=1000, directory=d)
    again.resume(4, digest)
    assert again.chain(0, "h0", 4) is None and again.nbytes == 0
    assert not list(d.glob("d-*.msg"))
    again.record(delta(4, 5))
    chain = again.chain(4, digest, 5)
    assert chain is not None and [m.global_version for m in chain] == [5]


def test_dropping_the_oldest_delta_removes_its_file(tmp_path: Path) -> None:
    one = sum(e.nbytes for e in delta(0, 1).payload)
    log = DeltaLog(max_bytes=2 * one, directory=tmp_path / "deltas")
    log.start(0, "h0")
    for v in range(1, 5):
        log.record(delta(v - 1, v))
    assert sorted(p.name for p in (tmp_path / "deltas").glob("d-*")) == [
        "d-00000002.msg",
        "d-00000003.msg",
    ]


def test_a_durable_log_keeps_its_deltas_on_disk_and_a_catch_up_reads_them_back(
    tmp_path: Path,
) -> None:
    log = durable(tmp_path, range(1, 4))
    d = tmp_path / "deltas"
    # What a catch-up gets is what the files hold: rewrite one file with the same delta but
    # other values (its versions, hash and size as recorded) and the chain carries those.
    other = DeltaLog(max_bytes=1000, directory=tmp_path / "other")
    other.start(0, "h0")
    other.record(delta(0, 1))
    changed = delta(1, 2)
    changed.payload[0].buffers[0][:] = 42.0
    other.record(changed)
    (d / "d-00000001.msg").write_bytes((tmp_path / "other" / "d-00000001.msg").read_bytes())
    chain = log.chain(0, "h0", 3)
    assert chain is not None and [m.global_version for m in chain] == [1, 2, 3]
    assert chain[1].payload[0].buffers[0].tobytes() == changed.payload[0].buffers[0].tobytes()
    assert chain[1].payload[0].buffers[0].tobytes() != delta(1, 2).payload[0].buffers[0].tobytes()
    assert not any(m.evaluate for m in chain)
    # A file gone (or not the delta recorded) bridges nothing: the site gets the model.
    (d / "d-00000002.msg").unlink()
    assert log.chain(0, "h0", 3) is None and log.chain(2, "h2", 3) is None
    chain = log.chain(0, "h0", 2)
    assert chain is not None and [m.global_version for m in chain] == [1, 2]
    (d / "d-00000000.msg").write_bytes((d / "d-00000001.msg").read_bytes())
    assert log.chain(0, "h0", 1) is None


def test_a_delta_file_is_its_frames_packed_as_msgpack_writes_them() -> None:
    # Written frame by frame (the broadcast's buffers are not copied), read back by unpackb.
    import io

    import msgpack

    from coordinator.deltalog import _pack_frames

    for frames in ([b"abc", b"", bytes(255), bytes(256), bytes(65535), bytes(65536)], []):
        out = io.BytesIO()
        _pack_frames(out, [memoryview(f) for f in frames])
        assert out.getvalue() == msgpack.packb(frames)
