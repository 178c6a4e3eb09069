"""The site agent under faults, in-process: a scripted coordinator link and a fake trainer.

No sockets and no sleeps: the link hands the agent the next scripted message once the agent's
sends so far satisfy that message's gate, and answers ``Shutdown`` when the script is spent, or
when the agent polls a long time without anything left to give it (the agent is stuck).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from comm.security.common import AuthError
from comm.security.kits import init_kit, issue_site, revoke_site
from comm.security.registry import CertificateRegistry
from comm.security.rolekits import SecurityConfig
from comm.transport.stats import ChannelStats
from comm.wire.schema import (
    ERROR_MEANINGS,
    Error,
    ErrorCode,
    Message,
    RoundCancel,
    RoundStart,
    Shutdown,
    Update,
    Welcome,
)
from site_agent.agent import SiteAgent
from site_agent.authwatch import AuthWatch, refusal_cause
from site_agent.config import SiteConfig
from site_agent.exits import EXIT_AUTH_REFUSED, EXIT_OK
from site_agent.jobs.contract import job_fingerprint
from site_agent.rounds import MAX_CANCELLED
from site_agent.trainer import TrainStats

pytestmark = pytest.mark.timeout(60)

Gate = Callable[[list[Message]], bool]
STUCK_POLLS = 200
"""Polls with nothing to deliver after which the agent counts as stuck (it never needs more
than a few: every scripted message is gated on what the agent already sent)."""


class FakeTrainer:
    """Two parameters; every inner step adds 1 to each and trains 10 tokens."""

    evaluates = True
    sharded_sync = None

    def __init__(self) -> None:
        self.params = {"a": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}

    def train_steps(self, num_steps: int) -> TrainStats:
        for v in self.params.values():
            v += num_steps
        return TrainStats(num_steps, 10 * num_steps, 1.0, 1.0, 0.0)

    def validate(self) -> dict[str, float]:
        return {"loss": 1.0}

    def state_spec(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [(k, v.shape, "float32") for k, v in self.params.items()]

    def buffer_names(self) -> list[str]:
        return []

    def fingerprint(self, factory_path: str) -> str:
        return job_fingerprint(factory_path, self.state_spec())

    def parameters_numpy(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.params.items()}

    def load_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        self.params = {k: np.array(v, np.float32) for k, v in params.items()}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def always(_sent: list[Message]) -> bool:
    return True


def after_update(round_id: int) -> Gate:
    return lambda sent: any(isinstance(m, Update) and m.round_id == round_id for m in sent)


class ScriptedLink:
    """Stands in for ``SiteLink``: records sends, delivers gated scripted messages."""

    def __init__(self, script: Sequence[tuple[Gate, Message]]) -> None:
        self.script = list(script)
        self.sent: list[Message] = []
        self.stats = ChannelStats()
        self.idle_polls = 0
        self.stuck = False

    def send(self, msg: Message) -> None:
        self.sent.append(msg)

    def recv(self, timeout_s: float) -> Message | None:
        if not self.script:
            return Shutdown(reason="script done")
        gate, msg = self.script[0]
        if gate(self.sent):
            self.script.pop(0)
            self.idle_polls = 0
            return msg
        self.idle_polls += 1
        if self.idle_polls > STUCK_POLLS:
            self.stuck = True
            return Shutdown(reason="stuck")
        return None

    def close(self) -> None:
        pass

    def updates(self) -> list[int]:
        return [m.round_id for m in self.sent if isinstance(m, Update)]


def welcome() -> Welcome:
    return Welcome(
        site_id="eu", session_id="s1", global_version=0, heartbeat_interval_s=1.0, need_init=False
    )


def round_start(round_id: int, *, overlap: bool, base: int = 0, fragment: int = 0) -> RoundStart:
    return RoundStart(
        round_id=round_id,
        global_version=0,
        fragment_base_version=base,
        fragment=fragment,
        num_fragments=1,
        num_inner_steps=2,
        overlap=overlap,
        codec="fp32",
        deadline_s=60.0,
        participants=("eu",),
        evaluate=False,
        reason="test",
    )


def make_agent(
    tmp_path: Path,
    script: Sequence[tuple[Gate, Message]],
    clock: Callable[[], float] = lambda: 0.0,
    link: type[ScriptedLink] = ScriptedLink,
) -> SiteAgent:
    """A started agent on ``link`` playing ``script``, holding θ0 (v0)."""
    cfg = SiteConfig(
        site_id="eu",
        coordinator="tcp://127.0.0.1:1",
        state_dir=str(tmp_path / "state"),
        security=SecurityConfig(insecure=True),
        steps_per_poll=1,
    )
    cfg.state_path.mkdir(parents=True)
    agent = SiteAgent(cfg, trainer=FakeTrainer(), clock=clock, link=link(script))
    agent.start()
    return agent


def link_of(agent: SiteAgent) -> ScriptedLink:
    link = agent.session.link
    assert isinstance(link, ScriptedLink)
    return link


def run_script(
    tmp_path: Path,
    script: Sequence[tuple[Gate, Message]],
    clock: Callable[[], float] = lambda: 0.0,
) -> tuple[int, ScriptedLink]:
    agent = make_agent(tmp_path, script, clock)
    return agent.run(), link_of(agent)


# ---- 1. a cancelled round must not leave a site without overlap waiting forever ------------


def test_cancel_of_the_awaited_round_without_overlap_does_not_block_later_rounds(
    tmp_path: Path,
) -> None:
    code, link = run_script(
        tmp_path,
        [
            (always, welcome()),
            (always, round_start(1, overlap=False)),
            # Round 1 is aborted after our update went out: its result never comes.
            (after_update(1), RoundCancel(round_ids=(1,), reason="deadline")),
            (always, round_start(2, overlap=False)),
            (after_update(2), Shutdown(reason="done")),
        ],
    )
    assert code == EXIT_OK
    assert not link.stuck, "the site ignored round 2 while waiting for cancelled round 1"
    assert link.updates() == [1, 2]


def test_without_overlap_the_site_still_waits_for_a_result_that_is_coming(
    tmp_path: Path,
) -> None:
    # Round 2 arrives before round 1's result: without overlap it is not trained until then.
    code, link = run_script(
        tmp_path,
        [
            (always, welcome()),
            (always, round_start(1, overlap=False)),
            (after_update(1), round_start(2, overlap=False)),
            (after_update(2), Shutdown(reason="done")),
        ],
    )
    assert code == EXIT_OK
    assert link.stuck  # nothing else came: it kept waiting for round 1's result
    assert link.updates() == [1]


# ---- 2. a revoked or expired site exits; a transient refusal does not kill it ----------------


def refusal(detail: str) -> Error:
    """An UNAUTHENTICATED error worded as the coordinator words it (``Coordinator._reject``)."""
    code = ErrorCode.UNAUTHENTICATED
    return Error(code=int(code), detail=f"{ERROR_MEANINGS[code]}: {detail}")


def test_a_revoked_site_exits_with_the_no_restart_code(tmp_path: Path) -> None:
    detail = "certificate serial=abc of site 'eu' is revoked"
    code, link = run_script(tmp_path, [(always, welcome()), (always, refusal(detail))])
    assert code == EXIT_AUTH_REFUSED
    assert not link.stuck and link.script == []


def test_an_expired_site_exits_with_the_no_restart_code(tmp_path: Path) -> None:
    detail = "certificate serial=abc of site 'eu' expired at 100, now is 200"
    code, _link = run_script(tmp_path, [(always, welcome()), (always, refusal(detail))])
    assert code == EXIT_AUTH_REFUSED


def test_a_transient_refusal_does_not_stop_a_healthy_site(tmp_path: Path) -> None:
    # Right after a reconnect the coordinator may not know the connection's identity yet.
    code, link = run_script(
        tmp_path,
        [
            (always, welcome()),
            (always, refusal("no certified identity on this connection")),
            (always, refusal("no certificate serial=abc for site 'eu'")),
            (always, round_start(1, overlap=True)),
            (after_update(1), Shutdown(reason="done")),
        ],
    )
    assert code == EXIT_OK
    assert link.updates() == [1]


class StepClock:
    """Each read is ``step_s`` later than the one before."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def test_refusals_that_persist_past_the_grace_stop_the_site(tmp_path: Path) -> None:
    grace = AuthWatch().grace_s
    refusals = int(grace / 10) + 2  # 10 s of clock per read: the last ones are past the grace
    detail = "no certificate serial=abc for site 'eu'"
    code, link = run_script(
        tmp_path,
        [(always, welcome()), *[(always, refusal(detail)) for _ in range(refusals)]],
        clock=StepClock(10.0),
    )
    assert code == EXIT_AUTH_REFUSED
    assert link.script, "it gave up before the script ran out"


