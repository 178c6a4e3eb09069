"""A model's tensors split over the coordinator's shards, and the state hash of a sharded model.

With ``[coordinator] shards = S`` the model's tensors are cut into S disjoint sets, one per
coordinator process. The cut is a pure function of the tensors' names and shapes and of S
(:func:`partition`), so every shard and every site computes the same one from the model's spec
and nothing about it travels.

Each shard holds whole tensors, so its tensors' digests (:func:`comm.wire.tensors.tensor_digest`)
are exactly the ones a single coordinator holding the whole model computes: the shard's own hash
is :func:`comm.wire.tensors.model_hash` over its tensors' digests (:func:`shard_hash`), and the
hash over every shard's digests together (:func:`combined_hash`) equals
:func:`comm.wire.tensors.state_hash` of the whole model, bit for bit. A site compares that one
hash, whether the federation's coordinator is one process or S.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from comm.wire.tensors import model_hash

Shape = Sequence[int]
V = TypeVar("V")


def _numel(shape: Shape) -> int:
    return math.prod(int(d) for d in shape)


def partition(spec: Mapping[str, Shape], shards: int) -> tuple[tuple[str, ...], ...]:
    """The tensor names of ``spec`` (name -> shape) in ``shards`` disjoint sets balanced by
    element count, each set in name order.

    Largest tensor first (ties by name), each goes to the shard holding the fewest elements so
    far (ties: the lowest index), so the largest shard exceeds the ideal share by less than the
    largest tensor; the result depends only on the names, the shapes and ``shards``, never on
    the order of ``spec``. A shard may not end up empty: ValueError when ``shards`` exceeds the
    number of tensors, or is below 1."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be an integer >= 1, got {shards!r}")
    if shards > len(spec):
        raise ValueError(
            f"{shards} shards for a model of {len(spec)} tensors: each shard must own at least "
            "one tensor"
        )
    sized = sorted(((_numel(shape), name) for name, shape in spec.items()), key=_largest_first)
    loads = [0] * shards
    owned: list[list[str]] = [[] for _ in range(shards)]
    for numel, name in sized:
        target = min(range(shards), key=lambda s: (loads[s], s))
        # An empty tensor still takes a place, so S tensors of size 0 still fill S shards.
        loads[target] += max(numel, 1)
        owned[target].append(name)
    return tuple(tuple(sorted(names)) for names in owned)


def _largest_first(item: tuple[int, str]) -> tuple[int, str]:
    numel, name = item
    return (-numel, name)


def partition_digest(parts: Sequence[Sequence[str]]) -> str:
    """A short digest of a partition (each shard's names in order), so that two processes can
    check that they cut the model alike before they exchange anything about it."""
    h = hashlib.blake2b(digest_size=16, person=b"crossdc:shards")
    for names in parts:
        h.update(len(names).to_bytes(8, "little"))
        for name in names:
            encoded = name.encode()
            h.update(len(encoded).to_bytes(8, "little") + encoded)
    return h.hexdigest()


def owner_of(parts: Sequence[Sequence[str]]) -> dict[str, int]:
    """Each tensor name's shard in ``parts`` (as :func:`partition` gives them)."""
    out: dict[str, int] = {}
    for shard, names in enumerate(parts):
        for name in names:
            if name in out:
                raise ValueError(f"tensor {name!r} is in shards {out[name]} and {shard}")
            out[name] = shard
    return out


def shard_hash(digests: Mapping[str, bytes]) -> str:
    """One shard's own state hash: :func:`~comm.wire.tensors.model_hash` over its tensors'
    digests (the state hash of the tensors it owns, as a model by themselves)."""
    return model_hash(digests)


def combined_hash(per_shard: Iterable[Mapping[str, bytes]]) -> str:
    """The state hash of the whole model from every shard's tensor digests: equal to
    :func:`~comm.wire.tensors.state_hash` of the model held in one piece. ValueError names a
    tensor two shards both give."""
    merged: dict[str, bytes] = {}
    for shard, digests in enumerate(per_shard):
        for name, digest in digests.items():
            if name in merged:
                raise ValueError(f"tensor {name!r} is digested by two shards (again by {shard})")
            merged[name] = digest
    return model_hash(merged)


def split_by_shard(values: Mapping[str, V], parts: Sequence[Sequence[str]]) -> list[dict[str, V]]:
    """``values`` (keyed by tensor name) cut into one mapping per shard, each in the shard's
    name order; ValueError names a tensor that no shard owns."""
    owner = owner_of(parts)
    out: list[dict[str, V]] = [{} for _ in parts]
    for name in sorted(values):
        shard = owner.get(name)
        if shard is None:
            raise ValueError(f"tensor {name!r} belongs to no shard")
        out[shard][name] = values[name]
    return out
