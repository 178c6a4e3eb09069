"""The coordinator's shards: a deterministic, size-balanced cut of the model's tensors, and a
combined hash over the shards' digests that is the one-process state hash."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.wire.partition import (
    combined_hash,
    owner_of,
    partition,
    partition_digest,
    shard_hash,
    split_by_shard,
)
from comm.wire.tensors import state_hash, tensor_digest

pytestmark = pytest.mark.timeout(120)

_shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
_specs = st.dictionaries(st.text("abcdefgh.0123", min_size=1, max_size=8), _shapes, min_size=1)


@settings(max_examples=200, deadline=None)
@given(_specs, st.integers(1, 8), st.randoms(use_true_random=False))
def test_a_partition_is_disjoint_covering_and_independent_of_order(
    spec: dict[str, tuple[int, ...]], shards: int, rnd: random.Random
) -> None:
    if shards > len(spec):
        with pytest.raises(ValueError, match="at least one tensor"):
            partition(spec, shards)
        return
    parts = partition(spec, shards)
    assert len(parts) == shards
    assert all(parts), "no shard is empty"
    assert sorted(n for p in parts for n in p) == sorted(spec)
    assert all(list(p) == sorted(p) for p in parts)
    shuffled = list(spec.items())
    rnd.shuffle(shuffled)
    assert partition(dict(shuffled), shards) == parts
    # Balance: the largest shard holds less than the ideal share plus the largest tensor.
    sizes = {n: max(int(np.prod(s, dtype=np.int64)), 1) for n, s in spec.items()}
    loads = [sum(sizes[n] for n in p) for p in parts]
    assert max(loads) <= sum(sizes.values()) / shards + max(sizes.values())


def test_one_shard_owns_every_tensor() -> None:
    spec = {"b": (3, 4), "a": (5,), "c": ()}
    assert partition(spec, 1) == (("a", "b", "c"),)


def test_a_known_cut_is_stable() -> None:
    """A fixed example, so that a change of the rule (which would split a running federation
    differently at its sites and its shards) shows here."""
    spec = {
        "emb": (256, 64),
        "layers.0.w": (64, 64),
        "layers.1.w": (64, 64),
        "layers.0.b": (64,),
        "layers.1.b": (64,),
        "head": (64, 256),
    }
    assert partition(spec, 2) == (
        ("emb", "layers.0.b", "layers.0.w"),
        ("head", "layers.1.b", "layers.1.w"),
    )
    assert partition(spec, 3) == (
        ("emb",),
        ("head",),
        ("layers.0.b", "layers.0.w", "layers.1.b", "layers.1.w"),
    )


@pytest.mark.parametrize("shards", [0, -1, 1.5, True])
def test_shards_must_be_a_positive_integer(shards: object) -> None:
    with pytest.raises(ValueError, match="shards must be an integer >= 1"):
        partition({"a": (1,)}, shards)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_the_combined_hash_is_the_one_process_state_hash(shards: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    params = {
        f"t{i}": rng.standard_normal(tuple(rng.integers(1, 30, size=rng.integers(0, 3)))).astype(
            np.float32
        )
        for i in range(6)
    }
    parts = partition({n: a.shape for n, a in params.items()}, shards)
    per_shard = [{n: tensor_digest(n, params[n]) for n in names} for names in parts]
    assert combined_hash(per_shard) == state_hash(params)
    assert combined_hash(reversed(per_shard)) == state_hash(params)
    for names, digests in zip(parts, per_shard, strict=True):
        assert shard_hash(digests) == state_hash({n: params[n] for n in names})


def test_a_tensor_in_two_shards_is_refused() -> None:
    d = tensor_digest("a", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="'a' is digested by two shards"):
        combined_hash([{"a": d}, {"a": d}])
    with pytest.raises(ValueError, match="'a' is in shards 0 and 1"):
        owner_of([("a",), ("a",)])


def test_values_split_by_their_owner() -> None:
    parts = (("a", "c"), ("b",))
    assert split_by_shard({"c": 3, "b": 2, "a": 1}, parts) == [{"a": 1, "c": 3}, {"b": 2}]
    assert owner_of(parts) == {"a": 0, "b": 1, "c": 0}
    with pytest.raises(ValueError, match="'z' belongs to no shard"):
        split_by_shard({"z": 0}, parts)


def test_a_partition_digest_tells_cuts_apart() -> None:
    spec = {"a": (4,), "b": (3,), "c": (2,), "d": (1,)}
    digests = {partition_digest(partition(spec, s)) for s in (1, 2, 3, 4)}
    assert len(digests) == 4
    assert partition_digest(partition(spec, 2)) == partition_digest(partition(dict(spec), 2))
    assert partition_digest([("ab",), ("c",)]) != partition_digest([("a",), ("bc",)])
