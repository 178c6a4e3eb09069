"""Each rank of a pipelined site syncs the tensors its stage holds (``stagesync.StageSync``).

Spawned CPU processes in a gloo group: a 2-stage site (1F1B) and a 2-stage x 2-FSDP-replica
site (GPipe) train two steps; the leader's sync state holds its own stage's tensors only (θ,
residuals, the local rows it sends), every federated tensor is held by one stage, and the update
the leader relays equals the one a site gathering the whole model sends. A whole model with the
coordinator's hash (computed on the leader from the ranks' block digests) is taken by every rank,
with another hash by none.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from comm.codecs.feedback import ErrorFeedback
from comm.codecs.registry import get_codec
from comm.wire.tensors import decode_tensors, state_hash
from site_agent.jobs.contract import federated_state
from site_agent.pipeline.engine import PipelineConfig
from tests.site_agent.pipeline.test_torch import make_job
from tests.support.procgroup import LocalProcessGroup

pytestmark = pytest.mark.timeout(300)

CODECS = ("fp32", "int8")


@pytest.fixture(scope="module")
def group() -> Iterator[LocalProcessGroup]:
    with LocalProcessGroup(4, timeout_s=280) as pool:
        yield pool


def _config(world_size: int, num_replicas: int) -> PipelineConfig:
    fsdp = num_replicas > 1
    return PipelineConfig(
        num_stages=world_size // num_replicas,
        num_replicas=num_replicas,
        num_microbatches=2,
        schedule="gpipe" if fsdp else "1f1b",
        data_parallel="fsdp" if fsdp else "allreduce",
        profile_steps=1,
        sync_shards=True,
    )


def _worker(cfg: PipelineConfig) -> dict[str, Any]:
    """``rank.worker_loop``, returning what this rank's sync holds when the leader stops."""
    from site_agent.pipeline.rank import SiteRank

    rank = SiteRank(make_job("bytegpt"), cfg, torch.device("cpu"))
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=rank.control)
        if box[0][0] == "stop":
            break
        rank.run(box[0])
    assert rank.stage_sync is not None
    return {"holds": rank.stage_sync.holds(), "owns": _owned(rank.stage_sync)}


def _owned(sync: Any) -> list[str]:
    return [name for name in sync.shards.shapes if sync.shards.owns(name)]


def _run(rank: int, world_size: int, num_replicas: int) -> dict[str, Any]:
    from site_agent.pipeline.leader import PipelineTrainer

    torch.set_num_threads(1)
    cfg = _config(world_size, num_replicas)
    if rank != 0:
        return _worker(cfg)
    job = make_job("bytegpt")
    theta0 = {n: t.detach().numpy().copy() for n, t in federated_state(job.model).items()}
    out: dict[str, Any] = {"theta0": theta0}
    with PipelineTrainer(job, cfg, torch.device("cpu")) as trainer:
        sync = trainer.sharded_sync
        assert sync is not None
        stage = sync.ranks
        out["hash0"] = sync.state_hash()
        trainer.train_steps(2)
        out["local"] = trainer.parameters_numpy()  # the test's look at the whole model
        names = list(sync.spec())
        out["spec"] = sync.spec()
        for i, codec in enumerate(CODECS):
            update = sync.update(i, names, codec, keep_reference=True)
            out[f"update_{codec}"] = update
        # What the leader keeps for the federation, after the updates went out.
        out["holds"] = stage.holds()
        out["owns"] = _owned(stage)
        out["theta_names"] = sorted(stage.shards.ranges)
        out["residual_names"] = sorted(stage.shards.feedback.state_dict())
        out["sent_names"] = sorted({n for sent in stage._sent.values() for n in sent or {}})
        out["state_names"] = sorted(stage.state)
        # A whole model, as the coordinator sends it: taken with its hash, refused without.
        new = {n: (v * np.float32(0.5)).astype(np.float32) for n, v in theta0.items()}
        fp32 = get_codec("fp32")
        payload = [fp32.encode(n, v) for n, v in new.items()]
        wrong = sync.result(payload, full=True, fragment=None, state_hash="0" * 32)
        out["wrong"] = (wrong.applied, wrong.rejected)
        out["wrong_params"] = trainer.parameters_numpy()
        taken = sync.result(payload, full=True, fragment=None, state_hash=state_hash(new))
        out["taken"] = taken.applied
        out["new"], out["after"] = new, trainer.parameters_numpy()
        out["hash_after"] = sync.state_hash()
        out["metrics"] = sync.validate()
        out["holds_after"] = stage.holds()
    return out


