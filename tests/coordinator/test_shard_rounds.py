"""A shard following shard 0 runs the same rounds in its own lifecycle: opened, frozen, closed
and aborted as told, taking the sites' parts of its tensors with the lifecycle's own ``take``;
a close lets go of what it holds of a site shard 0 leaves out."""

from __future__ import annotations

import numpy as np
import pytest

from comm.codecs.floats import Fp32Codec
from comm.wire.schema import ErrorCode, ShardAbort, ShardClose, ShardOpen, Update
from comm.wire.tensors import encode_tensors
from coordinator.aggregate import MeanResult, WeightedMean
from coordinator.config import RoundsConfig
from coordinator.lifecycle import Lifecycle
from coordinator.membership import Membership
from coordinator.round import Taken, UpdateRefusal
from coordinator.scheduler import RoundPlan
from coordinator.shard_peers import plan_fields
from coordinator.shard_rounds import abort_as_told, close_as_told, freeze, open_as_told

pytestmark = pytest.mark.timeout(60)

TENSORS = {"head": (2, 3)}
PLAN = RoundPlan(
    num_inner_steps=40, num_fragments=1, overlap=True, uplink={"eu": "fp32"}, downlink="int8"
)


def _book() -> Lifecycle:
    cfg = RoundsConfig(
        min_sites=2,
        quorum_fraction=1.0,
        max_rounds=0,
        max_open=2,
        num_fragments=1,
        max_staleness_rounds=8,
        round_deadline_s=60.0,
        grace_floor_s=1.0,
        grace_ceiling_s=10.0,
    )
    book = Lifecycle(cfg, Membership(30.0), WeightedMean(1e6))
    book.restore(global_version=3, round_counter=3, completed_rounds=3, next_fragment=0)
    return book


def _open(round_id: int = 4, base: int = 3) -> ShardOpen:
    return ShardOpen(
        round_id=round_id,
        base_version=base,
        fragment=0,
        participants=("eu", "us"),
        quorum=2,
        deadline_s=30.0,
        plan=plan_fields(PLAN),
    )


def _part(site: str, round_id: int = 4) -> Update:
    values = np.full(TENSORS["head"], 0.5, np.float32)
    return Update(
        site_id=site,
        round_id=round_id,
        global_version=3,
        fragment=0,
        weight=2.0,
        train_loss=1.0,
        compute_seconds=1.0,
        step_seconds=0.1,
        link_rtt_s=0.0,
        link_goodput_bps=0.0,
        payload=tuple(encode_tensors({"head": values}, Fp32Codec())),
    )


def test_a_round_opened_frozen_and_closed_as_shard_zero_says() -> None:
    book = _book()
    r = open_as_told(book, 10.0, _open(), TENSORS)
    assert (r.round_id, r.base_version, r.participants, r.quorum) == (4, 3, ("eu", "us"), 2)
    assert (r.deadline_at, r.plan, r.tensors) == (40.0, PLAN, TENSORS)
    assert book.round_counter == 4 and book.open_rounds == [r]
    assert isinstance(book.take(11.0, _part("eu")), Taken)
    assert freeze(book, 4) == {"eu"}
    late = book.take(12.0, _part("us"))
    assert isinstance(late, UpdateRefusal) and late.code is ErrorCode.STALE_ROUND
    assert "closing on every shard" in late.detail
    close = close_as_told(book, ShardClose(round_id=4, merged=("eu",), inner_steps=40, final=True))
    assert close.round is r and close.merged == ("eu",) and close.final
    assert book.global_version == 4 and not book.open_rounds
    after = book.take(13.0, _part("us"))
    assert isinstance(after, UpdateRefusal) and "closed on every shard" in after.detail
    assert not book.late, "no late update: one shard might merge it and another not"


def test_shard_zeros_word_that_does_not_fit_is_refused() -> None:
    book = _book()
    with pytest.raises(ValueError, match="counted to 3"):
        open_as_told(book, 0.0, _open(round_id=3), TENSORS)
    with pytest.raises(ValueError, match="builds on version 2, this shard's latest is 3"):
        open_as_told(book, 0.0, _open(base=2), TENSORS)
    open_as_told(book, 0.0, _open(), TENSORS)
    book.take(1.0, _part("eu"))
    with pytest.raises(ValueError, match="closed before it was frozen"):
        close_as_told(book, ShardClose(round_id=4, merged=("eu",), inner_steps=40, final=False))
    freeze(book, 4)
    with pytest.raises(ValueError, match=r"shard 0 merges \['eu', 'us'\], this shard holds"):
        close_as_told(
            book, ShardClose(round_id=4, merged=("eu", "us"), inner_steps=40, final=False)
        )
    with pytest.raises(ValueError, match="round 9 is not open"):
        freeze(book, 9)


def test_an_overlapping_round_builds_on_the_one_in_flight_and_aborts_with_it() -> None:
    book = _book()
    open_as_told(book, 0.0, _open(4, 3), TENSORS)
    open_as_told(book, 1.0, _open(5, 4), TENSORS)
    got = abort_as_told(book, ShardAbort(round_ids=(4, 5), reason="a shard left"))
    assert got is not None and got.round_ids == (4, 5)
    assert not book.open_rounds and book.global_version == 3
    assert abort_as_told(book, ShardAbort(round_ids=(4, 5), reason="again")) is None


class _Charge:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_a_close_lets_go_of_a_site_shard_zero_leaves_out() -> None:
    """The round holds eu's and us's parts; shard 0 merges eu only: us's part is dropped from
    the fold and its charge given back, and the result is eu's alone."""
    book = _book()
    r = open_as_told(book, 10.0, _open(), TENSORS)
    charges = {s: _Charge() for s in ("eu", "us")}
    for site in ("eu", "us"):
        assert isinstance(book.take(11.0, _part(site), charges[site]), Taken)
    assert r.fold is not None and r.fold.squared_norm("us") == pytest.approx(6 * 0.25)
    assert freeze(book, 4) == {"eu", "us"}
    close = close_as_told(book, ShardClose(round_id=4, merged=("eu",), inner_steps=40, final=False))
    assert close.merged == ("eu",) and r.received == {"eu"}
    assert (charges["us"].released, charges["eu"].released) == (1, 0)
    result, late = r.result()
    assert isinstance(result, MeanResult) and not late
    ((_, weight, _),) = result.updates
    assert weight == 2.0, "eu's weight alone: us's part is not in the mean"
    assert charges["eu"].released == 1, "the result taken: every charge given back"
