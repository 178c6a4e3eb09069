"""One round as an object (coordinator/round.py): the late updates a closed round takes, how
much they weigh when a later close of their fragment merges them, and in which order."""

from __future__ import annotations

import numpy as np
import pytest

from comm.codecs.floats import Fp32Codec
from comm.wire.schema import Update
from comm.wire.tensors import encode_tensors
from coordinator.aggregate import Aggregator, ForwardResult, MeanResult, SparseForward, WeightedMean
from coordinator.round import Round, Taken, UpdateRefusal

pytestmark = pytest.mark.timeout(60)

SHAPES = {"w": (2,)}


def update(site: str, round_id: int, value: float, weight: float) -> Update:
    """``site``'s update for ``round_id``: w = [value, -value], trained from v0."""
    w = np.array([value, -value], np.float32)
    return Update(
        site_id=site,
        round_id=round_id,
        global_version=0,
        fragment=0,
        weight=weight,
        train_loss=1.0,
        compute_seconds=1.0,
        step_seconds=0.1,
        link_rtt_s=0.0,
        link_goodput_bps=0.0,
        payload=tuple(encode_tensors({"w": w}, Fp32Codec())),
    )


def opened(round_id: int, aggregator: Aggregator, *, num_fragments: int = 1) -> Round:
    """Round ``round_id`` of fragment 0, open to a, b, c and d over ``SHAPES``."""
    sites = ("a", "b", "c", "d")
    return Round(
        round_id=round_id,
        fragment=0,
        num_fragments=num_fragments,
        base_version=0,
        participants=sites,
        opened_at=0.0,
        deadline_at=10.0,
        quorum=1,
        aggregator=aggregator,
        fold=aggregator.fold(round_id, sites),
        tensors=dict(SHAPES),
    )


def take(r: Round, msg: Update, *, late: bool) -> None:
    taken = r.take(0.0, msg, staleness=0, horizon=8)
    assert isinstance(taken, Taken) and taken.late == late, taken


def closed(round_id: int, aggregator: Aggregator, *, num_fragments: int = 1) -> Round:
    """Round ``round_id``, closed having merged a's update (value 1, weight 1)."""
    r = opened(round_id, aggregator, num_fragments=num_fragments)
    take(r, update("a", round_id, 1.0, 1.0), late=False)
    r.close(("a",))
    return r


@pytest.mark.parametrize(
    ("num_fragments", "origin", "round_id", "divisor"),
    [
        (1, 1, 2, 2),  # missed one sync of its fragment
        (1, 1, 5, 5),  # four
        (3, 1, 4, 2),  # three fragments: round 4 is the fragment's next sync after round 1
        (3, 1, 10, 4),  # its third
        (3, 2, 4, 2),  # less than a cycle apart still counts as one sync missed
    ],
)
def test_a_late_update_is_divided_by_one_plus_the_syncs_it_missed(
    num_fragments: int, origin: int, round_id: int, divisor: int
) -> None:
    # 1 + max(1, (round_id - origin) // num_fragments)
    r = closed(origin, WeightedMean(), num_fragments=num_fragments)
    take(r, update("b", origin, 2.0, 4.0), late=True)
    taken, late = r.take_late(round_id)
    assert [(u.site_id, u.round_id, u.weight) for u in taken] == [("b", origin, 4.0)]
    assert late.origin == origin and late.divisor == divisor
    assert r.late_waiting == [] and r.late_fold is None  # handed over once


def test_the_mean_merges_each_late_rounds_mean_once_down_weighted() -> None:
    r1, r2 = closed(1, WeightedMean()), closed(2, WeightedMean())
    take(r1, update("b", 1, 2.0, 6.0), late=True)
    take(r1, update("c", 1, 4.0, 2.0), late=True)
    take(r2, update("d", 2, 8.0, 3.0), late=True)
    r3 = closed(3, WeightedMean())
    result, late = r3.result([r1, r2])
    assert isinstance(result, MeanResult)
    # Round 1's late mean missed two syncs (divisor 3), round 2's one (divisor 2).
    assert [(label, weight) for label, weight, _ in result.updates] == [
        ("round 3", 1.0),
        ("late@1", 8.0 / 3),
        ("late@2", 3.0 / 2),
    ]
    means = [m["w"] for _, _, m in result.updates]
    np.testing.assert_allclose(means[1], [2.5, -2.5], rtol=1e-6)  # (6*2 + 2*4) / 8
    np.testing.assert_array_equal(means[2], [8.0, -8.0])
    assert sorted((u.site_id, u.round_id) for u in late) == [("b", 1), ("c", 1), ("d", 2)]
    # Each late update is handed over once: the earlier rounds let go of them.
    for r in (r1, r2):
        assert r.late_waiting == [] and r.late_fold is None
    assert r3.fold is None


