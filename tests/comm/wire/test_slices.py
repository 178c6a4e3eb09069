"""Slices of tensors on the wire: an update of a sharded site names each shard's rows, and the
receiver puts them together only when they cover each tensor exactly once."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.wire.frames import WireError, from_wire, to_wire
from comm.wire.payload import decode_payload, encode_payload
from comm.wire.schema import ErrorCode, Update
from comm.wire.tensors import check_slices, decode_tensors, encode_slice, encode_tensors

pytestmark = pytest.mark.timeout(60)

FP32 = get_codec("fp32")
RNG = np.random.default_rng(3)
PARAMS = {
    "w": RNG.standard_normal((10, 4)).astype(np.float32),
    "b": RNG.standard_normal(6).astype(np.float32),
}
SPEC = {n: v.shape for n, v in PARAMS.items()}


def _slices(name: str, value: np.ndarray, cuts: Sequence[int]) -> list[EncodedTensor]:
    edges = [0, *cuts, value.shape[0]]
    return [encode_slice(name, value[a:b], a, FP32) for a, b in zip(edges, edges[1:], strict=False)]


def _update(payload: Sequence[EncodedTensor]) -> Update:
    return Update(
        site_id="eu",
        round_id=3,
        global_version=2,
        fragment=0,
        weight=10.0,
        train_loss=1.0,
        compute_seconds=1.0,
        step_seconds=0.1,
        link_rtt_s=0.0,
        link_goodput_bps=0.0,
        payload=tuple(payload),
    )


def test_an_update_of_slices_crosses_the_wire_with_its_rows() -> None:
    payload = [*_slices("w", PARAMS["w"], [3, 7]), *encode_tensors({"b": PARAMS["b"]}, FP32)]
    got = from_wire(to_wire(_update(payload)))
    assert isinstance(got, Update)
    assert [(e.name, e.rows, e.shape) for e in got.payload] == [
        ("w", (0, 3), (3, 4)),
        ("w", (3, 7), (4, 4)),
        ("w", (7, 10), (3, 4)),
        ("b", None, (6,)),
    ]
    decoded = decode_tensors(got.payload, SPEC, slices=True)
    assert all(np.array_equal(decoded[n], PARAMS[n]) for n in PARAMS)


def test_an_update_without_slices_is_unchanged_on_the_wire() -> None:
    """No ``"r"`` key, so an index of whole tensors is what it was before slices existed."""
    index, _ = encode_payload(encode_tensors(PARAMS, FP32))
    assert isinstance(index, list)
    assert all(set(entry) == {"n", "s", "c", "m", "b"} for entry in index)


def test_a_compressed_index_of_many_slices_decodes_within_its_bounds() -> None:
    big = RNG.standard_normal((400, 2)).astype(np.float32)
    pieces = _slices("big", big, list(range(1, 400)))
    index, frames = encode_payload(pieces)
    assert isinstance(index, bytes)  # the index of 400 entries travels compressed
    got = decode_payload(index, frames)
    decoded = decode_tensors(got, {"big": big.shape}, slices=True)
    assert np.array_equal(decoded["big"], big)


@pytest.mark.parametrize(
    ("rows", "shape"),
    [([0, 3, 5], (3, 4)), ([3, 3], (1, 4)), ([4, 2], (2, 4)), ([0, 3], (2, 4)), ([0, 1], ()),
     ("0:3", (3, 4)), ([0, True], (1, 4)), ([-1, 2], (3, 4))],
)  # fmt: skip
def test_malformed_rows_are_refused(rows: object, shape: tuple[int, ...]) -> None:
    enc = FP32.encode("w", np.zeros(shape, np.float32))
    index, frames = encode_payload([enc])
    assert isinstance(index, list)
    index[0]["r"] = rows
    with pytest.raises(WireError) as err:
        decode_payload(index, frames)
    assert err.value.code == ErrorCode.MALFORMED and "'w'" in err.value.detail


def _refusal(payload: Sequence[EncodedTensor], *, slices: bool = True) -> str:
    with pytest.raises(WireError) as err:
        decode_tensors(payload, SPEC, slices=slices)
    assert err.value.code == ErrorCode.BAD_PAYLOAD
    return err.value.detail


B = encode_tensors({"b": PARAMS["b"]}, FP32)


def _piece(a: int, b: int) -> EncodedTensor:
    return encode_slice("w", PARAMS["w"][a:b], a, FP32)


@pytest.mark.parametrize(
    ("pieces", "detail"),
    [
        ([_piece(0, 3), _piece(4, 10)], "tensor 'w': rows 3:4 missing"),
        ([_piece(0, 3), _piece(3, 9)], "tensor 'w': rows 9:10 missing"),
        ([_piece(1, 10)], "tensor 'w': rows 0:1 missing"),
        ([_piece(0, 5), _piece(4, 10)], "tensor 'w': rows 4:10 overlap rows before 5"),
        ([_piece(0, 10), _piece(0, 10)], "tensor 'w': rows 0:10 overlap rows before 10"),
        (
            [_piece(0, 8), dataclasses.replace(_piece(8, 10), rows=(8, 12))],
            "tensor 'w': rows 8:12 beyond its 10 rows",
        ),
        (
            [_piece(0, 8), encode_slice("w", np.zeros((2, 5), np.float32), 8, FP32)],
            "tensor 'w': rows 8:10 have shape (2, 5), expected (2, 4)",
        ),
        (
            [*encode_tensors({"w": PARAMS["w"]}, FP32), _piece(0, 3)],
            "tensor 'w' comes whole and in slices",
        ),
        ([*encode_tensors({"w": PARAMS["w"]}, FP32)] * 2, "tensor 'w' appears twice"),
    ],
)
def test_slices_that_do_not_cover_a_tensor_once_are_refused_naming_it(
    pieces: list[EncodedTensor], detail: str
) -> None:
    assert _refusal([*pieces, *B]) == detail


def test_a_slice_where_whole_tensors_are_expected_is_refused() -> None:
    payload = [*_slices("w", PARAMS["w"], [5]), *B]
    assert "'w' comes as rows (0, 5): whole tensors expected" in _refusal(payload, slices=False)
    with pytest.raises(WireError, match="whole tensors expected"):
        decode_tensors(payload)  # nothing to expect: nothing to put slices together into
    scalar = {"s": ()}
    enc = dataclasses.replace(FP32.encode("s", np.zeros(1, np.float32)), rows=(0, 1))
    with pytest.raises(WireError, match="'s' has no rows to slice"):
        check_slices([enc], scalar)


def test_a_non_finite_slice_is_refused_naming_the_tensor() -> None:
    bad = _piece(3, 10)
    bad.buffers[0].reshape(-1)[5] = np.nan
    with pytest.raises(WireError) as err:
        decode_tensors([_piece(0, 3), bad, *B], SPEC, slices=True)
    assert err.value.code == ErrorCode.NON_FINITE and "'w'" in err.value.detail


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 9), max_size=9, unique=True), st.permutations(range(10)))
def test_any_row_split_in_any_order_decodes_to_the_whole(cuts: list[int], order: list[int]) -> None:
    pieces = _slices("w", PARAMS["w"], sorted(cuts))
    shuffled = [pieces[i] for i in order if i < len(pieces)]
    decoded = decode_tensors([*shuffled, *B], SPEC, slices=True)
    assert np.array_equal(decoded["w"], PARAMS["w"])
    assert decoded["w"].flags.c_contiguous and decoded["w"].dtype == np.float32
