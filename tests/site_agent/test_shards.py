"""A rank's shards of a model under FSDP2 (site_agent.shards) against a site of one process.

Two spawned CPU processes in a gloo group hold a small model ``fully_shard``ed over them (rows
that do not split evenly; the last layer's rows all on rank 0, none on rank 1, and one tensor of
two hash blocks). Each test compares with one process holding the same model whole, with the
same local parameters (the test moves them by the same noise; each rank writes only its rows):

- the slices gathered to rank 0, decoded and put together as the coordinator does, are the
  one-process update bit for bit with fp32; with int8 they are where every shard boundary lies on
  the codec's block grid, and elsewhere each rank's encoding error is within the codec's bound;
- each rank's residual is what error feedback's rule leaves for its rows (bit for bit), and the
  one-process residual's rows where the blocks align; over two rounds what was sent plus what
  is owed is what the one process sent plus owes;
- the coordinator's mean of the sharded site's slices and a one-process site's whole tensors is
  the mean of both sent whole;
- ``shard_hash`` is ``state_hash`` of the whole model, before and after a result is applied;
- θ and the residuals saved with ``torch.distributed.checkpoint`` (each rank its rows) load back
  in the same layout, and into one rank by resharding.
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
from comm.wire.tensors import decode_tensors, spec_of, state_hash
from coordinator.aggregate import MeanFold
from tests.support.procgroup import LocalProcessGroup

pytestmark = pytest.mark.timeout(180)

ROUNDS = (1, 2)  # noise seeds of two rounds without a sync between them
STEP = 0.01


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 5),  # 5 rows: 3 and 2, the boundary at flat 768 (int8's blocks: 3 x 256)
        nn.Linear(5, 301),  # 151 and 150 rows, the boundary at flat 755 (off the block grid)
        nn.Linear(301, 303),  # 91203 values: two hash blocks, rank 1 starting inside the first
        nn.Linear(303, 1),  # one row: all on rank 0
    )


def _noise(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The same noise for the whole tensor on every process (the test's stand-in for training)."""
    g = torch.Generator().manual_seed(seed * 1000 + sum(name.encode()))
    return torch.randn(shape, generator=g) * STEP


