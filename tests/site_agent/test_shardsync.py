"""A sharded site's sync, rank by rank (site_agent.shardsync), against a site of one process.

Two spawned CPU processes in a gloo group train a model ``fully_shard``ed over them (FSDP2),
each on its half of every batch; one process trains the same model on the whole batches. The
ranks then make the sync calls the agent makes through them:

- the update (fp32): the slices gathered to the leader, put together as the coordinator puts
  them together, are the one-process site's pseudo-gradient to float rounding. Where the
  rounding comes from: FSDP averages the two ranks' gradients of their half-batch means (a
  reduce-scatter), one process takes the gradient of the whole batch's mean in one backward:
  the same sum in another order, so the gradients differ by a few float32 ulps, and Adam's
  three steps carry that to the parameters. Measured: Δ differs by at most 3e-8 (one ulp of the
  parameters, |θ| ~ 0.3, from which Δ ~ 0.03 is subtracted); the bound is 1e-5 of max |Δ|;
- a delta result with the coordinator's state hash: every rank takes its rows, the site's hash
  over the shards is the one-process site's, and each rank's local rows are the one-process
  merge's (local + (θ_new − local at the send)); a result whose hash is not the coordinator's is
  taken by no rank; without overlap no rank keeps a copy of its local rows at the send, and
  they merge exactly as one process's do;
- an update a rank cannot encode (a non-finite value on rank 1 only) goes out from no rank, and
  every rank's residuals are as before;
- validation runs on θ on every rank and puts the local rows back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from comm.codecs.feedback import ErrorFeedback
from comm.codecs.registry import get_codec
from comm.wire.tensors import decode_tensors, encode_tensors, state_hash
from tests.support.procgroup import LocalProcessGroup

pytestmark = pytest.mark.timeout(180)

STEPS, BATCH, LR = 3, 64, 1e-2


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 37), nn.Tanh(), nn.Linear(37, 5), nn.Tanh(), nn.Linear(5, 1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, generator=g)) for _ in range(STEPS)
    ]


def _train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in batches:
        loss = ((model(x).squeeze(-1) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _result_delta(names: list[str]) -> dict[str, np.ndarray]:
    """A result's delta to θ (what the coordinator's outer step moves the model by)."""
    g = torch.Generator().manual_seed(5)
    shapes = {n: tuple(p.shape) for n, p in _model().named_parameters()}
    return {n: (torch.randn(shapes[n], generator=g) * 0.01).numpy() for n in names}


def _evaluate(model: nn.Module) -> dict[str, float]:
    x, y = _batches()[0]
    with torch.no_grad():
        return {"loss": float(((model(x).squeeze(-1) - y) ** 2).mean())}


def _rank(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from site_agent.shardsync import RankSync

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sync = RankSync(model, evaluate=_evaluate)
    half = BATCH // world
    _train(
        model,
        [
            (x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half])
            for x, y in _batches()
        ],
    )
    names = list(sync.spec())
    out: dict[str, Any] = {"hash0": sync.state_hash()}
    update = sync.update(0, names, "fp32")
    out["update"] = update
    local = {n: p.to_local().detach().numpy().copy() for n, p in model.named_parameters()}
    out["validate"] = sync.validate()
    out["local_kept"] = all(
        np.array_equal(local[n], p.to_local().detach().numpy()) for n, p in model.named_parameters()
    )
    # Training goes on after the send (overlap): the result is merged keeping that progress.
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(0.001)
    delta = encode_tensors(_result_delta(names), get_codec("fp32"))
    out["wrong"] = sync.result(
        delta if rank == 0 else None, full=False, fragment=0, state_hash="0" * 32
    )
    out["hash_after_wrong"] = sync.state_hash()
    want = _one_process()["hash1"]
    out["right"] = sync.result(
        delta if rank == 0 else None, full=False, fragment=0, state_hash=want
    )
    out["hash1"] = sync.state_hash()
    out["rows"] = {n: (r.start, r.stop) for n, r in sync.shards.ranges.items()}
    out["local1"] = {n: p.to_local().detach().numpy().copy() for n, p in model.named_parameters()}
    # Without overlap (no step before the result) no copy of the local rows is kept, and they
    # merge as one process's do: local + (θ_new - local at the send, which they still are).
    out["local_at_send2"] = {
        n: p.to_local().detach().numpy().copy() for n, p in model.named_parameters()
    }
    sync.update(0, names, "fp32", keep_reference=False)
    out["no_copy"] = sync._sent[0] is None
    delta2 = encode_tensors({n: v * 2 for n, v in _result_delta(names).items()}, get_codec("fp32"))
    out["second"] = sync.result(
        delta2 if rank == 0 else None, full=False, fragment=0, state_hash=_one_process()["hash2"]
    )
    out["local2"] = {n: p.to_local().detach().numpy().copy() for n, p in model.named_parameters()}
    # A non-finite value on rank 1 only: nothing goes out, no rank's residuals change.
    int8 = "int8:block=4"
    sync.update(0, names, int8)
    before = {n: sync.shards.residual(n) for n in names}
    if rank == 1:
        with torch.no_grad():
            next(iter(model.parameters())).to_local().view(-1)[0] = float("nan")
    out["refused"] = sync.update(0, names, int8)
    out["residuals_kept"] = all(
        (before[n] is None and sync.shards.residual(n) is None)
        or torch.equal(before[n], sync.shards.residual(n))
        for n in names
    )
    return out


def _one_process() -> dict[str, Any]:
    """The same training on whole batches, the one-process site's Δ, hashes and merge."""
    model = _model()
    theta = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    _train(model, _batches())
    local = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    delta = {n: theta[n] - local[n] for n in theta}
    feedback, codec = ErrorFeedback(), get_codec("fp32")
    sent = decode_tensors(
        [feedback.compress(n, v, codec) for n, v in delta.items()],
        {n: v.shape for n, v in delta.items()},
    )
    result = _result_delta(list(theta))
    new = {n: theta[n] + result[n] for n in theta}
    after = {n: local[n] + np.float32(0.001) for n in theta}
    merged = {n: after[n] + (new[n] - local[n]) for n in theta}
    new2 = {n: new[n] + result[n] * 2 for n in theta}
    return {
        "hash0": state_hash(theta),
        "sent": sent,
        "hash1": state_hash(new),
        "merged": merged,
        "theta": theta,
        "new2": new2,
        "hash2": state_hash(new2),
    }