def test_the_sparse_forward_keeps_late_updates_by_round_then_site_down_weighted() -> None:
    sparse = SparseForward()
    r1, r2 = closed(1, sparse), closed(2, sparse)
    late_msgs = [
        update("d", 2, 8.0, 3.0),
        update("c", 1, 4.0, 2.0),
        update("b", 1, 2.0, 6.0),
        update("b", 2, 16.0, 5.0),
    ]
    for msg in late_msgs:
        take(r1 if msg.round_id == 1 else r2, msg, late=True)
    r3 = opened(3, sparse)
    on_time = [update("c", 3, 32.0, 7.0), update("a", 3, 64.0, 1.0)]
    for msg in on_time:
        take(r3, msg, late=False)
    r3.close(("a", "c"))
    result, late = r3.result([r1, r2])
    assert isinstance(result, ForwardResult)
    payloads = {(m.site_id, m.round_id): m.payload for m in late_msgs + on_time}
    # The on-time updates in site order, then each late one by round, then site; the late ones
    # divided by 1 + the syncs they missed (round 1: two, round 2: one).
    want = [
        (1.0, ("a", 3)),
        (7.0, ("c", 3)),
        (6.0 / 3, ("b", 1)),
        (2.0 / 3, ("c", 1)),
        (5.0 / 2, ("b", 2)),
        (3.0 / 2, ("d", 2)),
    ]
    assert [w for w, _ in result.parts] == [w for w, _ in want]
    assert all(got is payloads[key] for (_, got), (_, key) in zip(result.parts, want, strict=True))
    assert sorted((u.site_id, u.round_id) for u in late) == [
        ("b", 1),
        ("b", 2),
        ("c", 1),
        ("d", 2),
    ]
    for r in (r1, r2):
        assert r.late_waiting == [] and r.late_fold is None


@pytest.mark.parametrize("aggregator", [WeightedMean(), SparseForward()], ids=lambda a: a.name)
def test_a_close_lists_late_updates_in_the_order_they_were_taken(aggregator: Aggregator) -> None:
    # The round's history (late_merged) and its broadcast (Global.merged) list the late updates
    # it merges in the order they were accepted, across rounds; the sums go by round (then site)
    # whatever that order, so the step's arithmetic does not depend on it.
    r1, r2 = closed(1, aggregator), closed(2, aggregator)
    accepted = [("d", 2, 3.0), ("c", 1, 2.0), ("b", 2, 5.0), ("b", 1, 6.0)]
    for site, round_id, weight in accepted:
        take(r1 if round_id == 1 else r2, update(site, round_id, weight, weight), late=True)
    r3 = closed(3, aggregator)
    result, late = r3.result([r1, r2])
    assert [(u.site_id, u.round_id) for u in late] == [(s, r) for s, r, _ in accepted]
    if isinstance(result, MeanResult):
        assert [(label, w) for label, w, _ in result.updates] == [
            ("round 3", 1.0),
            ("late@1", 8.0 / 3),
            ("late@2", 8.0 / 2),
        ]
    else:
        assert isinstance(result, ForwardResult)
        assert [w for w, _ in result.parts] == [1.0, 6.0 / 3, 2.0 / 3, 5.0 / 2, 3.0 / 2]


def test_a_refused_late_update_leaves_no_late_fold() -> None:
    r = closed(1, WeightedMean(max_update_norm=10.0))
    huge = update("b", 1, 100.0, 1.0)  # norm 141 > 10: the fold refuses it
    refused = r.take(0.0, huge, staleness=0, horizon=8)
    assert isinstance(refused, UpdateRefusal) and "norm" in refused.detail
    assert r.late_fold is None and r.late == {} and r.late_waiting == []
    take(r, update("b", 1, 2.0, 1.0), late=True)  # the site may still send a good one
    assert r.late_fold is not None and list(r.late) == ["b"]
