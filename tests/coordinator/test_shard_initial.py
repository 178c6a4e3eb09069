"""A shard of a sharded coordinator draws θ0 a tensor at a time and keeps only its part: the
part and the whole model's hash are a single coordinator's, and the shard never holds the rest."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from comm.wire.partition import partition
from comm.wire.tensors import state_hash
from coordinator.sharding import ShardIdentity, keep_part
from site_agent.jobs.bytegpt.model import ByteGPT, ModelConfig, initial_parameters, initial_tensors

pytestmark = pytest.mark.timeout(60)

CFG = ModelConfig(vocab_size=256, context_len=32, d_model=64, num_layers=4, num_heads=4)
SEED = 1234


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in ByteGPT(cfg).named_parameters()}


def _identity(index: int, count: int) -> ShardIdentity:
    return ShardIdentity(index=index, count=count, source="test")


def test_theta0_drawn_a_tensor_at_a_time_is_initial_parameters_bit_for_bit() -> None:
    whole = initial_parameters(CFG, SEED)
    drawn = list(initial_tensors(CFG, SEED))
    assert [name for name, _ in drawn] == list(whole)
    for name, value in drawn:
        assert value.dtype == np.float32
        assert np.array_equal(value, whole[name]), name


def test_each_shard_keeps_its_part_and_the_whole_hash() -> None:
    whole = initial_parameters(CFG, SEED)
    shapes = _shapes(CFG)
    parts = partition(shapes, 3)
    for index in range(3):
        own, model = keep_part(initial_tensors(CFG, SEED), shapes, _identity(index, 3))
        assert model.state_hash == state_hash(whole)
        assert dict(model.shapes) == shapes
        assert set(own) == set(parts[index])
        for name, value in own.items():
            assert np.array_equal(value, whole[name])


def test_a_shard_never_holds_the_rest_of_theta0() -> None:
    shapes = _shapes(CFG)
    count = 4
    sizes = {n: int(np.prod(s)) * 4 for n, s in shapes.items()}
    whole_bytes = sum(sizes.values())
    largest = max(sizes.values())
    for index in range(count):
        part = partition(shapes, count)[index]
        own_bytes = sum(sizes[n] for n in part)
        tracemalloc.start()
        try:
            own, _ = keep_part(initial_tensors(CFG, SEED), shapes, _identity(index, count))
            kept, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert sum(v.nbytes for v in own.values()) == own_bytes
        # The part, plus the one module being drawn (at most two of its tensors in flight)
        # and the bookkeeping: never the rest of the model.
        assert peak <= own_bytes + 2 * largest + 256 * 1024, (index, peak, own_bytes)
        assert peak < whole_bytes * 0.75, (index, peak, whole_bytes)
        del own


def test_a_tensor_outside_the_spec_is_refused() -> None:
    shapes = _shapes(CFG)
    bad = dict(shapes)
    bad.pop(next(iter(bad)))
    with pytest.raises(ValueError, match="not in the model's spec"):
        keep_part(initial_tensors(CFG, SEED), bad, _identity(0, 2))
    more = {**shapes, "extra.weight": (3,)}
    with pytest.raises(ValueError, match="end before 'extra.weight'"):
        keep_part(initial_tensors(CFG, SEED), more, _identity(0, 2))