@pytest.fixture(scope="module")
def ranks() -> Iterator[list[dict[str, Any]]]:
    with LocalProcessGroup(2, timeout_s=150) as group:
        yield group.run(_rank)


def test_the_update_of_two_fsdp_ranks_is_the_one_process_sites(ranks: list[dict[str, Any]]) -> None:
    one = _one_process()
    update = ranks[0]["update"]
    assert ranks[1]["update"] is None and not update.error
    assert any(enc.rows is not None for enc in update.tensors)  # slices, not whole tensors
    spec = {n: v.shape for n, v in one["sent"].items()}
    sent = decode_tensors(update.tensors, spec, slices=True)
    for name, want in one["sent"].items():
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(sent[name], want, rtol=0, atol=1e-5 * scale, err_msg=name)
    assert update.residual_sq_norm == 0.0  # fp32 loses nothing


def test_a_result_is_taken_by_every_rank_only_with_the_coordinators_hash(
    ranks: list[dict[str, Any]],
) -> None:
    one = _one_process()
    assert ranks[0]["hash0"] == one["hash0"] and ranks[1]["hash0"] is None
    wrong = ranks[0]["wrong"]
    assert not wrong.applied and wrong.rejected == "hash_mismatch"
    assert ranks[0]["hash_after_wrong"] == one["hash0"]
    assert ranks[0]["right"].applied and ranks[0]["hash1"] == one["hash1"]
    for r in ranks:
        for name, (start, stop) in r["rows"].items():
            want = one["merged"][name][start:stop]
            # The local rows differ from one process's by the training's rounding (above).
            np.testing.assert_allclose(r["local1"][name], want, rtol=0, atol=1e-6, err_msg=name)


def test_without_overlap_no_copy_is_kept_and_the_rows_merge_as_one_process(
    ranks: list[dict[str, Any]],
) -> None:
    one = _one_process()
    assert ranks[0]["second"].applied
    for r in ranks:
        assert r["no_copy"]
        for name, (start, stop) in r["rows"].items():
            at_send = r["local_at_send2"][name]
            want = at_send + (one["new2"][name][start:stop] - at_send)
            assert np.array_equal(r["local2"][name], want), name


def test_an_update_one_rank_cannot_encode_goes_out_from_none(ranks: list[dict[str, Any]]) -> None:
    refused = ranks[0]["refused"]
    assert refused.non_finite and not refused.tensors and "NaN" in refused.error
    assert all(r["residuals_kept"] for r in ranks)


def test_validation_scores_theta_and_puts_the_local_rows_back(ranks: list[dict[str, Any]]) -> None:
    model = _model()
    assert ranks[0]["validate"] == pytest.approx(_evaluate(model), rel=1e-6)
    assert ranks[1]["validate"] is None
    assert all(r["local_kept"] for r in ranks)
