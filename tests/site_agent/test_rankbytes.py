"""Encoded tensors between a site's ranks as raw bytes (site_agent.rankbytes).

Three spawned CPU processes in a gloo group gather each rank's encodings to rank 0 and
broadcast rank 0's to the others: every encoding arrives equal to the one sent (its header and
every buffer's dtype, shape and bytes, an empty buffer and a read-only one included) and
decodes to the same values; rank 0 keeps its own encodings as they are, not copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from tests.support.procgroup import LocalProcessGroup

pytestmark = pytest.mark.timeout(120)


def _encodings(rank: int) -> list[EncodedTensor]:
    rng = np.random.default_rng(rank)
    out = [
        get_codec(spec).encode(f"t{rank}.{i}", rng.standard_normal((9, 70)).astype(np.float32))
        for i, spec in enumerate(("int8", "int4:block=32", "fp16", "topk:0.1"))
    ]
    frozen = np.arange(12, dtype=np.float32)
    frozen.flags.writeable = False
    out.append(EncodedTensor(name=f"raw{rank}", shape=(12,), codec="fp32", buffers=(frozen,)))
    out.append(EncodedTensor(name=f"empty{rank}", shape=(0,), codec="fp32", rows=(3, 3)))
    return out


def _same(a: EncodedTensor, b: EncodedTensor) -> bool:
    return (
        (a.name, a.shape, a.codec, a.meta, a.rows) == (b.name, b.shape, b.codec, b.meta, b.rows)
        and len(a.buffers) == len(b.buffers)
        and all(
            np.asarray(x).dtype == np.asarray(y).dtype
            and np.asarray(x).shape == np.asarray(y).shape
            and np.asarray(x).tobytes() == np.asarray(y).tobytes()
            for x, y in zip(a.buffers, b.buffers, strict=True)
        )
    )


def _rank(rank: int, world: int) -> dict[str, Any]:
    from site_agent.rankbytes import broadcast_encoded, gather_encoded

    mine = _encodings(rank)
    gathered = gather_encoded(mine, dst=0)
    out: dict[str, Any] = {}
    if rank == 0:
        assert gathered is not None
        want = [enc for r in range(world) for enc in _encodings(r)]
        out["gathered"] = len(gathered) == len(want) and all(
            _same(a, b) for a, b in zip(gathered, want, strict=True)
        )
        out["own_not_copied"] = all(a is b for a, b in zip(gathered, mine, strict=False))
        out["decoded"] = all(
            np.array_equal(get_codec(a.codec).decode(a), get_codec(b.codec).decode(b))
            for a, b in zip(gathered, want, strict=True)
            if a.numel
        )
    else:
        out["gathered"] = gathered is None
    received = [broadcast_encoded(enc if rank == 0 else None) for enc in _encodings(0)]
    out["broadcast"] = all(_same(a, b) for a, b in zip(received, _encodings(0), strict=True))
    return out


@pytest.fixture(scope="module")
def results() -> Iterator[list[dict[str, Any]]]:
    with LocalProcessGroup(3, timeout_s=90) as group:
        yield group.run(_rank)


def test_every_rank_s_encodings_reach_the_leader_byte_for_byte(
    results: list[dict[str, Any]],
) -> None:
    assert all(r["gathered"] for r in results)
    assert results[0]["own_not_copied"] and results[0]["decoded"]


def test_the_leader_s_encodings_reach_every_rank_byte_for_byte(
    results: list[dict[str, Any]],
) -> None:
    assert all(r["broadcast"] for r in results)
