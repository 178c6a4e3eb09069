"""A site's link to a coordinator of several shards: updates cut by the shard owning each
tensor, joins to every shard, results put together from every shard's part, shard 0's plans."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import numpy as np
import pytest

from comm.codecs.floats import Fp32Codec
from comm.transport.stats import ChannelStats
from comm.wire.partition import partition
from comm.wire.schema import (
    Error,
    Eval,
    Global,
    Heartbeat,
    Join,
    Message,
    RoundCancel,
    RoundStart,
    SyncRequest,
    Update,
    Welcome,
)
from site_agent.shard_links import MAX_PENDING_RESULTS, ShardedLink

pytestmark = pytest.mark.timeout(60)

PARAMS = {
    "emb": np.ones((8, 4), np.float32),
    "layers.0.w": np.ones((4, 4), np.float32),
    "layers.1.w": np.ones((4, 4), np.float32),
    "head": np.ones((4, 8), np.float32),
}
PARTS = partition({n: a.shape for n, a in PARAMS.items()}, 2)


class Script:
    """A scripted link: what was sent, and what it will receive."""

    def __init__(self) -> None:
        self.stats = ChannelStats()
        self.sent: list[Message] = []
        self.inbox: deque[Message] = deque()
        self.closed = False

    def send(self, msg: Message) -> None:
        self.sent.append(msg)

    def recv(self, timeout_s: float) -> Message | None:
        return self.inbox.popleft() if self.inbox else None

    def close(self) -> None:
        self.closed = True


def _link() -> tuple[ShardedLink, list[Script]]:
    scripts = [Script(), Script()]
    return ShardedLink(scripts, PARTS), scripts


def _payload(names: list[str]) -> tuple:  # type: ignore[type-arg]
    codec = Fp32Codec()
    return tuple(codec.encode(n, PARAMS[n]) for n in names)


def _update() -> Update:
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
        payload=_payload(sorted(PARAMS)),
    )


def _global(shard: int, version: int = 3, state_hash: str = "combined") -> Global:
    return Global(
        round_id=version,
        base_version=version - 1,
        global_version=version,
        fragment=0,
        merged=("eu",),
        is_full=False,
        state_hash=state_hash if shard == 0 else f"shard-{shard}",
        signature=b"s" if shard == 0 else b"",
        evaluate=shard == 0,
        payload=_payload(list(PARTS[shard])),
    )


def _drain(link: ShardedLink, n: int = 8) -> list[Message]:
    out = []
    for _ in range(n):
        got = link.recv(0.0)
        if got is not None:
            out.append(got)
    return out


def test_an_update_goes_to_each_shard_cut_by_its_tensors() -> None:
    link, scripts = _link()
    link.send(_update())
    for shard, script in enumerate(scripts):
        (sent,) = script.sent
        assert isinstance(sent, Update)
        assert sorted(enc.name for enc in sent.payload) == sorted(PARTS[shard])
        assert replace(sent, payload=()) == replace(_update(), payload=())


def test_joins_and_heartbeats_go_to_every_shard_evaluations_to_shard_zero() -> None:
    link, scripts = _link()
    join = Join(site_id="eu", model_fingerprint="f", global_version=2, state_hash="h")
    beat = Heartbeat(site_id="eu", global_version=2, sent_at=1.0)
    link.send(join)
    link.send(beat)
    link.send(Eval(site_id="eu", global_version=2, val_loss=1.0))
    assert scripts[0].sent[:2] == scripts[1].sent == [join, beat]
    assert isinstance(scripts[0].sent[2], Eval) and len(scripts[0].sent) == 3


def test_a_tensor_no_shard_owns_is_refused() -> None:
    link, _ = _link()
    bad = replace(_update(), payload=(Fp32Codec().encode("stray", np.ones(2, np.float32)),))
    with pytest.raises(ValueError, match="'stray' belongs to no shard"):
        link.send(bad)


def test_a_welcome_comes_once_every_shard_welcomed() -> None:
    link, scripts = _link()
    welcome = Welcome(
        site_id="eu", session_id="s0", global_version=2, heartbeat_interval_s=1.0, need_init=False
    )
    scripts[0].inbox.append(welcome)
    assert _drain(link) == []
    scripts[1].inbox.append(replace(welcome, session_id="s1"))
    assert _drain(link) == [welcome]


def test_a_result_comes_once_every_shard_sent_its_part_with_shard_zeros_hash() -> None:
    link, scripts = _link()
    scripts[1].inbox.append(_global(1))
    assert _drain(link) == []
    scripts[0].inbox.append(_global(0))
    (got,) = _drain(link)
    assert isinstance(got, Global)
    assert sorted(enc.name for enc in got.payload) == sorted(PARAMS)
    assert (got.state_hash, got.signature, got.evaluate) == ("combined", b"s", True)


def test_results_that_never_complete_are_dropped_beyond_the_bound() -> None:
    link, scripts = _link()
    for version in range(3, 3 + MAX_PENDING_RESULTS + 2):
        scripts[1].inbox.append(_global(1, version))
    assert _drain(link, 20) == []
    assert len(link._results) == MAX_PENDING_RESULTS  # noqa: SLF001
    scripts[0].inbox.append(_global(0, 3 + MAX_PENDING_RESULTS + 1))
    (got,) = _drain(link)
    assert isinstance(got, Global) and got.global_version == 3 + MAX_PENDING_RESULTS + 1


def test_plans_come_from_shard_zero_and_errors_from_any() -> None:
    link, scripts = _link()
    plan = RoundStart(
        round_id=3,
        global_version=2,
        fragment_base_version=2,
        fragment=0,
        num_fragments=1,
        num_inner_steps=10,
        overlap=False,
        codec="fp32",
        deadline_s=30.0,
        participants=("eu",),
        evaluate=False,
        reason="",
    )
    echo = Heartbeat(site_id="eu", global_version=2, sent_at=1.0)
    error = Error(code=4, detail="not joined")
    scripts[1].inbox.extend([plan, echo, error])
    scripts[0].inbox.extend([plan, echo])
    got = _drain(link)
    assert got.count(plan) == 1 and got.count(echo) == 1 and error in got
    link.close()
    assert all(s.closed for s in scripts)


def test_a_plan_after_a_result_comes_after_it_whatever_shard_was_slower() -> None:
    """Shard 0 sends a result before the plan that names its version; the other shard's part
    may come later: the plan waits for the result (one coordinator's order on one link)."""
    link, scripts = _link()
    plan = RoundStart(
        round_id=4,
        global_version=3,
        fragment_base_version=3,
        fragment=0,
        num_fragments=1,
        num_inner_steps=10,
        overlap=False,
        codec="fp32",
        deadline_s=30.0,
        participants=("eu",),
        evaluate=False,
        reason="",
    )
    scripts[0].inbox.extend([_global(0), plan])
    assert _drain(link) == []
    scripts[1].inbox.append(_global(1))
    got = _drain(link)
    assert [type(m) for m in got] == [Global, RoundStart]
    assert got[1] == plan
    scripts[0].inbox.append(plan)  # with no result in part here, a plan comes at once
    assert _drain(link) == [plan]


def test_a_version_sent_as_a_delta_and_as_the_whole_model_is_asked_for_whole() -> None:
    link, scripts = _link()
    link.send(Join(site_id="eu", model_fingerprint="fp", global_version=1, state_hash="h"))
    for script in scripts:
        script.sent.clear()
    scripts[0].inbox.append(_global(0))
    scripts[1].inbox.append(replace(_global(1), is_full=True, base_version=-1))
    assert _drain(link) == []
    for script in scripts:
        assert script.sent == [SyncRequest(site_id="eu", global_version=-1)]
    for shard, script in enumerate(scripts):
        script.inbox.append(replace(_global(shard), is_full=True, base_version=-1))
    (got,) = _drain(link)
    assert isinstance(got, Global) and got.is_full and got.state_hash == "combined"
    assert sorted(enc.name for enc in got.payload) == sorted(PARAMS)


def test_one_link_per_shard() -> None:
    with pytest.raises(ValueError, match="one link per shard"):
        ShardedLink([Script()], PARTS)


def _plan(round_id: int, base: int) -> RoundStart:
    return RoundStart(
        round_id=round_id,
        global_version=base,
        fragment_base_version=base,
        fragment=0,
        num_fragments=1,
        num_inner_steps=10,
        overlap=False,
        codec="fp32",
        deadline_s=30.0,
        participants=("eu",),
        evaluate=False,
        reason="",
    )


def test_a_result_shard_zero_never_sent_holds_none_of_its_plans() -> None:
    """Shard 1 announced version 3, shard 0 restarted before it did: shard 0's plans after its
    restart come at once (the site catches up), not behind a result that never completes."""
    link, scripts = _link()
    scripts[1].inbox.append(_global(1))
    assert _drain(link) == []
    scripts[0].inbox.append(_plan(5, 2))
    assert _drain(link) == [_plan(5, 2)]


def test_a_join_drops_the_results_in_part_and_the_plans_held_behind_them() -> None:
    """Shard 0's part of version 3 came, shard 1 restarted before it sent its own: the site
    joins again, and shard 0's plans no longer wait for a result that never completes."""
    link, scripts = _link()
    scripts[0].inbox.extend([_global(0), _plan(4, 3)])
    assert _drain(link) == []
    link.send(Join(site_id="eu", model_fingerprint="fp", global_version=2, state_hash="h"))
    assert _drain(link) == [_plan(4, 3)]
    scripts[0].inbox.append(_plan(5, 3))
    assert _drain(link) == [_plan(5, 3)]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _cancel(round_id: int) -> RoundCancel:
    return RoundCancel(round_ids=(round_id,), reason="test")


def test_plans_held_behind_a_result_that_never_completes_come_after_the_wait() -> None:
    """Shard 1's part of version 3 never comes (its announcement was given up): after
    ``wait_s`` the result is dropped and shard 0's plans come (the site catches up on the plan
    naming a version it lacks); the part coming later holds nothing."""
    clock = _Clock()
    scripts = [Script(), Script()]
    link = ShardedLink(scripts, PARTS, wait_s=30.0, clock=clock)
    scripts[0].inbox.extend([_global(0), _plan(4, 3)])
    assert _drain(link) == []
    clock.now += 30.0
    assert _drain(link) == []
    clock.now += 0.5
    assert _drain(link) == [_plan(4, 3)]
    scripts[1].inbox.append(_global(1))
    scripts[0].inbox.append(_plan(5, 3))
    assert _drain(link) == [_plan(5, 3)]


def test_shard_zeros_next_rounds_plan_drops_a_result_that_never_completed() -> None:
    link, scripts = _link()
    scripts[0].inbox.extend([_global(0), _plan(4, 3), _cancel(4), _plan(5, 3)])
    assert _drain(link) == [_plan(4, 3), _cancel(4), _plan(5, 3)]
    scripts[0].inbox.append(_plan(6, 3))
    assert _drain(link) == [_plan(6, 3)]


def test_a_cancel_held_behind_a_result_that_never_completes_asks_every_shard() -> None:
    """No plan among what was held: the link asks every shard for what the site lacks (from
    the version the result built on)."""
    clock = _Clock()
    scripts = [Script(), Script()]
    link = ShardedLink(scripts, PARTS, wait_s=30.0, clock=clock)
    link.send(Join(site_id="eu", model_fingerprint="fp", global_version=2, state_hash="h"))
    for script in scripts:
        script.sent.clear()
    scripts[0].inbox.extend([_global(0), _cancel(4)])
    assert _drain(link) == []
    clock.now += 31.0
    assert _drain(link) == [_cancel(4)]
    for script in scripts:
        assert script.sent == [SyncRequest(site_id="eu", global_version=2)]
