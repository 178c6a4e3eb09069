"""A rank that fails in a sync call of a sharded site (site_agent.shardsync, site_agent.library)
does not leave the others waiting: every rank raises the same RankFailure, naming the rank and
what it was doing, at one collective, and the ranks stay in step for the next call.

Two spawned CPU processes in a gloo group hold a model ``fully_shard``ed over them (FSDP2). A
fault is injected at a named point on one rank (that rank's method replaced by one that raises
MemoryError: no sleeps, no races); each call must return on both ranks, and a state hash taken
after it (a collective call) must agree with the one before. The group's collectives time out
after 600 s and each test after 90 s, so a rank left waiting fails the test, not the timeout.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.procgroup import LocalProcessGroup

pytestmark = pytest.mark.timeout(90)

COLLECTIVE_TIMEOUT_S = 600
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def _sharded_model(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 37), nn.Tanh(), nn.Linear(37, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _evaluate(model: nn.Module) -> dict[str, float]:
    with torch.no_grad():
        return {"loss": float(model(torch.ones(4, 8)).square().mean())}


def _boom(point: str, after: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A stand-in that raises MemoryError (``after``: once the method itself has run)."""

    def raises(*args: Any, **kwargs: Any) -> Any:
        if after is not None:
            after(*args, **kwargs)
        raise MemoryError(f"injected at {point}")

    return raises


def _whole_theta(sync: Any) -> Any:
    """θ as whole fp32 tensors on the leader (a full result whose hash is θ's own)."""
    from comm.codecs.registry import get_codec
    from comm.wire.tensors import decode_tensors, encode_tensors

    payload = sync.initial_payload()
    if payload is None:
        return None
    return encode_tensors(decode_tensors(payload, sync.spec(), slices=True), get_codec("fp32"))


# Each case: (the point, the rank it fails on, what the failure names, the call made).
CASES: list[tuple[str, int, str]] = [
    ("shards.encode_update", 1, "encoding its update"),
    ("shards.settle_update", 0, "keeping the residuals of its update"),
    ("sync._candidate_digests", 1, "decoding its rows of the result"),
    ("sync._take", 0, "taking its rows of the result"),
    ("module.theta_digests", 1, "hashing its rows of θ"),
    ("module.partial_digests", 0, "hashing the edges of its rows of θ"),
    ("sync._evaluate", 1, "validating θ"),
    ("shards.load_into", 1, "resetting its rows to θ"),
    ("shards.encode_theta", 0, "encoding its rows of θ"),
    ("sync._checkpoint_state", 1, "collecting its checkpoint"),
    ("sync._take_loaded", 1, "taking the checkpoint"),
]


def _call(sync: Any, point: str, whole: Any, store: str) -> Any:
    """The sync call that reaches ``point`` (``whole``: θ as a full result, on the leader)."""
    names = list(sync.spec())
    if point in ("shards.encode_update", "shards.settle_update"):
        return sync.update(0, names, "fp32")
    if point == "sync._candidate_digests":
        return sync.result(whole, full=True, fragment=None, state_hash="0" * 32)
    if point == "sync._take":  # θ's own hash: the result is taken
        return sync.result(whole, full=True, fragment=None, state_hash=sync.hash_before)
    if point.startswith("module."):
        return sync.state_hash()
    if point == "sync._evaluate":
        return sync.validate()
    if point == "shards.load_into":
        return sync.reset_local()
    if point == "shards.encode_theta":
        return sync.initial_payload()
    if point == "sync._checkpoint_state":
        return sync.save(f"{store}/failed-save")
    assert point == "sync._take_loaded"
    return sync.load(f"{store}/saved")


def _faults(rank: int, world: int, store: str) -> list[dict[str, Any]]:
    """Every case of CASES in turn, on the same ranks; then an update and a result."""
    import site_agent.shards as shards_module
    from site_agent.rankfailure import RankFailure
    from site_agent.shardsync import RankSync

    model = _sharded_model(world)
    sync: Any = RankSync(model, evaluate=_evaluate)
    sync.save(f"{store}/saved")
    whole = _whole_theta(sync)
    out = []
    for point, failing, _ in CASES:
        sync.hash_before = sync.state_hash()
        owner_name, attr = point.split(".")
        owner = {"shards": sync.shards, "sync": sync, "module": shards_module}[owner_name]
        original = getattr(owner, attr)
        if rank == failing:
            # The script's evaluate fails after its forward: a sharded forward is collective
            # over the model's own group, which a rank failing before it would leave waiting.
            setattr(owner, attr, _boom(point, original if point == "sync._evaluate" else None))
        case: dict[str, Any] = {"point": point}
        try:
            case["returned"] = _call(sync, point, whole, store)
        except RankFailure as exc:
            case["raised"] = str(exc)
            case["rank"] = exc.failed.rank
            case["chained"] = isinstance(exc.__cause__, MemoryError)
        finally:
            setattr(owner, attr, original)
        # The ranks are in step: the next call meets every rank at its first collective.
        case["hash_after"] = sync.state_hash()
        case["hash_before"] = sync.hash_before
        out.append(case)
    # After every fault the site still syncs: an update goes out and a full result is taken.
    update = sync.update(0, list(sync.spec()), "fp32")
    outcome = sync.result(whole, full=True, fragment=None, state_hash=sync.state_hash() or "")
    out.append({"update": update, "outcome": outcome})
    return out


