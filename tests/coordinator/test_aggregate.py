"""The weighted mean's fold (:class:`MeanFold`): updates are checked as they arrive and held as
the encoded bytes they came as, with no copy; the mean is folded at the close tensor by tensor,
and each tensor is bit for bit a plain float32 fold of the same updates in site-id order,
whatever order they arrived in. It equals the weighted mean up to float32 rounding."""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.wire.frames import from_wire, to_wire
from comm.wire.schema import ErrorCode, Update
from comm.wire.tensors import encode_slice, encode_tensors
from coordinator.aggregate import HeldMean, Late, MeanFold, MeanResult, Refused
from coordinator.strategies.base import weighted_mean

pytestmark = pytest.mark.timeout(60)

SHAPES = {"emb": (40, 24), "norm": (24,)}


def _update(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def _plain_fold(
    updates: Sequence[tuple[float, Sequence[EncodedTensor]]], spec: str
) -> dict[str, bytes]:
    """The reference: each update decoded whole, Σ float32(w)·x from zeros in the order given,
    divided by float32(Σ w)."""
    codec = get_codec(spec)
    total = 0.0
    for w, _ in updates:
        total += w
    out = {}
    for name, shape in SHAPES.items():
        acc = np.zeros(shape, np.float32)
        for w, payload in updates:
            (enc,) = [e for e in payload if e.name == name]
            acc += np.float32(w) * codec.decode(enc).reshape(shape)
        out[name] = (acc / np.float32(total)).tobytes()
    return out


def _folded(mean: Mapping[str, np.ndarray]) -> dict[str, bytes]:
    return {name: mean[name].tobytes() for name in SHAPES}


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.floats(min_value=0.01, max_value=1e4), min_size=1, max_size=10),
    seed=st.integers(0, 2**16),
)
def test_the_mean_is_the_weighted_mean_up_to_float32_rounding(
    weights: list[float], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    updates = [
        (
            w,
            {
                "emb": rng.standard_normal((40, 24)).astype(np.float32),
                "norm": rng.standard_normal(24),
            },
        )
        for w in weights
    ]
    fold = MeanFold(1e9, [f"s{i:02d}" for i in range(len(updates))])
    for i, (w, x) in reversed(list(enumerate(updates))):
        assert isinstance(
            fold.add(f"s{i:02d}", w, encode_tensors(x, get_codec("fp32")), SHAPES), str
        )
    reference = weighted_mean(updates)
    # Both sides are float32 arithmetic. Ours: each weight and each product w·x rounded (u =
    # eps / 2 each), n - 1 additions with a partial sum below Σ w·|x| (u each), the total weight
    # rounded and the division: at most (n + 3) u relative to Σ w·|x| / Σ w <= scale. The
    # reference's error is as large again.
    n, eps = len(updates), float(np.finfo(np.float32).eps)
    mean = fold.mean()
    for name in SHAPES:
        scale = max(float(np.max(np.abs(x[name]))) for _, x in updates)
        got = mean[name]
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, reference[name], rtol=0, atol=(n + 3) * eps * scale)
    assert fold.weight == pytest.approx(sum(weights)) and fold.count == n


SPECS = ["fp32", "fp16", "int8:block=64", "int4", "int2", "topk:0.2", "int4+zstd"]


@settings(max_examples=30, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    order=st.permutations(["ap", "eu", "us", "sa"]),
    sent=st.sets(st.sampled_from(["ap", "eu", "us", "sa"]), min_size=1),
)
def test_the_fold_at_the_close_is_a_plain_float32_fold_in_site_order_bit_for_bit(
    spec: str, order: list[str], sent: set[str]
) -> None:
    """Updates arriving in any order, some participants sending nothing: each tensor of the
    mean is, bit for bit, each update decoded and Σ float32(w)·x added from zeros in site-id
    order, divided by Σ w."""
    codec = get_codec(spec)
    sites = sorted(order)
    payloads = {s: encode_tensors(_update(i), codec) for i, s in enumerate(sites)}
    weights = {s: 1.0 + 0.37 * i for i, s in enumerate(sites)}
    fold = MeanFold(1e9, ["us", "eu", "sa", "ap"])
    for s in [s for s in order if s in sent]:
        assert isinstance(fold.add(s, weights[s], payloads[s], SHAPES), str)
    assert fold.count == len(sent) and fold.weight == sum(weights[s] for s in sorted(sent))
    want = _plain_fold([(weights[s], payloads[s]) for s in sorted(sent)], spec)
    assert _folded(fold.mean()) == want