def test_refusals_with_acceptances_in_between_never_stop_the_site(tmp_path: Path) -> None:
    grace = AuthWatch().grace_s
    detail = "no certified identity on this connection"
    script: list[tuple[Gate, Message]] = []
    for _ in range(int(grace / 10) + 2):  # the same span as above, but the coordinator also
        script += [(always, refusal(detail)), (always, welcome())]  # accepts us meanwhile
    code, link = run_script(tmp_path, script, clock=StepClock(10.0))
    assert code == EXIT_OK and link.script == []


def test_a_heartbeat_echo_counts_as_acceptance() -> None:
    watch = AuthWatch(grace_s=5.0)
    assert watch.refused("no certified identity", 0.0) is None
    assert watch.refused("no certified identity", 6.0) is not None
    watch.accepted()
    assert watch.refused("no certified identity", 7.0) is None


@pytest.mark.parametrize("revoked", [True, False])
def test_the_coordinator_words_for_revoked_and_expired_are_recognized(
    tmp_path: Path, revoked: bool
) -> None:
    """The detail the coordinator forwards (``coordinator.intake.authentic``), produced by the
    real registry."""
    kit = init_kit(tmp_path / "kit")
    now = 1_000_000.0 if revoked else 1e12  # far past the certificate's validity
    cert = issue_site(kit, "eu", 30, now=1_000_000.0 - 60).certificate
    if revoked:
        revoke_site(kit, "eu")
    registry = CertificateRegistry.from_kit(kit, reload_interval_s=0)
    with pytest.raises(AuthError) as exc:
        registry.check_peer(user_id="eu", serial=cert.serial, claimed_site_id="eu", now=now)
    assert exc.value.reason == ("revoked" if revoked else "expired")
    assert refusal_cause(refusal(exc.value.detail).detail) == exc.value.reason
    # A connection whose identity the coordinator does not know (yet) is not definitive.
    with pytest.raises(AuthError) as exc:
        registry.check_peer(user_id="eu", serial="nope", claimed_site_id="eu", now=now)
    assert exc.value.reason == "unknown_key"
    assert refusal_cause(refusal(exc.value.detail).detail) == "other"