@pytest.fixture(scope="module")
def group() -> Iterator[LocalProcessGroup]:
    with LocalProcessGroup(2, timeout_s=COLLECTIVE_TIMEOUT_S) as g:
        yield g


@pytest.fixture(scope="module")
def faults(group: LocalProcessGroup) -> Iterator[list[list[dict[str, Any]]]]:
    with tempfile.TemporaryDirectory() as store:
        yield group.run(_faults, store)


@pytest.mark.parametrize(("point", "failing", "what"), CASES, ids=[c[0] for c in CASES])
def test_a_rank_that_fails_is_named_on_every_rank_at_one_collective(
    faults: list[list[dict[str, Any]]], point: str, failing: int, what: str
) -> None:
    i = [c[0] for c in CASES].index(point)
    for rank, cases in enumerate(faults):
        case = cases[i]
        assert case["point"] == point
        assert "raised" in case, f"rank {rank} returned {case.get('returned')!r}"
        assert case["rank"] == failing
        assert case["raised"].startswith(f"rank {failing} of the site failed {what}: MemoryError")
        assert f"injected at {point}" in case["raised"]
        # Only the failing rank's own exception is chained to what it raised.
        assert case["chained"] is (rank == failing)
    # Nothing of θ changed, and the next collective call found both ranks.
    leader = faults[0][i]
    assert leader["hash_after"] == leader["hash_before"] is not None
    assert faults[1][i]["hash_after"] is None


def test_after_every_fault_the_site_still_syncs(faults: list[list[dict[str, Any]]]) -> None:
    last = faults[0][-1]
    assert last["update"].tensors and not last["update"].error
    assert last["outcome"].applied
    assert faults[1][-1] == {"update": None, "outcome": None}


# ---- library mode: the ranks other than 0 follow rank 0 out ---------------------------------


def _federation(rank: int, store: str, rank_timeout_s: float) -> Any:
    from site_agent.library import Federation

    model = _sharded_model(2)
    table = {
        "site_id": "lib",
        "coordinator_endpoint_file": f"{store}/endpoint.json",
        "state_dir": f"{store}/site",
        "security": {"insecure": True},
        "rank_timeout_s": rank_timeout_s,
        "job": {"factory": "regression_job:make_job", "python_path": [str(EXAMPLES)]},
    }
    return Federation(table, model, torch.optim.SGD(model.parameters()), evaluate=_evaluate)


def _library(rank: int, world: int, store: str, failing: int, timeout_s: float) -> dict[str, Any]:
    """Rank 0's agent makes a sync call (an update) that fails on rank ``failing`` (-1: rank 0
    fails after telling the others of the call, before making it), then stops, as its thread
    does on an error; the other rank waits between two steps as in the optimizer's hook."""
    from site_agent.exits import EXIT_CRASHED
    from site_agent.rankfailure import RankFailure

    fed = _federation(rank, store, timeout_s)
    ranks: Any = fed._ranks
    if rank == failing:
        ranks.shards.encode_update = _boom("shards.encode_update")
    out: dict[str, Any] = {}
    if rank == 0:
        sync: Any = fed.trainer.sharded_sync
        if failing == -1:
            ranks.update = _boom("the leader's update")
        try:
            sync.update(0, list(sync.spec()), "fp32")
        except (RankFailure, MemoryError) as exc:
            out["agent_raised"] = str(exc)
        fed.exit_code, fed._finished = EXIT_CRASHED, True  # the agent's thread, stopping
        fed._broadcast_flag()  # the loop's next step tells the other ranks
        return out
    fed._follow()  # between two steps, as in the optimizer's step hook
    out["finished"], out["exit_code"] = fed.finished, fed.exit_code
    try:
        fed.__exit__(None, None, None)
    except Exception as exc:
        out["exit_raised"] = f"{type(exc).__name__}: {exc}"
    return out


def test_library_ranks_raise_the_failure_of_the_rank_that_failed(
    group: LocalProcessGroup, tmp_path: Path
) -> None:
    from site_agent.exits import EXIT_CRASHED

    leader, follower = group.run(_library, str(tmp_path), 1, float(COLLECTIVE_TIMEOUT_S))
    named = "rank 1 of the site failed encoding its update: MemoryError"
    assert leader["agent_raised"].startswith(named)
    assert follower["finished"] and follower["exit_code"] == EXIT_CRASHED
    assert follower["exit_raised"].startswith(f"RankFailure: {named}")


def test_library_a_leader_that_fails_after_naming_a_call_releases_the_ranks(
    group: LocalProcessGroup, tmp_path: Path
) -> None:
    """Rank 0 fails between telling the others of a call and making it: they wait in the call's
    first collective for ``site.rank_timeout_s`` (here 2 s, not torch's 30 minutes), then follow
    rank 0's word out of the step and raise from their ``with`` block."""
    from site_agent.exits import EXIT_CRASHED

    leader, follower = group.run(_library, str(tmp_path), -1, 2.0)
    assert "injected at the leader's update" in leader["agent_raised"]
    assert follower["finished"] and follower["exit_code"] == EXIT_CRASHED
    waited = "RankFailure: rank 1 of the site failed making sync call 'update': "
    assert follower["exit_raised"].startswith(waited)
