"""The state hash: the same whether the model is held whole or cut into flat ranges by ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import comm.wire.tensors as tensors
from comm.wire.schema import PROTOCOL_VERSION
from comm.wire.tensors import (
    HASH_BLOCK,
    BoundaryPiece,
    boundary_piece,
    combine,
    model_hash,
    partial_digests,
    state_hash,
    tensor_digest,
)

pytestmark = pytest.mark.timeout(120)


def _sharded_digest(name: str, value: np.ndarray, cuts: Sequence[int]) -> bytes:
    """Tensor ``name``'s digest as ranks holding the flat ranges between ``cuts`` compute it:
    every rank's boundary piece all-gathered, each rank's block digests combined."""
    flat = value.reshape(-1)
    edges = [0, *sorted(cuts), flat.size]
    ranges = list(zip(edges, edges[1:], strict=False))
    shape = value.shape
    pieces = [boundary_piece(name, shape, s, flat[s:e]) for s, e in ranges]
    received = [p for p in pieces if p is not None]
    assert all(p.values.size < HASH_BLOCK for p in received)
    parts = [partial_digests(name, shape, s, flat[s:e], received) for s, e in ranges]
    return combine(name, shape, parts)


def _rows_cuts(shape: tuple[int, ...], rows: Sequence[int]) -> list[int]:
    per_row = math.prod(shape[1:])
    return [r * per_row for r in rows]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=0, max_size=3),
    st.integers(1, 13),
    st.lists(st.integers(0, 1 << 12), max_size=6),
    st.integers(0, 2**32 - 1),
)
def test_any_split_into_ranges_hashes_as_the_whole(
    shape: list[int], block: int, cuts: list[int], seed: int
) -> None:
    """With a small block, every way of cutting a tensor (empty ranges, ranges shorter than a
    block, boundaries on and off block edges) gives the one-process digest."""
    value = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    numel = value.size
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tensors, "HASH_BLOCK", block)
        whole = tensor_digest("w", value)
        assert _sharded_digest("w", value, [c % (numel + 1) for c in cuts]) == whole


def test_row_shards_of_a_model_hash_as_the_model() -> None:
    """Real block size: tensors of several blocks cut by rows, as FSDP's dim-0 shards are, and
    the model hash over them equals state_hash of the whole model."""
    rng = np.random.default_rng(0)
    params = {
        "emb": rng.standard_normal((300, 1000)).astype(np.float32),  # 4.6 blocks
        "layers.0.w": rng.standard_normal((257, 513)).astype(np.float32),
        "layers.0.b": rng.standard_normal(513).astype(np.float32),
        "scale": np.float32(2.5) * np.ones((), np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }
    splits = {
        "emb": _rows_cuts((300, 1000), [75, 150, 225]),
        "layers.0.w": _rows_cuts((257, 513), [129]),
        "layers.0.b": [200, 400],
        "scale": [],
        "empty": [],
    }
    digests = {n: _sharded_digest(n, v, splits[n]) for n, v in params.items()}
    assert model_hash(digests) == state_hash(params)


def test_hash_is_pinned_to_the_protocol_version() -> None:
    """The state hash is part of the protocol: sites and the coordinator of one version must
    compute the same one. Changing its definition changes this value: bump PROTOCOL_VERSION."""
    params = {
        "a": np.arange(HASH_BLOCK + 3, dtype=np.float32).reshape(-1, 1) / 7,
        "b": np.array([[1.0, -0.0], [2.0, 3.0]], dtype=np.float32),
    }
    assert (PROTOCOL_VERSION, state_hash(params)) == (7, "dcfcc74b4eb4f89b1d94b39351ef762a")


def test_hash_binds_values_names_shapes_and_not_the_byte_order() -> None:
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    base = state_hash({"x": x})
    changed = x.copy()
    changed[2, 3] = np.nextafter(changed[2, 3], np.float32(2))
    assert state_hash({"x": changed}) != base
    assert state_hash({"y": x}) != base
    assert state_hash({"x": x.reshape(4, 3)}) != base
    assert state_hash({"x": x, "y": x[:0]}) != base
    assert state_hash({"x": x.astype(">f4")}) == base
    assert state_hash({"x": x.astype(np.float64)}) == base
    # A tensor's digest is not a model's hash: swapping tensors between names is seen.
    y = x + 1
    assert state_hash({"x": x, "y": y}) != state_hash({"x": y, "y": x})


def test_a_block_cut_without_its_piece_is_refused_naming_the_tensor() -> None:
    value = np.ones(HASH_BLOCK + 10, np.float32)
    head = value[: HASH_BLOCK - 5]
    with pytest.raises(ValueError, match="'w'.*needs values"):
        partial_digests("w", value.shape, 0, head)
    # A piece that leaves a gap, or overlaps the values held, is refused too.
    gap = BoundaryPiece("w", HASH_BLOCK - 4, value[HASH_BLOCK - 4 : HASH_BLOCK])
    with pytest.raises(ValueError, match="'w'.*continues at"):
        partial_digests("w", value.shape, 0, head, [gap])
    # Pieces of another tensor are not taken for this one's.
    other = BoundaryPiece("v", HASH_BLOCK - 5, value[HASH_BLOCK - 5 : HASH_BLOCK])
    with pytest.raises(ValueError, match="needs values"):
        partial_digests("w", value.shape, 0, head, [other])
    with pytest.raises(ValueError, match="outside its"):
        partial_digests("w", value.shape, 20, value)


def test_combine_refuses_missing_repeated_and_foreign_blocks() -> None:
    value = np.ones(2 * HASH_BLOCK + 1, np.float32)
    blocks = partial_digests("w", value.shape, 0, value)
    assert sorted(blocks) == [0, 1, 2]
    assert combine("w", value.shape, [blocks]) == tensor_digest("w", value)
    with pytest.raises(ValueError, match="'w': 1 blocks missing"):
        combine("w", value.shape, [{i: d for i, d in blocks.items() if i != 1}])
    with pytest.raises(ValueError, match="block 2 digested twice"):
        combine("w", value.shape, [blocks, {2: blocks[2]}])
    with pytest.raises(ValueError, match="block 3 beyond"):
        combine("w", value.shape, [blocks, {3: blocks[2]}])