# ---- 3. what the site remembers about rounds stays bounded --------------------------------


def test_cancelled_rounds_are_not_remembered_forever(tmp_path: Path) -> None:
    """Every round is aborted (the global model never moves): the site keeps no record of
    cancelled rounds it holds no plan for."""
    rounds = 200
    script: list[tuple[Gate, Message]] = [(always, welcome())]
    for r in range(1, rounds + 1):
        script += [
            (always, round_start(r, overlap=True)),
            (after_update(r), RoundCancel(round_ids=(r,), reason="deadline")),
        ]
    script.append((always, round_start(rounds + 1, overlap=True)))
    script.append((after_update(rounds + 1), Shutdown(reason="done")))
    agent = make_agent(tmp_path, script)
    assert agent.run() == EXIT_OK
    assert not link_of(agent).stuck
    assert link_of(agent).updates() == list(range(1, rounds + 2))
    assert len(agent.rounds.cancelled) <= MAX_CANCELLED
    assert len(agent.rounds.pending) == 0


# ---- a result lost on the way (a link cut) is asked for, not waited for forever ------------


def test_a_plan_naming_a_newer_global_makes_the_site_ask_for_the_model(tmp_path: Path) -> None:
    from comm.codecs.floats import Fp32Codec
    from comm.wire.schema import Global, SyncRequest
    from comm.wire.tensors import encode_tensors, state_hash

    v1 = {"a": np.full(4, 0.5, np.float32), "b": np.full(3, -0.5, np.float32)}
    full_v1 = Global(
        round_id=1,
        base_version=-1,
        global_version=1,
        fragment=-1,
        merged=(),
        is_full=True,
        state_hash=state_hash(v1),
        signature=b"",
        evaluate=False,
        payload=encode_tensors(v1, Fp32Codec()),
    )

    def asked(sent: list[Message]) -> bool:
        return any(isinstance(m, SyncRequest) for m in sent)

    # Round 1's result (v1) was lost in a link cut; round 2 opens on v1 and must build on it.
    plan_2 = round_start(2, overlap=True, base=1)
    plan_2 = RoundStart(**{**plan_2.__dict__, "global_version": 1})
    code, link = run_script(
        tmp_path,
        [
            (always, welcome()),
            (always, round_start(1, overlap=True)),
            (after_update(1), plan_2),
            (asked, full_v1),
            (after_update(2), Shutdown(reason="done")),
        ],
    )
    assert code == EXIT_OK
    assert not link.stuck, "the site waited for a result that was lost"
    assert link.updates() == [1, 2]
    assert sum(isinstance(m, SyncRequest) for m in link.sent) == 1


