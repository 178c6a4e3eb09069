"""The streamed simulated sites of ``crossdc bench scale``: updates made a tensor at a time are the
int4 codec's own encoding, and the one θ they share lands on the hash of the model held whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.wire.schema import Global
from comm.wire.tensors import HASH_BLOCK, decode_tensors, encode_tensors, state_hash
from crossdc.bench import scale_sites
from crossdc.bench.scale_sites import Layout, SharedTheta, ThetaError

pytestmark = pytest.mark.timeout(120)

LAYOUT = Layout((5000, 4097, 63, 1))
"""Tensors of an even, an odd, a sub-block and a one-value size."""


def _whole_theta0(layout: Layout) -> dict[str, np.ndarray]:
    return {name: scale_sites.theta0_tensor(i, n) for i, name, _, n in layout.tensors()}


def _bytes(payload: tuple[EncodedTensor, ...]) -> list[tuple[str, object, list[bytes]]]:
    return [
        (enc.name, (enc.shape, enc.codec, enc.meta), [np.asarray(b).tobytes() for b in enc.buffers])
        for enc in payload
    ]


def _result(
    payload: tuple[EncodedTensor, ...], expected: dict[str, np.ndarray], base: int = 0
) -> Global:
    return Global(
        round_id=base + 1,
        base_version=base,
        global_version=base + 1,
        fragment=-1,
        merged=(),
        is_full=False,
        state_hash=state_hash(expected),
        signature=b"",
        evaluate=False,
        payload=payload,
    )


def _taken(theta: SharedTheta, msg: Global, held: int) -> str:
    """What a site holding ``held`` does with ``msg``: admit it, the shared θ applies it if it
    is the first of its version, then the site checks the coordinator's hash."""
    first = theta.admit(msg, held)
    if first is not None:
        for _ in theta.apply(first):
            pass
    return theta.confirm(msg.global_version, msg.state_hash)


def test_layout_cuts_the_model_into_tensors_of_at_most_tensor_numel() -> None:
    n = 2 * scale_sites.TENSOR_NUMEL + 7
    layout = Layout.of(n)
    assert layout.sizes == (scale_sites.TENSOR_NUMEL, scale_sites.TENSOR_NUMEL, 7)
    assert layout.numel == n and layout.largest == scale_sites.TENSOR_NUMEL
    assert [at for _, _, at, _ in layout.tensors()] == [0, layout.sizes[0], 2 * layout.sizes[0]]


def test_a_streamed_update_is_the_int4_encoding_of_the_model_it_decodes_to() -> None:
    streamed = scale_sites.site_update(LAYOUT, site=1, round_id=2)
    whole = decode_tensors(streamed, {name: (n,) for _, name, _, n in LAYOUT.tensors()})
    # The whole model's update encoded at once, as the bench used to send it.
    assert _bytes(encode_tensors(whole, get_codec("int4"))) == _bytes(streamed)
    values = np.concatenate(list(whole.values()))
    assert 0 < np.abs(values).max() < 2 * scale_sites.UPDATE_SCALE


def test_updates_are_deterministic_per_site_round_and_tensor() -> None:
    again = scale_sites.site_update(LAYOUT, site=1, round_id=2)
    assert _bytes(again) == _bytes(scale_sites.site_update(LAYOUT, site=1, round_id=2))
    for other in (
        scale_sites.site_update(LAYOUT, site=2, round_id=2),
        scale_sites.site_update(LAYOUT, site=1, round_id=3),
    ):
        assert all(
            a.buffers[0].tobytes() != b.buffers[0].tobytes()
            for a, b in zip(again[:2], other[:2], strict=True)
        )
    assert again[0].buffers[0].tobytes() != again[1].buffers[0][:2500].tobytes()


def test_an_update_sent_from_its_file_is_the_one_generated(tmp_path: Path) -> None:
    files = scale_sites.SentFiles(tmp_path)
    try:
        sent = scale_sites.write_update(files, LAYOUT, site=1, round_id=2)
        assert _bytes(sent) == _bytes(scale_sites.site_update(LAYOUT, site=1, round_id=2))
        files.release(every_s=0.0)
        assert _bytes(sent) == _bytes(scale_sites.site_update(LAYOUT, site=1, round_id=2))
        # The next round's update takes the place of this one.
        scale_sites.write_update(files, LAYOUT, site=1, round_id=3)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["update-s1-r3"]
    finally:
        files.close()
    assert not list(tmp_path.iterdir())


