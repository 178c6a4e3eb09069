"""Error feedback: mass conservation over many rounds, the residual update, decay, checkpoints."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest
import torch

from comm.codecs.base import NonFiniteError
from comm.codecs.feedback import ErrorFeedback
from comm.codecs.registry import get_codec

pytestmark = pytest.mark.timeout(120)


def _delta(rng: np.random.Generator, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    """A pseudo-gradient-like tensor: small values, a few large ones."""
    x = rng.standard_normal(shape) * 1e-3
    x.reshape(-1)[rng.integers(0, x.size, 5)] *= 50
    return x.astype(np.float32)


@pytest.mark.parametrize("spec", ["int4", "topk:0.01", "int8:block=128", "topk:0.05,values=fp16"])
def test_mass_is_conserved_over_50_rounds(spec: str) -> None:
    codec = get_codec(spec)
    rng = np.random.default_rng(0)
    ef = ErrorFeedback()
    shapes = {"w": (64, 70), "b": (33,)}
    raw = {n: np.zeros(s, dtype=np.float64) for n, s in shapes.items()}
    sent = {n: np.zeros(s, dtype=np.float64) for n, s in shapes.items()}
    for _ in range(50):
        for name, shape in shapes.items():
            x = _delta(rng, shape)
            raw[name] += x
            sent[name] += codec.decode(ef.compress(name, x, codec))
    for name in shapes:
        residual = ef.residual(name)
        assert residual is not None
        # Each round rounds y = x + residual once to float32, so the tolerance grows with it.
        tol = 50 * 2.0**-23 * (np.abs(raw[name]).max() + np.abs(residual).max()) + 1e-9
        assert np.max(np.abs(sent[name] + residual - raw[name])) <= tol
        # The residual is bounded: feedback does not let the error pile up.
        assert np.abs(residual).max() < np.abs(raw[name]).max()


def test_feedback_makes_the_sum_of_sends_converge() -> None:
    # A constant signal sent with top-1%: without feedback the same 1% is sent every round and
    # the rest never arrives; with it the residual stays bounded, so the relative error of the
    # running sum shrinks as 1 / rounds.
    codec = get_codec("topk:0.01")
    x = np.random.default_rng(1).standard_normal(2000).astype(np.float32)
    ef = ErrorFeedback()
    total = np.zeros_like(x, dtype=np.float64)
    norms = []
    for rounds in range(1, 801):
        total += codec.decode(ef.compress("w", x, codec))
        if rounds in (400, 800):
            norms.append(ef.residual_norm())
    target = x.astype(np.float64) * 800
    plain = codec.decode(codec.encode("w", x)).astype(np.float64) * 800
    assert np.linalg.norm(plain - target) > 0.9 * np.linalg.norm(target)
    assert np.linalg.norm(total - target) < 0.1 * np.linalg.norm(target)
    assert norms[1] < 1.2 * norms[0]


def test_one_step_keeps_exactly_what_the_codec_lost() -> None:
    codec = get_codec("int4")
    x = _delta(np.random.default_rng(2), (500,))
    ef = ErrorFeedback()
    enc = ef.compress("w", x, codec)
    assert np.array_equal(ef.residual("w"), x - codec.decode(enc))
    x2 = _delta(np.random.default_rng(3), (500,))
    enc2 = ef.compress("w", x2, codec)
    y = x2 + (x - codec.decode(enc))
    assert np.array_equal(codec.decode(enc2), codec.decode(codec.encode("w", y)))
    assert np.array_equal(ef.residual("w"), y - codec.decode(enc2))


def test_lossless_codec_leaves_no_residual() -> None:
    ef = ErrorFeedback()
    x = _delta(np.random.default_rng(4), (10, 10))
    ef.compress("w", x, get_codec("fp32"))
    assert ef.residual_norm() == 0.0


def test_decay_scales_the_carried_residual() -> None:
    codec = get_codec("topk:0.1")
    x1 = _delta(np.random.default_rng(5), (300,))
    x2 = _delta(np.random.default_rng(6), (300,))
    ef = ErrorFeedback(decay=0.5)
    ef.compress("w", x1, codec)
    r1 = ef.residual("w")
    assert r1 is not None
    enc2 = ef.compress("w", x2, codec)
    y = x2 + np.float32(0.5) * r1
    assert np.array_equal(codec.decode(enc2), codec.decode(codec.encode("w", y)))
    assert np.array_equal(ef.residual("w"), y - codec.decode(enc2))


@pytest.mark.parametrize("decay", [-0.1, 1.5, math.nan])
def test_bad_decay(decay: float) -> None:
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(decay=decay)


def test_state_dict_round_trip_continues_identically() -> None:
    codec = get_codec("int4")
    rng = np.random.default_rng(7)
    xs = [_delta(rng, (40, 40)) for _ in range(6)]
    a = ErrorFeedback()
    for x in xs[:3]:
        a.compress("w", x, codec)
    state = a.state_dict()
    assert set(state) == {"w"} and state["w"].dtype == np.float32
    state["w"][0, 0] += 0  # a copy: mutating it must not reach back into `a`
    b = ErrorFeedback()
    b.load_state_dict(state)
    for x in xs[3:]:
        ea, eb = a.compress("w", x, codec), b.compress("w", x, codec)
        assert all(p.tobytes() == q.tobytes() for p, q in zip(ea.buffers, eb.buffers, strict=True))
    assert a.residual_norm() == b.residual_norm()


def test_state_dict_is_a_copy() -> None:
    ef = ErrorFeedback()
    ef.compress("w", np.ones(100, dtype=np.float32) * 0.3, get_codec("topk:0.1"))
    state = ef.state_dict()
    state["w"][:] = 100.0
    assert ef.residual_norm() < 100.0


def test_load_state_dict_validates_before_changing_anything() -> None:
    ef = ErrorFeedback()
    ef.load_state_dict({"w": np.ones(3)})
    with pytest.raises(ValueError, match="expected floats"):
        ef.load_state_dict({"a": np.zeros(3), "b": np.arange(3)})
    with pytest.raises(NonFiniteError, match="'b'"):
        ef.load_state_dict({"a": np.zeros(3), "b": np.array([math.nan])})
    assert list(ef.names()) == ["w"]


def test_residual_norm() -> None:
    ef = ErrorFeedback()
    ef.load_state_dict({"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])})
    assert ef.residual_norm() == 5.0
    assert ef.residual_norm("a") == 3.0
    assert ef.residual_norm("missing") == 0.0
    ef.reset("a")
    assert ef.residual_norm() == 4.0
    ef.reset()
    assert ef.residual_norm() == 0.0


def test_shape_change_is_an_error() -> None:
    ef = ErrorFeedback()
    codec = get_codec("int8")
    ef.compress("w", np.ones((4, 4), dtype=np.float32), codec)
    with pytest.raises(ValueError, match="'w'.*reset"):
        ef.compress("w", np.ones(16, dtype=np.float32), codec)


def test_failed_encode_leaves_the_residual_alone() -> None:
    ef = ErrorFeedback()
    codec = get_codec("int4")
    ef.compress("w", _delta(np.random.default_rng(8), (100,)), codec)
    before = ef.residual("w")
    bad = np.ones(100, dtype=np.float32)
    bad[3] = math.inf
    with pytest.raises(NonFiniteError, match="'w'"):
        ef.compress("w", bad, codec)
    assert np.array_equal(ef.residual("w"), before)


def test_inputs_are_not_modified_and_torch_inputs_work() -> None:
    codec = get_codec("int4")
    x = _delta(np.random.default_rng(9), (50, 50))
    keep = x.copy()
    a, b = ErrorFeedback(), ErrorFeedback()
    for _ in range(3):
        ea = a.compress("w", x, codec)
        eb = b.compress("w", torch.from_numpy(x).to(torch.bfloat16).to(torch.float32), codec)
        assert ea.shape == eb.shape == (50, 50)
    assert np.array_equal(x, keep)
    assert b.residual("w") is not None and b.residual("w").shape == (50, 50)


@pytest.mark.parametrize("decay", [1.0, 0.95])
def test_a_torch_input_keeps_its_residual_as_a_tensor_with_the_same_values(decay: float) -> None:
    """A tensor's residual stays a float32 tensor where the tensor is (a shard's device); the
    encodings and residuals are those of the same values sent as numpy, bit for bit; a snapshot
    restores the residuals as they were; the checkpoint form is numpy either way."""
    codec = get_codec("int8:block=64")
    rng = np.random.default_rng(4)
    a, b = ErrorFeedback(decay=decay), ErrorFeedback(decay=decay)
    for _ in range(3):
        x = _delta(rng, (20, 33))
        ea = a.compress("w", x, codec)
        eb = b.compress("w", torch.from_numpy(x.copy()), codec)
        assert all(np.array_equal(p, q) for p, q in zip(ea.buffers, eb.buffers, strict=True))
        rb = b.residual("w")
        assert isinstance(rb, torch.Tensor) and rb.dtype == torch.float32
        assert np.array_equal(rb.numpy(), a.residual("w"))
    assert math.isclose(a.residual_sq_norm(), b.residual_sq_norm())
    assert np.array_equal(b.state_dict()["w"], a.state_dict()["w"])
    kept = b.snapshot()
    before = b.residual("w")
    b.compress("w", torch.ones(20, 33), codec)
    b.restore(kept)
    assert torch.equal(b.residual("w"), before)


def test_encode_replaces_the_codecs_encoding_and_the_rule_stays() -> None:
    """``encode`` makes the encoding (a shard's slice of its tensor's rows); the residual is
    what the codec's decoding of it lost."""
    from dataclasses import replace

    codec = get_codec("int4")
    x = torch.from_numpy(_delta(np.random.default_rng(5), (6, 40)))
    ef = ErrorFeedback()
    enc = ef.compress("w", x, codec, encode=lambda n, y: replace(codec.encode(n, y), rows=(4, 10)))
    assert enc.rows == (4, 10)
    residual = ef.residual("w")
    assert torch.equal(residual, x - torch.from_numpy(codec.decode(enc)).reshape(6, 40))