def test_slices_fold_at_their_rows() -> None:
    codec = get_codec("int4")
    x = _update(1)
    pieces = [encode_slice("emb", x["emb"][a:b], a, codec) for a, b in [(0, 8), (8, 40)]]
    sliced = MeanFold(1e9, ["a"])
    assert isinstance(
        sliced.add("a", 2.0, [*pieces, *encode_tensors({"norm": x["norm"]}, codec)], SHAPES), str
    )
    whole = MeanFold(1e9, ["a"])
    assert isinstance(whole.add("a", 2.0, encode_tensors(x, codec), SHAPES), str)
    assert _folded(sliced.mean()) == _folded(whole.mean())


def test_an_update_is_held_as_the_bytes_it_came_as_without_a_copy() -> None:
    """Checking and holding an update of 16M parameters (int4, 8.5 MB) allocates the check's
    tiles, nothing of the update's size: its pieces are the payload's buffers. Folding the
    mean's tensors then takes one float32 buffer of the largest tensor (16 MiB here) and tiles,
    never the model (64 MiB)."""
    shapes = {f"w{i}": (2048, 2048) for i in range(4)}
    codec = get_codec("int4")
    rng = np.random.default_rng(0)
    payload = encode_tensors(
        {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}, codec
    )
    fold = MeanFold(1e9, ["eu", "us"])
    tracemalloc.start()
    try:
        assert isinstance(fold.add("eu", 1.0, payload, shapes), str)
        assert isinstance(fold.add("us", 2.0, payload, shapes), str)
        _, held_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        mean = fold.mean()
        for name in shapes:
            assert mean[name].shape == shapes[name]
        _, fold_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held_peak < 4 << 20, held_peak  # the check's tiles
    assert fold.nbytes == 2 * sum(enc.nbytes for enc in payload)
    (held,) = [u for u in fold.ordered() if u.site_id == "eu"]
    for enc in payload:
        (piece,) = held.pieces[enc.name]
        assert all(np.shares_memory(a, b) for a, b in zip(piece.buffers, enc.buffers, strict=True))
    assert 16 << 20 <= fold_peak < 24 << 20, fold_peak
    assert mean.folded == len(shapes)


def test_an_update_off_the_wire_is_held_in_the_bytes_it_arrived_in() -> None:
    """From the reassembled frames to the fold, nothing copies an update: the pieces the fold
    holds are views of the buffer the transport reassembled."""
    payload = encode_tensors(_update(0), get_codec("int4"))
    msg = Update(
        site_id="a",
        round_id=1,
        global_version=0,
        fragment=0,
        weight=1.0,
        train_loss=1.0,
        compute_seconds=1.0,
        step_seconds=0.1,
        link_rtt_s=0.0,
        link_goodput_bps=0.0,
        payload=payload,
    )
    frames = [bytearray(bytes(f)) for f in to_wire(msg, session="s", seq=1)]
    received = from_wire(frames)
    assert isinstance(received, Update)
    fold = MeanFold(1e9, ["a"])
    assert isinstance(fold.add("a", 1.0, received.payload, SHAPES), str)
    (held,) = fold.ordered()
    for pieces in held.pieces.values():
        for enc in pieces:
            for buf in enc.buffers:
                assert any(np.shares_memory(buf, np.frombuffer(f, np.uint8)) for f in frames)
    assert fold.nbytes == sum(enc.nbytes for enc in payload)