# ---- an update lost in a link cut is the channel's to send again, not the agent's ---------------


@pytest.mark.parametrize(("silence_s", "resets"), [(0.0, 1), (3.5, 0), (10.0, 0), (30.0, 1)])
def test_after_a_silence_or_a_reset_the_agent_sends_no_update_again(
    tmp_path: Path, silence_s: float, resets: int
) -> None:
    # What was in flight is held by the channel until the coordinator acknowledges it and sent
    # again from there (comm.transport.reliable, tests/comm/transport/test_delivery_acks.py): a copy from the
    # agent would only add an update's bytes on the link.
    assert _silence(tmp_path, silence_s, resets) == [1]


def _silence(tmp_path: Path, silence_s: float, resets: int = 0) -> list[int]:
    """Round 1's update goes out, the link is silent for ``silence_s`` (its connection dropping
    ``resets`` times), an echo arrives, and the round's result never comes; returns the updates
    sent (until the script ends)."""
    now = [0.0]
    polls = {"n": 0}

    class SilentLink(ScriptedLink):
        cut = False

        def recv(self, timeout_s: float) -> Message | None:
            if not self.cut and self.updates() == [1]:
                self.cut = True
                now[0] += silence_s
                self.stats.disconnects += resets
                self.stats.echoes_received += 1
            return super().recv(timeout_s)

    def later(sent: list[Message]) -> bool:
        polls["n"] += 1
        return polls["n"] > 20 or sum(isinstance(m, Update) for m in sent) >= 2

    agent = make_agent(
        tmp_path,
        [
            (always, welcome()),
            (always, round_start(1, overlap=True)),
            (later, Shutdown(reason="done")),
        ],
        clock=lambda: now[0],
        link=SilentLink,
    )
    assert agent.run() == EXIT_OK
    return link_of(agent).updates()