def _rank(rank: int, world: int, spec: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from site_agent.shards import RankShards, gather_slices, shard_hash

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    shards = RankShards.of_module(model)
    out: dict[str, Any] = {
        "ranges": {n: (r.start, r.stop) for n, r in shards.ranges.items()},
        "local_shapes": {n: tuple(p.to_local().shape) for n, p in params.items()},
        "hash": shard_hash(shards),
        "rounds": [],
    }
    codec = get_codec(spec)
    for seed in ROUNDS:
        with torch.no_grad():
            for name, p in params.items():
                start, stop = out["ranges"][name]
                p.to_local().sub_(_noise(name, tuple(p.shape), seed)[start:stop])
        slices = shards.shard_update(params, codec)
        residuals = {n: _np(shards.residual(n)) for n in params}
        out["rounds"].append(
            {
                "slices": gather_slices(slices),
                "residuals": residuals,
                "sq_norm": shards.residual_sq_norm(),
            }
        )
    # A result of whole tensors (θ0 + 1, as the test's one process has it): θ moves to it, each
    # rank keeping its rows, and the local parameters are set to it.
    new = {n: _np(p) + 1.0 for n, p in _model().named_parameters()}
    shards.load_global(new)
    shards.load_into(params)
    out["hash_after"] = shard_hash(shards)
    out["local_after"] = {n: _np(p.to_local()) for n, p in params.items()}
    return out


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().numpy().copy()


@pytest.fixture(scope="module")
def group() -> Iterator[LocalProcessGroup]:
    with LocalProcessGroup(2, timeout_s=120) as g:
        yield g


def _one_process(spec: str) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """θ and, per round, the raw pseudo-gradient, the decoded update and the residuals of a
    site holding the model whole (its replica's Δ and its ErrorFeedback)."""
    model = _model()
    theta = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    local = {n: torch.from_numpy(v.copy()) for n, v in theta.items()}
    feedback, codec = ErrorFeedback(), get_codec(spec)
    rounds = []
    for seed in ROUNDS:
        for name, t in local.items():
            t.sub_(_noise(name, tuple(t.shape), seed))
        delta = {n: theta[n] - local[n].numpy() for n in theta}
        encoded = [feedback.compress(n, v, codec) for n, v in delta.items()]
        rounds.append(
            {
                "delta": delta,
                "decoded": decode_tensors(encoded, spec_of(theta)),
                "residuals": feedback.state_dict(),
                "norm": feedback.residual_norm(),
            }
        )
    return theta, rounds


def _assembled(results: list[dict[str, Any]], r: int, name: str, shape: tuple[int, ...]) -> Any:
    """A residual put together from every rank's rows (zeros where none is carried yet)."""
    whole = np.zeros(shape, dtype=np.float32)
    for res in results:
        start, stop = res["ranges"][name]
        rows = res["rounds"][r]["residuals"][name] if r >= 0 else None
        if stop > start and rows is not None:
            whole[start:stop] = rows
    return whole


def _aligned(results: list[dict[str, Any]], name: str, shape: tuple[int, ...], block: int) -> bool:
    """Every shard boundary of ``name`` lies on the codec's block grid."""
    cols = int(np.prod(shape[1:]))
    starts = [res["ranges"][name][0] for res in results if np.subtract(*res["ranges"][name])]
    return all(start * cols % block == 0 for start in starts)


def test_the_shards_are_fsdp2s_uneven_rows(group: LocalProcessGroup) -> None:
    results = group.run(_rank, "fp32")
    theta, _ = _one_process("fp32")
    for name, value in theta.items():
        ranges = [res["ranges"][name] for res in results]
        assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == len(value)
        for res, (start, stop) in zip(results, ranges, strict=True):
            assert res["local_shapes"][name] == (stop - start, *value.shape[1:])
    assert results[1]["ranges"]["3.weight"] == (1, 1)  # rank 1 holds no row of it
    assert results[0]["ranges"]["2.weight"] == (0, 152)


@pytest.mark.parametrize("spec", ["fp32", "int8"])
def test_a_sharded_update_is_the_one_process_update(group: LocalProcessGroup, spec: str) -> None:
    results = group.run(_rank, spec)
    theta, rounds = _one_process(spec)
    spec_shapes = spec_of(theta)
    block = get_codec(spec).chunk_multiple or 1
    assert results[1]["rounds"][0]["slices"] is None  # gathered on rank 0 only
    sent = {n: np.zeros_like(v) for n, v in theta.items()}
    aligned_seen = misaligned_seen = 0
    for r, want in enumerate(rounds):
        gathered = results[0]["rounds"][r]["slices"]
        assert all(enc.rows is not None for enc in gathered)
        got = decode_tensors(gathered, spec_shapes, slices=True)
        for name, shape in spec_shapes.items():
            residual = _assembled(results, r, name, shape)
            before = _assembled(results, r - 1, name, shape)
            y = want["delta"][name] + before  # what the ranks encoded
            # Error feedback's rule, rank by rank: the residual is what the encoding lost.
            assert np.array_equal(residual, y - got[name]), name
            sent[name] += got[name]
            if spec == "fp32" or _aligned(results, name, shape, block):
                aligned_seen += 1
                assert np.array_equal(got[name], want["decoded"][name]), name
                assert np.array_equal(residual, want["residuals"][name]), name
            else:
                misaligned_seen += 1
                bound = float(np.abs(y).max()) / 127 * 0.5 * (1 + 2**-9)
                assert float(np.abs(residual).max()) <= bound, name
                assert not np.array_equal(got[name], want["decoded"][name]), name
        sq = sum(res["rounds"][r]["sq_norm"] for res in results)
        owed = sum(
            float(np.sum(_assembled(results, r, n, shape).astype(np.float64) ** 2))
            for n, shape in spec_shapes.items()
        )
        assert np.isclose(sq, owed, rtol=1e-9, atol=0)
        if spec == "fp32":
            assert sq == 0.0 == want["norm"]
        else:  # the error still owed, of the same size as the one process's
            assert 0.5 < np.sqrt(sq) / want["norm"] < 2.0
    # Over the rounds, what was sent plus what is owed is what the one process sent plus owes.
    last = len(rounds) - 1
    for name, shape in spec_shapes.items():
        ours = sent[name] + _assembled(results, last, name, shape)
        theirs = sum(w["decoded"][name] for w in rounds) + rounds[last]["residuals"][name]
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6, err_msg=name)
    assert aligned_seen and (spec == "fp32" or misaligned_seen)