@pytest.fixture(scope="module", params=[(2, 1), (4, 2)], ids=["2-stage", "2x2-fsdp"])
def site(group: LocalProcessGroup, request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    world_size, num_replicas = request.param
    return group.run(_run, num_replicas, world_size=world_size)


def test_the_leader_holds_only_its_own_stages_tensors(site: list[dict[str, Any]]) -> None:
    leader, spec = site[0], site[0]["spec"]
    stages = len(site) if len(site) == 2 else 2
    held = [set(leader["holds"])] + [set(r["holds"]) for r in site[1:stages]]
    # Every federated tensor is held by exactly one stage; the leader holds stage 0's only.
    assert set().union(*held) == set(spec)
    assert sum(len(h) for h in held) == len(spec)
    mine = held[0]
    assert 0 < len(mine) < len(spec)
    for kind in ("theta_names", "residual_names", "sent_names", "state_names"):
        assert set(leader[kind]) == mine, kind
    assert set(leader["holds_after"]) == mine  # a whole model's result decoded its rows only
    # Each tensor is sent and hashed by one rank (a whole tensor by replica 0 of its stage),
    # an FSDP-sharded one by every rank holding rows of it.
    owners = [set(leader["owns"])] + [set(r["owns"]) for r in site[1:]]
    assert set().union(*owners) == set(spec)
    if len(site) == 4:
        assert owners[2] & owners[0] and owners[3] & owners[1]  # the second replica's shards


def test_its_update_is_the_one_a_site_gathering_the_model_sends(
    site: list[dict[str, Any]],
) -> None:
    """The gathering site computes Δ = θ0 − θ_local on the leader and encodes each whole tensor
    through its residuals (zero at the first send); each rank here does the same float32
    subtraction on its rows, so the fp32 update is equal bit for bit. int8 encodes whole tensors
    on a 2-stage site (the same bytes); an FSDP slice's blocks begin at its first row, not where
    the whole tensor's do, so there each value is within one quantisation step of Δ (a block's
    largest magnitude / 127, at most the tensor's; rounding is off by half a step at most)."""
    leader = site[0]
    spec, theta0, local = leader["spec"], leader["theta0"], leader["local"]
    delta = {n: theta0[n] - local[n] for n in spec}
    for codec in CODECS:
        update = leader[f"update_{codec}"]
        assert not update.error
        got = decode_tensors(update.tensors, spec, slices=True)
        feedback, encoder = ErrorFeedback(), get_codec(codec)
        want = decode_tensors([feedback.compress(n, v, encoder) for n, v in delta.items()], spec)
        sliced = any(enc.rows is not None for enc in update.tensors)
        assert sliced == (len(site) == 4)
        for name in spec:
            if codec == "fp32" or not sliced:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{codec} {name}")
            else:
                step = float(np.abs(delta[name]).max()) / 127
                np.testing.assert_allclose(got[name], delta[name], rtol=0, atol=step, err_msg=name)
    assert leader["update_fp32"].residual_sq_norm == 0.0


def test_a_whole_model_is_taken_only_with_the_coordinators_hash(
    site: list[dict[str, Any]],
) -> None:
    leader = site[0]
    assert leader["hash0"] == state_hash(leader["theta0"])  # combined from the ranks' digests
    assert leader["wrong"] == (False, "hash_mismatch")
    for name, value in leader["local"].items():
        np.testing.assert_array_equal(leader["wrong_params"][name], value, err_msg=name)
    assert leader["taken"]
    for name, value in leader["new"].items():
        np.testing.assert_array_equal(leader["after"][name], value, err_msg=name)
    assert leader["hash_after"] == state_hash(leader["new"])
    assert leader["metrics"]["loss"] > 0


def _alone_in_a_sync_call(rank: int, world_size: int) -> str:
    """Rank 1 makes a sync call (the state hash) that rank 0 never makes, as when the leader
    died inside a call: rank 1 gives up after ``rank_timeout_s``; rank 0 waits for it."""
    from dataclasses import replace

    from site_agent.pipeline.rank import SiteRank

    torch.set_num_threads(1)
    cfg = replace(_config(world_size, 1), rank_timeout_s=2.0)
    site = SiteRank(make_job("bytegpt"), cfg, torch.device("cpu"))
    assert site.stage_sync is not None
    said = ""
    if rank == 1:
        try:
            site.stage_sync.state_hash()
        except Exception as exc:  # torch's timeout error (its type varies between releases)
            said = f"{type(exc).__name__}: {exc}"
    dist.barrier(group=site.control)  # both are done: the group closes cleanly
    return said


@pytest.mark.timeout(120)
def test_a_rank_alone_in_a_sync_call_gives_up_after_the_rank_timeout(
    group: LocalProcessGroup,
) -> None:
    said = group.run(_alone_in_a_sync_call, world_size=2)
    assert said[0] == "" and "timed out" in said[1].lower(), said