def test_every_tensor_of_a_mean_is_folded_into_one_buffer() -> None:
    """The array handed out is the mean's one buffer: the next tensor overwrites it."""
    fold = MeanFold(1e9, ["a"])
    assert isinstance(
        fold.add("a", 1.0, encode_tensors(_update(0), get_codec("int8")), SHAPES), str
    )
    mean = fold.mean()
    emb = mean["emb"]
    first = emb.tobytes()
    norm = mean["norm"]
    assert np.shares_memory(emb, norm)
    assert mean["emb"].tobytes() == first  # folded again, the same bytes
    assert mean.folded == 3


def test_a_refused_update_changes_nothing_and_blocks_no_one() -> None:
    codec = get_codec("fp32")
    fold = MeanFold(1e9, ["a", "b"])
    bad = list(encode_tensors(_update(0), codec))
    values = np.array(bad[1].buffers[0], copy=True)
    values[3] = np.nan
    bad[1] = type(bad[1])(name="norm", shape=(24,), codec="fp32", buffers=(values,))
    refused = fold.add("a", 1.0, bad, SHAPES)
    assert isinstance(refused, Refused) and "'norm'" in refused.detail
    assert fold.count == 0 and fold.nbytes == 0
    assert isinstance(fold.add("b", 1.0, encode_tensors(_update(1), codec), SHAPES), str)
    result = fold.result("1", [])
    assert result.count == 1 and fold.count == 1


def test_an_update_that_could_overflow_the_float32_sum_is_refused() -> None:
    """No norm bound (inf): an update whose weight times norm could overflow the float32 sum
    is refused as out of range, and the fold goes on with the next."""
    codec = get_codec("fp32")
    fold = MeanFold(float("inf"), ["a", "b"])
    huge = {n: v * np.float32(1e25) for n, v in _update(0).items()}
    refused = fold.add("a", 1e15, encode_tensors(huge, codec), SHAPES)
    assert isinstance(refused, Refused) and refused.code == ErrorCode.OUT_OF_RANGE
    assert "overflow" in refused.detail and fold.count == 0 and fold.nbytes == 0
    assert isinstance(fold.add("b", 1e15, encode_tensors(_update(1), codec), SHAPES), str)
    mean = fold.mean()
    assert all(np.isfinite(mean[n]).all() for n in SHAPES)


def test_late_updates_fold_by_site_whatever_their_arrival_order() -> None:
    codec = get_codec("int8")
    payloads = {s: encode_tensors(_update(i), codec) for i, s in enumerate("xyz")}
    means = []
    for arrivals in itertools.permutations("xyz"):
        fold = MeanFold(1e9)
        for s in arrivals:
            assert isinstance(fold.add(s, 1.0 + "xyz".index(s), payloads[s], SHAPES), str)
        means.append(_folded(fold.mean()))
    want = _plain_fold([(1.0 + i, payloads[s]) for i, s in enumerate("xyz")], "int8")
    assert all(m == want for m in means)


def test_the_result_folds_on_time_and_late_updates_when_the_step_reads_them() -> None:
    codec = get_codec("int4")
    on_time, late = MeanFold(1e9, ["a", "b"]), MeanFold(1e9)
    assert isinstance(on_time.add("b", 2.0, encode_tensors(_update(0), codec), SHAPES), str)
    assert isinstance(on_time.add("a", 3.0, encode_tensors(_update(1), codec), SHAPES), str)
    assert isinstance(late.add("c", 4.0, encode_tensors(_update(2), codec), SHAPES), str)
    result = on_time.result("7", [Late(origin=6, divisor=2, fold=late)])
    assert isinstance(result, MeanResult)
    (label, weight, mean), (late_label, late_weight, late_mean) = result.updates
    assert (label, weight, late_label, late_weight) == ("round 7", 5.0, "late@6", 2.0)
    assert isinstance(mean, HeldMean) and mean.folded == 0 and result.fold_cpu_seconds == 0.0
    assert _folded(mean) == _folded(on_time.mean())
    assert _folded(late_mean) == _folded(late.mean())
    assert result.fold_cpu_seconds > 0.0