def test_theta0_is_hashed_and_uploaded_as_the_model_held_whole(tmp_path: Path) -> None:
    theta = SharedTheta(LAYOUT, tmp_path)
    try:
        whole = _whole_theta0(LAYOUT)
        assert theta.write_theta0() == state_hash(whole)
        payload = theta.init_payload()
        assert _bytes(payload) == _bytes(encode_tensors(whole, get_codec("fp32")))
        theta.files.release(every_s=0.0)  # the pages come back from the page cache
        assert _bytes(payload) == _bytes(encode_tensors(whole, get_codec("fp32")))
    finally:
        theta.close()
    assert not list(tmp_path.iterdir())  # θ's and θ0's files are gone


def test_a_result_is_applied_block_by_block_as_a_site_applies_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of one hash block: a tensor of 150,001 values is taken in three, the last short.
    monkeypatch.setattr(scale_sites, "STREAM_BLOCK", HASH_BLOCK)
    layout = Layout((150_001, 5))
    theta = SharedTheta(layout, tmp_path)
    try:
        theta.write_theta0()
        whole = _whole_theta0(layout)
        delta = scale_sites.site_update(layout, site=0, round_id=1)
        decoded = decode_tensors(delta, {k: v.shape for k, v in whole.items()})
        expected = {k: whole[k] + decoded[k] for k in whole}
        assert _taken(theta, _result(delta, expected), held=0) == state_hash(expected)
        for name, values in expected.items():
            for lo in range(0, values.size, HASH_BLOCK):
                hi = min(values.size, lo + HASH_BLOCK)
                assert theta.read(name, lo, hi).tobytes() == values[lo:hi].tobytes()
    finally:
        theta.close()


def test_the_shared_theta_takes_a_delta_once_and_checks_it_for_every_site(tmp_path: Path) -> None:
    theta = SharedTheta(LAYOUT, tmp_path)
    try:
        theta.write_theta0()
        whole = _whole_theta0(LAYOUT)
        delta = scale_sites.site_update(LAYOUT, site=0, round_id=1)
        decoded = decode_tensors(delta, {k: v.shape for k, v in whole.items()})
        expected = {k: whole[k] + decoded[k] for k in whole}  # as a real site applies it
        msg = _result(delta, expected)
        assert _taken(theta, msg, held=0) == state_hash(expected)  # the first site applies it
        assert theta.version == 1
        for name, values in expected.items():
            assert theta.read(name).tobytes() == values.tobytes()
        # Another site at v0 gets the same delta (its own copy of the bytes): only checked.
        same = _result(scale_sites.site_update(LAYOUT, site=0, round_id=1), expected)
        assert _taken(theta, same, held=0) == state_hash(expected)
        assert theta.read("t000").tobytes() == expected["t000"].tobytes()
        assert theta.admit(same, held=0) is None  # nothing of it is kept
        # A site at v0 given another delta for v1 cannot share this θ.
        other = _result(scale_sites.site_update(LAYOUT, site=2, round_id=1), expected)
        with pytest.raises(ThetaError, match="another delta"):
            _taken(theta, other, held=0)
        with pytest.raises(ThetaError, match="holds v0"):
            _taken(theta, _result(delta, expected, base=1), held=0)
        # The next version, applied on v1.
        delta2 = scale_sites.site_update(LAYOUT, site=1, round_id=2)
        decoded2 = decode_tensors(delta2, {k: v.shape for k, v in whole.items()})
        expected2 = {k: expected[k] + decoded2[k] for k in whole}
        assert _taken(theta, _result(delta2, expected2, base=1), held=1) == state_hash(expected2)
        # A site slower than the others checks v1 after the shared θ moved on to v2.
        assert theta.confirm(1, state_hash(expected)) == state_hash(expected)
    finally:
        theta.close()


def test_a_result_whose_hash_is_not_the_coordinators_is_an_error(tmp_path: Path) -> None:
    theta = SharedTheta(LAYOUT, tmp_path)
    try:
        theta.write_theta0()
        delta = scale_sites.site_update(LAYOUT, site=0, round_id=1)
        with pytest.raises(ThetaError, match="state hash"):
            _taken(theta, _result(delta, _whole_theta0(LAYOUT)), held=0)  # θ0's hash, not θ1's
        with pytest.raises(ThetaError, match="not applied"):
            theta.confirm(2, "")
    finally:
        theta.close()