@pytest.mark.parametrize("decay", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_encode_then_settle_is_compress_bit_for_bit_in_the_residuals_own_memory(
    decay: float, as_tensor: bool
) -> None:
    """encode_owed sends what compress sends and leaves the residual alone; settle then keeps
    bit for bit what compress keeps, in the memory of the residual it had (no second one)."""
    codec = get_codec("int8:block=64")
    rng = np.random.default_rng(3)
    whole, split = ErrorFeedback(decay=decay), ErrorFeedback(decay=decay)
    memory = None
    for step in range(4):
        raw = _delta(rng, (37, 50))
        x = torch.from_numpy(raw) if as_tensor else raw
        want = whole.compress("w", x, codec)
        before = split.residual("w")
        got = split.encode_owed("w", x, codec)
        assert got.meta == want.meta
        assert all(np.array_equal(a, b) for a, b in zip(got.buffers, want.buffers, strict=True))
        after = split.residual("w")
        assert (before is None and after is None) or np.array_equal(np.asarray(before), after)
        split.settle("w", x, got, codec)
        kept = split._residuals["w"]
        assert np.array_equal(np.asarray(kept), np.asarray(whole.residual("w")))
        address = kept.data_ptr() if isinstance(kept, torch.Tensor) else kept.ctypes.data
        if step:
            assert address == memory, "settle wrote a new residual"
        memory = address
