"""Shard 0's bookkeeping of the shards' rounds: every shard merges the same sites (those whose
part every shard holds and took, within the norm bound over the whole update; every other site
is left out everywhere), or the round is aborted everywhere, a version is committed only once
every shard saved it, and the combined hash is the one-process state hash."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.wire.partition import partition, shard_hash
from comm.wire.tensors import state_hash, tensor_digest
from coordinator.shard_plane import (
    AbortAll,
    CloseAll,
    CommitAll,
    Phase,
    Resume,
    ShardPlane,
    resume,
)

pytestmark = pytest.mark.timeout(120)

SITES = ("ap", "eu", "us")
PARAMS = {
    f"t{i}": np.random.default_rng(i).standard_normal((i + 1, 3)).astype(np.float32)
    for i in range(5)
}
PARTS = partition({n: a.shape for n, a in PARAMS.items()}, 3)


def _digests(shard: int) -> dict[str, bytes]:
    return {n: tensor_digest(n, PARAMS[n]) for n in PARTS[shard]}


def _plane(round_id: int = 1) -> ShardPlane:
    plane = ShardPlane(PARTS)
    plane.opened(round_id, SITES)
    return plane


def test_a_round_every_shard_folded_alike_closes_and_commits_the_combined_hash() -> None:
    plane = _plane()
    for shard in range(3):
        for site in ("eu", "us"):
            plane.folded(shard, 1, site)
    assert plane.complete(1) == {"eu", "us"} and plane.partial(1) == frozenset()
    plane.freeze(1)
    assert plane.frozen(0, 1, frozenset({"eu", "us"})) is None
    assert plane.frozen(2, 1, frozenset({"eu", "us"})) is None
    assert plane.frozen(1, 1, frozenset({"eu", "us"})) == CloseAll(1, frozenset({"eu", "us"}))
    assert plane.phase(1) is Phase.PREPARING
    assert plane.prepared(1, 1, 5, _digests(1)) is None
    assert plane.prepared(0, 1, 5, _digests(0)) is None
    commit = plane.prepared(2, 1, 5, _digests(2))
    assert isinstance(commit, CommitAll)
    assert (commit.round_id, commit.version) == (1, 5)
    assert commit.combined_hash == state_hash(PARAMS)
    assert commit.shard_hashes == tuple(shard_hash(_digests(s)) for s in range(3))
    plane.forget(1)
    with pytest.raises(ValueError, match="round 1 is not one shard 0 opened"):
        plane.phase(1)


def test_a_site_half_way_shows_as_partial() -> None:
    plane = _plane()
    plane.folded(0, 1, "eu")
    plane.folded(2, 1, "eu")
    assert plane.partial(1) == {"eu"} and plane.complete(1) == frozenset()
    plane.folded(1, 1, "eu")
    assert plane.complete(1) == {"eu"}


def _took(plane: ShardPlane, site: str, squared: tuple[float, ...] = (0.0, 0.0, 0.0)) -> None:
    for shard, sq in enumerate(squared):
        plane.folded(shard, 1, site, sq)


def test_a_site_a_shard_holds_no_part_of_is_left_out_and_the_others_close() -> None:
    plane = _plane()
    _took(plane, "eu")
    plane.folded(1, 1, "us")
    plane.freeze(1)
    plane.frozen(0, 1, frozenset({"eu"}))
    plane.frozen(1, 1, frozenset({"eu", "us"}))
    got = plane.frozen(2, 1, frozenset({"eu"}))
    assert got == CloseAll(
        1, frozenset({"eu"}), (("us", "shard 0 holds no part of it at the freeze"),)
    )
    assert plane.phase(1) is Phase.PREPARING


def test_a_part_refused_anywhere_leaves_its_site_out_everywhere() -> None:
    plane = _plane()
    _took(plane, "us")
    plane.folded(0, 1, "eu")
    plane.refused(1, 1, "eu", "bad_payload: tensor 'b' is not finite")
    assert plane.void(1) == {"eu"} and plane.partial(1) == frozenset()
    plane.folded(2, 1, "eu")
    assert plane.complete(1) == {"us"}, "a part refused: never complete"
    plane.freeze(1)
    plane.frozen(0, 1, frozenset({"eu", "us"}))
    plane.frozen(1, 1, frozenset({"eu", "us"}))  # a shard that says it holds what it refused
    got = plane.frozen(2, 1, frozenset({"eu", "us"}))
    assert isinstance(got, CloseAll) and got.merged == {"us"}
    assert got.left_out == (
        ("eu", "shard 1 refused its part: bad_payload: tensor 'b' is not finite"),
    )


def test_a_refusal_from_a_shard_that_took_the_part_is_a_duplicate_and_changes_nothing() -> None:
    plane = _plane()
    plane.folded(1, 1, "eu")
    plane.refused(1, 1, "eu", "duplicate")
    assert plane.void(1) == frozenset() and plane.partial(1) == {"eu"}


def test_the_norm_bound_is_the_whole_updates_over_every_shards_part() -> None:
    plane = ShardPlane(PARTS, max_norm=1e6)
    plane.opened(1, SITES)
    # 8e5 in a tensor of shard 0 and 8e5 in one of shard 2: each part within the bound, the
    # whole update 1.13e6 over it.
    _took(plane, "eu", (8e5**2, 0.0, 8e5**2))
    _took(plane, "us", (6e5**2, 0.0, 8e5**2 - 1))  # just under 1e6
    assert plane.norm(1, "eu") == pytest.approx(1.1314e6, rel=1e-4)
    assert plane.void(1) == {"eu"} and plane.complete(1) == {"us"}
    plane.freeze(1)
    for shard in range(3):
        got = plane.frozen(shard, 1, frozenset({"eu", "us"}))
    assert isinstance(got, CloseAll) and got.merged == {"us"}
    ((site, why),) = got.left_out
    assert site == "eu" and "update norm 1.13e+06 > bound 1e+06" in why


def test_fewer_than_the_quorum_left_aborts() -> None:
    plane = ShardPlane(PARTS)
    plane.opened(1, SITES, quorum=2)
    _took(plane, "eu")
    plane.folded(0, 1, "us")
    plane.folded(1, 1, "us")
    plane.refused(2, 1, "us", "not finite")
    plane.freeze(1)
    for shard in range(3):
        got = plane.frozen(shard, 1, frozenset({"eu", "us"}))
    assert isinstance(got, AbortAll)
    assert "1 updates every shard holds and took, quorum 2" in got.why
    assert "us: shard 2 refused its part: not finite" in got.why
    assert plane.phase(1) is Phase.ABORTED


def test_nothing_folded_is_an_abort() -> None:
    plane = _plane()
    plane.freeze(1)
    plane.frozen(0, 1, frozenset())
    plane.frozen(1, 1, frozenset())
    assert isinstance(plane.frozen(2, 1, frozenset()), AbortAll)


def test_shards_preparing_different_versions_abort() -> None:
    plane = _plane()
    _took(plane, "eu")
    plane.freeze(1)
    for shard in range(3):
        plane.frozen(shard, 1, frozenset({"eu"}))
    plane.prepared(0, 1, 5, _digests(0))
    got = plane.prepared(1, 1, 6, _digests(1))
    assert isinstance(got, AbortAll) and "prepared version 6, others 5" in got.why


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.folded(3, 1, "eu"), "shard 3 is not one of 3"),
        (lambda p: p.folded(0, 2, "eu"), "round 2 is not one shard 0 opened"),
        (lambda p: p.folded(0, 1, "xx"), "'xx' is not a participant"),
        (lambda p: p.frozen(0, 1, frozenset()), "round 1 is open, not freezing"),
        (lambda p: p.prepared(0, 1, 1, {}), "round 1 is open, not preparing"),
        (lambda p: p.opened(1, SITES), "round 1 is opened twice"),
        (lambda p: p.forget(1), "round 1 is still open"),
    ],
)
def test_a_report_out_of_protocol_is_refused_in_words(call: object, message: str) -> None:
    plane = _plane()
    with pytest.raises(ValueError, match=message):
        call(plane)  # type: ignore[operator]
    assert plane.phase(1) is Phase.OPEN


def test_a_shard_digesting_tensors_it_does_not_own_is_refused() -> None:
    plane = _plane()
    _took(plane, "eu")
    plane.freeze(1)
    for shard in range(3):
        plane.frozen(shard, 1, frozenset({"eu"}))
    with pytest.raises(ValueError, match="shard 0 digested other tensors than it owns"):
        plane.prepared(0, 1, 5, _digests(1))
    with pytest.raises(ValueError, match="shard 1 prepared twice"):
        plane.prepared(1, 1, 5, _digests(1))
        plane.prepared(1, 1, 5, _digests(1))


def test_a_committed_round_cannot_be_aborted() -> None:
    plane = _plane()
    _took(plane, "eu")
    plane.freeze(1)
    for shard in range(3):
        plane.frozen(shard, 1, frozenset({"eu"}))
    for shard in range(3):
        plane.prepared(shard, 1, 2, _digests(shard))
    with pytest.raises(ValueError, match="committed"):
        plane.abort(1, "late")


_event = st.tuples(st.integers(0, 2), st.sampled_from(SITES), st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=14), st.integers(0, 14), st.randoms(use_true_random=False))
def test_a_close_merges_the_same_sites_everywhere_or_none(
    events: list[tuple[int, str, bool]], freeze_at: int, rnd: object
) -> None:
    """Parts taken or refused in any order, the freeze at any point, the shards' answers in any
    order: a CloseAll names exactly the sites every shard took and none refused, and as left
    out every other site some shard holds; it aborts only when no site is left."""
    plane = _plane()
    taken: list[set[str]] = [set(), set(), set()]
    refused: set[str] = set()
    for i, (shard, site, ok) in enumerate(events):
        if i == freeze_at:
            plane.freeze(1)
        if site in taken[shard]:
            continue
        if ok:
            plane.folded(shard, 1, site)
            taken[shard].add(site)
        else:
            plane.refused(shard, 1, site)
            refused.add(site)
    if plane.phase(1) is Phase.OPEN:
        plane.freeze(1)
    order = [0, 1, 2]
    rnd.shuffle(order)  # type: ignore[attr-defined]
    outcome = None
    for shard in order:
        outcome = plane.frozen(shard, 1, frozenset(taken[shard]))
    everywhere = (taken[0] & taken[1] & taken[2]) - refused
    if isinstance(outcome, CloseAll):
        assert outcome.merged == everywhere and outcome.merged
        held = taken[0] | taken[1] | taken[2]
        assert {s for s, _ in outcome.left_out} == held - everywhere
    else:
        assert isinstance(outcome, AbortAll)
        assert not everywhere


def test_a_shard_resumes_at_shard_zeros_version_or_rolls_back_one() -> None:
    assert resume(7, 7) == Resume(7, False)
    assert resume(7, 8) == Resume(7, True)
    # Rounds 8 and 9 aborted, round 10 saved and never committed: its id is its version.
    assert resume(7, 10) == Resume(7, True)
    for held in (0, 6):
        with pytest.raises(ValueError, match=f"holds version {held} and shard 0 committed 7"):
            resume(7, held)


def test_rounds_in_flight_abort_together_and_committed_ones_stay() -> None:
    plane = _plane(1)
    plane.opened(2, SITES)
    plane.opened(3, SITES)
    for shard in range(3):
        plane.folded(shard, 1, "eu")
    plane.freeze(1)
    for shard in range(3):
        plane.frozen(shard, 1, frozenset({"eu"}))
    for shard in range(3):
        plane.prepared(shard, 1, 2, _digests(shard))
    plane.freeze(2)
    assert plane.in_flight() == (2, 3)
    assert plane.abort_in_flight("shard 2 restarted") == (2, 3)
    assert [plane.phase(i) for i in (1, 2, 3)] == [Phase.COMMITTED, Phase.ABORTED, Phase.ABORTED]
    assert plane.in_flight() == () and plane.abort_in_flight("again") == ()


def test_a_round_is_ready_once_every_shard_opened_it() -> None:
    plane = _plane()
    assert not plane.ready(1)
    assert plane.acknowledged(2, 1) is False
    assert plane.acknowledged(2, 1) is False, "a second ack changes nothing"
    assert plane.acknowledged(1, 1) is True and plane.ready(1)
    assert plane.acknowledged(1, 1) is False, "ready is said once"
    with pytest.raises(ValueError, match="shard 3 is not one of 3"):
        plane.acknowledged(3, 1)