def test_the_coordinator_folds_a_sharded_site_with_a_site_of_one_process(
    group: LocalProcessGroup,
) -> None:
    """One round's mean of a sharded site's slices and a one-process site's whole tensors is
    the mean of the two sites sending whole tensors, bit for bit (fp32)."""
    results = group.run(_rank, "fp32")
    theta, _ = _one_process("fp32")
    model = _model()
    local = {
        n: p.detach() - _noise(n, tuple(p.shape), ROUNDS[0]) for n, p in model.named_parameters()
    }
    codec = get_codec("fp32")
    whole = [codec.encode(n, theta[n] - local[n].numpy()) for n in theta]
    mixed, alike = MeanFold(1e6, ["fsdp", "one"]), MeanFold(1e6, ["fsdp", "one"])
    for fold, payload in ((mixed, results[0]["rounds"][0]["slices"]), (alike, whole)):
        assert isinstance(fold.add("fsdp", 3.0, payload, spec_of(theta)), str)
        assert isinstance(fold.add("one", 1.0, whole, spec_of(theta)), str)
    got, want = mixed.mean(), alike.mean()
    assert set(got) == set(theta)
    for name in theta:
        assert np.array_equal(got[name], want[name]), name


def test_shard_hash_is_the_state_hash_of_the_whole_model(group: LocalProcessGroup) -> None:
    results = group.run(_rank, "fp32")
    theta, _ = _one_process("fp32")
    assert results[0]["hash"] == state_hash(theta)
    assert results[1]["hash"] is None  # combined on rank 0
    # After a result (every tensor + 1): θ and the local parameters are its rows.
    new = {n: v + 1.0 for n, v in theta.items()}
    assert results[0]["hash_after"] == state_hash(new) != results[0]["hash"]
    for res in results:
        for name, value in new.items():
            start, stop = res["ranges"][name]
            assert np.array_equal(res["local_after"][name], value[start:stop]), name


def _fsdp_shards(world: int) -> tuple[Any, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from site_agent.shards import RankShards

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return RankShards.of_module(model), dict(model.named_parameters())


def _save(rank: int, world: int, path: str) -> dict[str, Any]:
    """One int8 round (residuals carried), then θ + 1 as a result; saved with dcp."""
    import torch.distributed.checkpoint as dcp

    shards, params = _fsdp_shards(world)
    with torch.no_grad():
        for name, p in params.items():
            rows = shards.ranges[name]
            p.to_local().sub_(_noise(name, tuple(p.shape), 1)[rows.start : rows.stop])
    shards.shard_update(params, get_codec("int8"))
    shards.apply_delta({n: np.ones(r.shape, dtype=np.float32) for n, r in shards.ranges.items()})
    dcp.save(shards.state_dict(), checkpoint_id=path)
    return _held(shards)


def _load(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from site_agent.shards import shard_hash

    shards, _ = _fsdp_shards(world)
    state = shards.state_dict()
    dcp.load(state, checkpoint_id=path)
    shards.load_state_dict(state)
    return {**_held(shards), "hash": shard_hash(shards)}


def _held(shards: Any) -> dict[str, Any]:
    return {
        "ranges": {n: (r.start, r.stop) for n, r in shards.ranges.items()},
        "theta": {n: _np(shards.theta(n)) for n in shards.ranges},
        "residual": {  # none carried (a shard of no rows): zeros, as saved
            n: _np(shards.residual(n))
            if shards.residual(n) is not None
            else np.zeros_like(_np(shards.theta(n)))
            for n in shards.ranges
        },
    }


def test_a_checkpoint_resumes_in_its_layout_and_reshards_to_another(
    group: LocalProcessGroup, tmp_path: Any
) -> None:
    """Each rank writes its rows with torch.distributed.checkpoint; two ranks load them back
    as they were, one rank (the whole model) by resharding."""
    path = str(tmp_path / "ckpt")
    saved = group.run(_save, path)
    theta = {n: np.concatenate([r["theta"][n] for r in saved]) for n in saved[0]["theta"]}
    residual = {n: np.concatenate([r["residual"][n] for r in saved]) for n in saved[0]["theta"]}
    same = group.run(_load, path)
    for before, after in zip(saved, same, strict=True):
        for name in theta:
            assert np.array_equal(after["theta"][name], before["theta"][name]), name
            assert np.array_equal(after["residual"][name], before["residual"][name]), name
    assert same[0]["hash"] == state_hash(theta)
    (one,) = group.run(_load, path, world_size=1)
    for name in theta:
        assert one["ranges"][name] == (0, len(theta[name]))
        assert np.array_equal(one["theta"][name], theta[name]), name
        assert np.array_equal(one["residual"][name], residual[name]), name
    assert one["hash"] == state_hash(theta)
    assert any(np.abs(r).max() > 0 for r in residual.values())