# ---- compute utilization: the federation's step rate against the sync-free rate ------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_utilization_compares_the_step_rate_with_the_rate_when_no_sync_is_in_flight(
    tmp_path: Path,
) -> None:
    from comm.codecs.floats import Fp32Codec
    from comm.wire.schema import Global
    from comm.wire.tensors import encode_tensors, state_hash

    clock = FakeClock()
    v1 = {"a": np.full(4, 0.5, np.float32), "b": np.full(3, -0.5, np.float32)}
    full_v1 = Global(
        round_id=1,
        base_version=0,
        global_version=1,
        fragment=-1,
        merged=("eu",),
        is_full=True,
        state_hash=state_hash(v1),
        signature=b"",
        evaluate=False,
        payload=encode_tensors(v1, Fp32Codec()),
    )
    asks = {"n": 0}

    def second_ask_after_update_1(sent: list[Message]) -> bool:
        if not after_update(1)(sent):
            return False
        asks["n"] += 1
        return asks["n"] >= 2

    plan_2 = RoundStart(**{**round_start(2, overlap=True).__dict__, "global_version": 0})
    agent = make_agent(
        tmp_path,
        [
            (always, welcome()),
            (always, round_start(1, overlap=True)),
            (after_update(1), plan_2),
            (second_ask_after_update_1, full_v1),
            (after_update(2), Shutdown(reason="done")),
        ],
        clock,
    )
    trainer = agent.trainer
    assert isinstance(trainer, FakeTrainer)
    train = trainer.train_steps
    trained: list[int] = []

    def timed(num_steps: int) -> TrainStats:
        # One second a step; two while an update of ours is in flight (communication threads
        # taking the cores).
        clock.now += num_steps * (2.0 if agent.replica.in_flight else 1.0)
        trained.append(num_steps)
        return train(num_steps)

    trainer.train_steps = timed  # type: ignore[method-assign]
    assert agent.run() == EXIT_OK
    st = agent.status()
    assert st["rounds_sent"] == 2
    assert st["inner_steps"] == sum(trained) > 0  # what a live display shows per site
    # Only the steps with nothing in flight count for the sync-free rate.
    assert st["sync_free_steps_per_second"] == 1.0
    # Round 2 trained at least one step while round 1's update was in flight.
    assert st["steps_per_second"] < 1.0
    assert st["compute_utilization"] == pytest.approx(st["steps_per_second"] / 1.0, rel=1e-12)


# ---- an update that cannot be encoded leaves the error feedback as it was --------------------


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("failure", ["non_finite", "bad_residual"])
def test_an_update_that_fails_to_encode_leaves_every_residual_as_it_was(
    tmp_path: Path, failure: str
) -> None:
    """Nothing went out, so the progress stays local and goes out with the next update: every
    residual must still owe exactly what it owed, those of the tensors encoded before the one
    that failed included (else the next update counts their progress twice, or drops the
    error they carried)."""
    agent = make_agent(tmp_path, [])
    trainer = agent.trainer
    assert isinstance(trainer, FakeTrainer)
    before = {"a": np.full(4, 0.25, np.float32)}
    if failure == "non_finite":
        # "b" plus its residual overflows float32: its encoding is not finite.
        trainer.params["b"] = np.full(3, -3e38, np.float32)
        before = {"b": np.full(3, 3e38, np.float32)}
    else:
        before["b"] = np.zeros(5, np.float32)  # a residual of another shape: a ValueError
    agent.sender.feedback.load_state_dict(before)
    stats = trainer.train_steps(1)
    plan = round_start(1, overlap=True)
    taken = agent.replica.take_pseudo_gradient(plan, stats)
    assert taken is not None
    sent = agent.sender.send_update(plan, stats, taken[0], global_version=0)
    assert not sent and link_of(agent).updates() == []
    after = agent.sender.feedback.state_dict()
    assert set(after) == set(before)
    for name, residual in before.items():
        np.testing.assert_array_equal(after[name], residual)


def test_a_slot_tally_means_only_the_losses_reported() -> None:
    from site_agent.throughput import SlotTally

    tally = SlotTally()
    tally.add(TrainStats(2, 20, 1.0, 0.5, 0.1))
    tally.add(TrainStats(3, 30, math.nan, math.nan, 0.2, loss_reported=False))
    tally.add(TrainStats(2, 20, 3.0, 2.5, 0.1))
    stats = tally.stats()
    assert (stats.steps, stats.tokens, stats.loss_reported) == (7, 70, True)
    assert (stats.loss_mean, stats.loss_last) == (2.0, 2.5)
    silent = SlotTally()
    silent.add(TrainStats(3, 30, math.nan, math.nan, 0.2, loss_reported=False))
    assert not silent.stats().loss_reported and math.isnan(silent.stats().loss_mean)


def test_the_status_names_the_state_hash_of_the_model_held(tmp_path: Path) -> None:
    from comm.wire.tensors import state_hash

    agent = make_agent(tmp_path, [])
    replica = agent.replica
    held = replica.status()["state_hash"]
    assert held == state_hash(replica.global_params)
    assert replica.status()["state_hash"] == held  # kept with the parameters it is of
    replica.global_params = {k: v + 1.0 for k, v in replica.global_params.items()}
    moved = agent.status()["state_hash"]
    assert moved != held and moved == state_hash(replica.global_params)
