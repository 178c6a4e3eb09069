"""Two shards of a coordinator as services (``coordinator.shard_service``), in-process over tcp
loopback: shard 0 and shard 1 each a Coordinator of its own tensors, their control channel,
and sites that hold one channel per shard (``site_agent.shard_links.ShardedLink``). Rounds
reach the sites once both shards opened them, close only over what both shards folded, and the
sites' results (put together from both shards) equal one coordinator's bit for bit, under the
one hash (a site whose part one shard never got is left out on both: test_shard_left_out)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import zmq

from comm.codecs.floats import Fp32Codec
from comm.security.rolekits import SecurityConfig
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.partition import partition
from comm.wire.schema import (
    Global,
    Join,
    Message,
    RoundCancel,
    RoundStart,
    ShardCommit,
    ShardPrepared,
    Update,
    Welcome,
)
from comm.wire.tensors import encode_tensors, state_hash
from coordinator.config import CoordinatorConfig
from coordinator.service import Coordinator, InitialModel
from coordinator.shard_service import FollowShard, LeadShard
from coordinator.sharding import ShardIdentity, own_part
from coordinator.state import MemoryStateStore
from site_agent.shard_links import ShardedLink

pytestmark = pytest.mark.timeout(90)

PARAMS = {
    "w": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.ones(3, np.float32),
    "c": np.linspace(-1, 1, 4, dtype=np.float32),
}
SHAPES = {k: v.shape for k, v in PARAMS.items()}
PARTS = partition(SHAPES, 2)
SITES = ("eu", "us", "ap")


def _delta(site: str, round_id: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([SITES.index(site), round_id])
    return {k: rng.standard_normal(v.shape).astype(np.float32) * 0.1 for k, v in PARAMS.items()}


def _config(**overrides: Any) -> CoordinatorConfig:
    base: dict[str, Any] = {
        "bind": "tcp://127.0.0.1:0",
        "state_dir": "",
        "metrics_port": 0,
        "min_sites": 3,
        "num_inner_steps": 3,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "outer_warmup_steps": 0,
        "uplink_codec": "fp32",
        "downlink_codec": "int8",
        "overlap": False,
        "max_rounds": 3,
        "keep_checkpoints": 2,
        "security": SecurityConfig(insecure=True),
    }
    return CoordinatorConfig(**{**base, **overrides})


class _Site:
    """A scripted site: its link (one channel, or one per shard) and what it received."""

    def __init__(self, ctx: zmq.Context[Any], site_id: str, endpoints: list[str]) -> None:
        self.site_id = site_id
        chans = [
            DealerChannel(ChannelConfig(linger_s=0.1), identity=site_id, context=ctx)
            for _ in endpoints
        ]
        for chan, endpoint in zip(chans, endpoints, strict=True):
            chan.connect(endpoint)
        self.link: Any = chans[0] if len(chans) == 1 else ShardedLink(chans, PARTS)
        self.inbox: list[Message] = []

    def take(self, kind: type) -> Any:
        for i, msg in enumerate(self.inbox):
            if isinstance(msg, kind):
                return self.inbox.pop(i)
        return None


class _Federation:
    """Coordinator processes (one, or two shards) stepped in turn, and the sites."""

    def __init__(self, step: Callable[[], None], endpoints: list[str]) -> None:
        self._step = step
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sites = {s: _Site(self.ctx, s, endpoints) for s in SITES}

    def pump(self) -> None:
        self._step()
        for site in self.sites.values():
            msg = site.link.recv(0.0)
            if msg is not None:
                site.inbox.append(msg)

    def expect(self, site_id: str, kind: type, steps: int = 1500) -> Any:
        site = self.sites[site_id]
        for _ in range(steps):
            got = site.take(kind)
            if got is not None:
                return got
            self.pump()
        raise AssertionError(f"{site_id} got no {kind.__name__}")

    def close(self) -> None:
        for site in self.sites.values():
            site.link.close()
        self.ctx.destroy(linger=0)


@contextlib.contextmanager
def _single(**overrides: Any) -> Iterator[tuple[_Federation, Coordinator]]:
    """One coordinator of the whole model (``_config(**overrides)``), started, and the sites."""
    coord = Coordinator(
        _config(**overrides), store=MemoryStateStore(), initial=InitialModel(dict(PARAMS), "fp")
    )
    coord.start()
    fed = _Federation(lambda: coord.step(0.002), [coord.endpoint])
    try:
        yield fed, coord
    finally:
        fed.close()
        coord.close()


@contextlib.contextmanager
def running_shards(
    coords: Sequence[Coordinator],
    parts: Sequence[Sequence[str]] | None,
    whole_hash0: str | None,
) -> Iterator[tuple[_Federation, LeadShard, FollowShard]]:
    """Shard 0 and shard 1 of 2 over ``coords`` (each a shard's Coordinator), stepped in turn,
    and the sites; everything closed after (a coordinator whose shard never started too)."""
    lead = LeadShard(
        coords[0],
        ShardIdentity(0, 2, "test"),
        parts,
        kit=None,
        control_bind="tcp://127.0.0.1:0",
        whole_hash0=whole_hash0,
    )
    follow: FollowShard | None = None
    fed: _Federation | None = None
    try:
        lead.start()
        follow = FollowShard(
            coords[1],
            ShardIdentity(1, 2, "test"),
            parts,
            kit=None,
            control_endpoint=lead.control_endpoint,
            whole_hash0=whole_hash0,
        )
        follow.start()
        both = follow

        def step() -> None:
            lead.step(0.002)
            both.step(0.002)

        fed = _Federation(step, [lead.endpoint, follow.endpoint])
        yield fed, lead, follow
    finally:
        if fed is not None:
            fed.close()
        lead.close()
        if follow is not None:
            follow.close()
        else:
            coords[1].close()


@contextlib.contextmanager
def _sharded(**overrides: Any) -> Iterator[tuple[_Federation, LeadShard, FollowShard]]:
    coords = [
        Coordinator(
            _config(shards=2, **overrides),
            store=MemoryStateStore(),
            initial=InitialModel(own_part(PARAMS, SHAPES, ShardIdentity(i, 2, "test")), "fp"),
        )
        for i in range(2)
    ]
    with running_shards(coords, PARTS, state_hash(PARAMS)) as running:
        yield running


def _join_all(fed: _Federation) -> None:
    for s in SITES:
        fed.sites[s].link.send(
            Join(
                site_id=s,
                model_fingerprint="fp",
                global_version=0,
                state_hash=state_hash(PARAMS),
                capabilities={},
            )
        )
        welcome: Welcome = fed.expect(s, Welcome)
        assert welcome.global_version == 0 and not welcome.need_init


def _update(site: str, rs: RoundStart) -> Update:
    return Update(
        site_id=site,
        round_id=rs.round_id,
        global_version=rs.fragment_base_version,
        fragment=0,
        weight=100.0 + 50 * SITES.index(site),
        train_loss=2.0,
        compute_seconds=1.0,
        step_seconds=0.3,
        link_rtt_s=0.1,
        link_goodput_bps=1e8,
        payload=encode_tensors(_delta(site, rs.round_id), Fp32Codec()),
    )


def _run(fed: _Federation) -> list[Global]:
    """Every site joins in sync at θ0 and sends its update to each of the rounds; the results
    eu receives."""
    _join_all(fed)
    results = []
    for _ in range(3):
        starts = {s: fed.expect(s, RoundStart) for s in SITES}
        for s in SITES:
            fed.sites[s].link.send(_update(s, starts[s]))
        results.append(fed.expect("eu", Global))
        for s in ("us", "ap"):
            assert fed.expect(s, Global).state_hash == results[-1].state_hash
    return results


def _params_after(results: list[Global]) -> dict[str, np.ndarray]:
    from comm.wire.tensors import decode_tensors

    params = {k: v.copy() for k, v in PARAMS.items()}
    for g in results:
        delta = decode_tensors(g.payload)
        for k in params:
            params[k] += delta[k]
        assert state_hash(params) == g.state_hash
    return params


def test_two_shards_give_the_sites_one_coordinators_results_bit_for_bit() -> None:
    with _single() as (fed, coord):
        single = _run(fed)
        assert coord.state is not None
        single_params = {k: v.copy() for k, v in coord.state.params.items()}
    with _sharded() as (fed, lead, follow):
        sharded = _run(fed)
        assert lead.committed == 3
        status = lead.coord.status()
        assert status["shard"] == 0 and status["shards"] == 2
        assert lead.coord.state is not None and follow.coord.state is not None
        held = {**lead.coord.state.params, **follow.coord.state.params}
        assert set(lead.coord.state.params) == set(PARTS[0])
    assert [g.state_hash for g in sharded] == [g.state_hash for g in single]
    for a, b in zip(sharded, single, strict=True):
        assert (a.round_id, a.base_version, a.global_version) == (
            b.round_id,
            b.base_version,
            b.global_version,
        )
    params = _params_after(sharded)
    for k in PARAMS:
        assert params[k].tobytes() == _params_after(single)[k].tobytes()
        assert held[k].tobytes() == single_params[k].tobytes()


def test_a_shard_back_after_saving_a_round_never_committed_goes_back_a_version() -> None:
    """Shard 1 saves round 2's version, its report is lost and it restarts: shard 0 (which
    saved too) and the restarted shard 1 both go back to version 1, the round is cancelled,
    and the next round closes on both shards under the one hash."""
    whole = state_hash(PARAMS)
    stores = [MemoryStateStore(), MemoryStateStore()]
    identities = [ShardIdentity(i, 2, "test") for i in range(2)]

    def coordinator(i: int, **overrides: Any) -> Coordinator:
        return Coordinator(
            _config(shards=2, **overrides),
            store=stores[i],
            initial=InitialModel(own_part(PARAMS, SHAPES, identities[i]), "fp"),
        )

    lead = LeadShard(
        coordinator(0),
        identities[0],
        PARTS,
        kit=None,
        control_bind="tcp://127.0.0.1:0",
        whole_hash0=whole,
    )
    shards: list[FollowShard] = []
    fed: _Federation | None = None
    try:
        lead.start()
        shards.append(
            FollowShard(
                coordinator(1),
                identities[1],
                PARTS,
                kit=None,
                control_endpoint=lead.control_endpoint,
                whole_hash0=whole,
            )
        )
        shards[0].start()

        def step() -> None:
            lead.step(0.002)
            shards[-1].step(0.002)

        fed = _Federation(step, [lead.endpoint, shards[0].endpoint])
        _join_all(fed)
        starts = {s: fed.expect(s, RoundStart) for s in SITES}
        for s in SITES:
            fed.sites[s].link.send(_update(s, starts[s]))
        assert fed.expect("eu", Global).global_version == 1
        starts = {s: fed.expect(s, RoundStart) for s in SITES}
        rid = starts["eu"].round_id
        # Shard 1's word that it saved round 2 is lost.
        first = shards[0]
        report = first.follower.report
        first.follower.report = lambda msg: (  # type: ignore[method-assign]
            None if isinstance(msg, ShardPrepared) else report(msg)
        )
        for s in SITES:
            fed.sites[s].link.send(_update(s, starts[s]))
        for _ in range(3000):
            fed.pump()
            held = [c.state.global_version for c in (lead.coord, first.coord) if c.state]
            if held == [rid, rid]:
                break
        assert held == [rid, rid], held
        assert lead.committed == 1
        port = first.endpoint.rpartition(":")[2]
        first.close()
        # Shard 1 restarts on its state (it holds round 2's version) at the same endpoint.
        shards.append(
            FollowShard(
                coordinator(1, bind=f"tcp://127.0.0.1:{port}"),
                identities[1],
                PARTS,
                kit=None,
                control_endpoint=lead.control_endpoint,
                whole_hash0=whole,
            )
        )
        shards[1].start()
        cancel: RoundCancel = fed.expect("eu", RoundCancel)
        assert rid in cancel.round_ids
        for _ in range(2000):
            fed.pump()
            st0, st1 = lead.coord.state, shards[1].coord.state
            if st0 and st1 and st0.global_version == st1.global_version == 1:
                break
        assert lead.coord.state is not None and shards[1].coord.state is not None
        assert lead.coord.state.global_version == shards[1].coord.state.global_version == 1
        assert stores[0].state is not None and stores[0].state.global_version == 1
        assert stores[1].state is not None and stores[1].state.global_version == 1
        assert [h["round_id"] for h in lead.coord.state.history] == [1]
        # The sites join the restarted shard again; the next round closes on both.
        for s in SITES:
            fed.sites[s].link.links[1].send(
                Join(
                    site_id=s,
                    model_fingerprint="fp",
                    global_version=1,
                    state_hash=lead.coord.model.site_hash(),
                    capabilities={},
                )
            )
        for s in SITES:
            while True:
                start = fed.expect(s, RoundStart)
                if start.round_id > rid:
                    break
            fed.sites[s].link.send(_update(s, start))
        g: Global = fed.expect("eu", Global)
        assert g.global_version > rid and g.base_version == 1
        whole_params = {**lead.coord.state.params, **shards[1].coord.state.params}
        assert state_hash(whole_params) == g.state_hash
    finally:
        if fed is not None:
            fed.close()
        lead.close()
        for shard in shards:
            with contextlib.suppress(Exception):
                shard.close()


def test_a_site_behind_is_caught_up_by_every_shards_deltas() -> None:
    """A site that joins holding version 1 when the shards are at 2 gets each shard's delta
    from 1 to 2 (the shards' delta logs know version 1 by the whole model's hash) and the link
    puts them together: the whole model at 2, under its hash."""
    with _sharded(max_rounds=2) as (fed, lead, follow):
        _join_all(fed)
        results = []
        for _ in range(2):
            starts = {s: fed.expect(s, RoundStart) for s in SITES}
            for s in SITES:
                fed.sites[s].link.send(_update(s, starts[s]))
            results.append(fed.expect("eu", Global))
        late = _Site(fed.ctx, "sa", [lead.endpoint, follow.endpoint])
        fed.sites["sa"] = late
        late.link.send(
            Join(
                site_id="sa",
                model_fingerprint="fp",
                global_version=results[0].global_version,
                state_hash=results[0].state_hash,
                capabilities={},
            )
        )
        fed.expect("sa", Welcome)
        g: Global = fed.expect("sa", Global)
        assert not g.is_full
        assert (g.base_version, g.global_version) == (
            results[0].global_version,
            results[1].global_version,
        )
        assert g.state_hash == results[1].state_hash
        assert sorted(e.name for e in g.payload) == sorted(PARAMS)


def _deaf_to_commits(handle: Callable[[Any], None]) -> Callable[[Any], None]:
    return lambda event: None if isinstance(event, ShardCommit) else handle(event)


def test_a_shard_that_missed_a_commit_restarts_on_it_and_the_sites_get_the_whole_model() -> None:
    """Shard 0 commits round 2 but shard 1 never hears it (its part of the result is never
    sent) and restarts holding the committed version: it keeps it, learns its hash from shard
    0, and the sites, which got one part of the result, ask for the whole model and get it from
    both shards put together under the one hash; the next round closes on both."""
    whole = state_hash(PARAMS)
    stores = [MemoryStateStore(), MemoryStateStore()]
    identities = [ShardIdentity(i, 2, "test") for i in range(2)]

    def coordinator(i: int, **overrides: Any) -> Coordinator:
        return Coordinator(
            _config(shards=2, **overrides),
            store=stores[i],
            initial=InitialModel(own_part(PARAMS, SHAPES, identities[i]), "fp"),
        )

    lead = LeadShard(
        coordinator(0),
        identities[0],
        PARTS,
        kit=None,
        control_bind="tcp://127.0.0.1:0",
        whole_hash0=whole,
    )
    shards: list[FollowShard] = []
    fed: _Federation | None = None

    def follower(**overrides: Any) -> FollowShard:
        return FollowShard(
            coordinator(1, **overrides),
            identities[1],
            PARTS,
            kit=None,
            control_endpoint=lead.control_endpoint,
            whole_hash0=whole,
        )

    try:
        lead.start()
        shards.append(follower())
        shards[0].start()

        def step() -> None:
            lead.step(0.002)
            shards[-1].step(0.002)

        fed = _Federation(step, [lead.endpoint, shards[0].endpoint])
        _join_all(fed)
        for _ in range(2):
            starts = {s: fed.expect(s, RoundStart) for s in SITES}
            if starts["eu"].round_id == 2:
                # Shard 1 never hears round 2's commit.
                first = shards[0]
                first._on = _deaf_to_commits(first._on)  # type: ignore[method-assign]
            for s in SITES:
                fed.sites[s].link.send(_update(s, starts[s]))
            if starts["eu"].round_id == 1:
                assert fed.expect("eu", Global).global_version == 1
        for _ in range(3000):
            fed.pump()
            if lead.committed == 2:
                break
        assert lead.committed == 2
        assert shards[0].coord.state is not None
        assert shards[0].coord.state.global_version == 2
        port = shards[0].endpoint.rpartition(":")[2]
        shards[0].close()
        shards.append(follower(bind=f"tcp://127.0.0.1:{port}"))
        shards[1].start()
        for _ in range(2000):
            fed.pump()
            if shards[1].follower.resumed is not None:
                break
        restarted = shards[1].coord
        assert restarted.state is not None and restarted.state.global_version == 2
        assert restarted.model.site_hash() == lead.coord.model.site_hash()
        for s in SITES:  # they join the restarted shard again, holding version 1
            fed.sites[s].link.links[1].send(
                Join(
                    site_id=s,
                    model_fingerprint="fp",
                    global_version=1,
                    state_hash="",
                    capabilities={},
                )
            )
        g: Global = fed.expect("eu", Global, steps=4000)
        while not g.is_full:
            g = fed.expect("eu", Global, steps=4000)
        assert g.global_version == 2 and g.state_hash == lead.coord.model.site_hash()
        assert lead.coord.state is not None
        whole_params = {**lead.coord.state.params, **restarted.state.params}
        assert state_hash(whole_params) == g.state_hash
        assert sorted(e.name for e in g.payload) == sorted(PARAMS)
    finally:
        if fed is not None:
            fed.close()
        lead.close()
        for shard in shards:
            with contextlib.suppress(Exception):
                shard.close()
