"""The chunk-wise top-k codec (SparseLoCo's uplink), its decayed error feedback, and the sparse
broadcast that leaves every site on the coordinator's parameters."""

from __future__ import annotations

import numpy as np
import pytest

from comm.codecs.broadcast import apply_sparse_broadcast
from comm.codecs.chunktopk import ChunkTopKCodec, _rice_decode, _rice_encode
from comm.codecs.feedback import ErrorFeedback
from comm.codecs.registry import codec_from_id, decode_tensor, get_codec
from comm.wire.tensors import state_hash
from coordinator.strategies.sparseloco import SparseLoCo


def _expected_positions(x: np.ndarray, chunk: int, k: int) -> set[int]:
    flat = x.reshape(-1)
    out: set[int] = set()
    for start in range(0, flat.size, chunk):
        part = np.abs(flat[start : start + chunk])
        kk = k if part.size == chunk else min(part.size, max(1, round(k * part.size / chunk)))
        out.update(int(i) + start for i in np.argsort(-part, kind="stable")[:kk])
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", ["chunktopk", "chunktopk:bits=1", "chunktopk:chunk=100,k=7"])
@pytest.mark.parametrize("shape", [(1,), (5,), (128,), (4096,), (64, 161), (3, 4096)])
def test_round_trip_positions_exact_values_within_half_a_step(
    spec: str, shape: tuple[int, ...]
) -> None:
    codec = get_codec(spec)
    assert isinstance(codec, ChunkTopKCodec)
    rng = np.random.default_rng(sum(shape))
    # Distinct magnitudes, so the top k of a chunk is one set.
    x = (rng.permutation(np.prod(shape)) + 1).astype(np.float32).reshape(shape)
    x *= rng.choice([-1.0, 1.0], size=shape).astype(np.float32) / np.float32(x.size)
    enc = codec.encode("w", x)
    assert enc.nbytes <= codec.encoded_size(x.size)
    y = decode_tensor(enc)
    assert y.shape == x.shape and y.dtype == np.float32
    kept = set(np.flatnonzero(y.reshape(-1)).tolist())
    assert kept == _expected_positions(x, codec.chunk, codec.k)
    assert len(kept) == codec.picks(x.size)
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    levels = 1 << (codec.bits - 1)
    for start in range(0, x.size, codec.chunk):
        idx = np.array(sorted(i for i in kept if start <= i < start + codec.chunk))
        mags = np.abs(flat_x[idx])
        # Half a step of the chunk's uniform grid between its kept magnitudes; the fp16 scales
        # enclose them, each end moved out by at most a relative 2^-10.
        lo, hi = float(mags.min()), float(mags.max())
        half_step = ((hi - lo) + (hi + lo) * 2**-10) / levels / 2 + 1e-6 * hi
        assert np.all(np.abs(flat_y[idx] - flat_x[idx]) <= half_step)
        assert np.all(np.sign(flat_y[idx]) == np.sign(flat_x[idx]))


@pytest.mark.timeout(60)
def test_spec_ids_sizes_and_bad_input() -> None:
    assert get_codec("chunktopk:chunk=4096,k=64,bits=2").spec == "chunktopk"
    assert get_codec("chunktopk:k=32,bits=1").spec == "chunktopk:k=32,bits=1"
    assert codec_from_id(9) == get_codec("chunktopk")
    for bad in ("chunktopk:bits=3", "chunktopk:k=0", "chunktopk:k=5000", "chunktopk+zstd"):
        with pytest.raises(ValueError):
            get_codec(bad)
    codec = get_codec("chunktopk")
    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    enc = codec.encode("w", x)
    # About 0.16 bits a value: 1.56% kept, 2 bits each, Rice-coded positions (~7.5 bits each).
    assert enc.meta["positions"] == "rice"
    assert 8 * enc.nbytes / x.size < 0.17
    tampered = enc.buffers[0].copy()
    tampered[-1] ^= 0xFF
    with pytest.raises(ValueError):
        codec.decode(type(enc)(**{**enc.__dict__, "buffers": (tampered, *enc.buffers[1:])}))
    with pytest.raises(ValueError):
        codec.encode("w", np.array([np.nan], dtype=np.float32))


@pytest.mark.timeout(60)
def test_rice_gaps_round_trip() -> None:
    gaps = np.array([0, 1, 63, 64, 4095, 7, 0, 200], dtype=np.int64)
    for r in (0, 3, 5, 12):
        assert np.array_equal(_rice_decode(_rice_encode(gaps, r), r, gaps.size), gaps)


@pytest.mark.timeout(60)
def test_decayed_residual_follows_its_definition() -> None:
    # e <- beta e + delta; send C(e); keep e - D(C(e)).
    codec, beta = get_codec("chunktopk:chunk=256,k=8"), 0.95
    fb = ErrorFeedback(decay=beta)
    rng = np.random.default_rng(1)
    e = np.zeros(1000, dtype=np.float32)
    for _ in range(6):
        delta = rng.standard_normal(1000).astype(np.float32)
        acc = (delta + np.float32(beta) * e).astype(np.float32)
        sent = decode_tensor(fb.compress("w", delta, codec))
        e = acc - codec.decode(codec.encode("w", acc))
        np.testing.assert_array_equal(sent, acc - e)
        np.testing.assert_array_equal(fb.residual("w"), e)


@pytest.mark.timeout(60)
def test_sparse_broadcast_leaves_every_site_on_the_coordinators_hash() -> None:
    rng = np.random.default_rng(2)
    shapes = {"a": (64, 100), "b": (300,), "norm": (16,)}
    theta = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    codec = get_codec("chunktopk:chunk=512,k=16")
    feedback = {site: ErrorFeedback(decay=0.95) for site in ("ap", "eu", "us")}
    strategy = SparseLoCo(lr=0.65)
    sites = {site: {k: v.copy() for k, v in theta.items()} for site in feedback}
    for _ in range(3):
        encoded, weights = {}, {"ap": 3.0, "eu": 5.0, "us": 4.0}
        for site, fb in feedback.items():
            delta = {k: rng.standard_normal(s).astype(np.float32) * 0.01 for k, s in shapes.items()}
            encoded[site] = {k: fb.compress(k, v, codec) for k, v in delta.items()}
        updates = [
            (site, weights[site], {k: decode_tensor(e) for k, e in encoded[site].items()})
            for site in ("us", "eu", "ap")  # any arrival order: the strategy sorts by site
        ]
        theta = strategy.outer_step(theta, {}, updates, averaged={"norm"}).params
        parts = [(weights[site], encoded[site]) for site in sorted(encoded)]
        for site in sites:
            sites[site] = apply_sparse_broadcast(sites[site], parts, lr=0.65, averaged={"norm"})
            assert state_hash(sites[site]) == state_hash(theta)


@pytest.mark.timeout(60)
def test_a_held_update_is_sent_later_with_the_decay() -> None:
    codec, beta = get_codec("chunktopk:chunk=64,k=4"), 0.9
    fb = ErrorFeedback(decay=beta)
    rng = np.random.default_rng(3)
    x1, x2 = (rng.standard_normal(200).astype(np.float32) for _ in range(2))
    assert fb.accumulated_norm("w", x1) == pytest.approx(float(np.linalg.norm(x1)), rel=1e-6)
    fb.hold("w", x1)
    np.testing.assert_array_equal(fb.residual("w"), x1)
    sent = decode_tensor(fb.compress("w", x2, codec))
    np.testing.assert_allclose(sent + fb.residual("w"), x2 + np.float32(beta) * x1, rtol=1e-6)
