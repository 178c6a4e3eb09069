"""Pipelined training across spawned gloo processes equals single-process training.

Each scenario runs in a module-wide pool of spawned CPU processes (``LocalProcessGroup``): rank 0
drives a ``PipelineTrainer``, the other ranks run ``worker_loop``. The reference is a
``LocalTrainer`` in this process fed exactly the samples the replicas drew, concatenated into the
site's global batch.

Parameters are compared as updates (``after - before``), element by element, within 1e-5 of the
update or of one full step (``lr``), whichever is larger, plus the float32 spacing of the
parameter (the update is rounded into it). One exception is
inherent to AdamW, not to the pipeline: the pipeline sums micro-batch gradients in another order,
so a gradient element that is itself a near-cancelling sum comes out ~1e-10 apart, and where such
an element is below ~100 x eps (1e-6) the first Adam step g / (|g| + eps) amplifies that; those
elements are held to 1% of one step instead.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from crossdc.bench.pipeline import analyze
from site_agent.data import BatchSampler, ByteCorpus, eval_batches
from site_agent.jobs.bytegpt import LocalTrainer
from site_agent.model import ModelConfig, build_model, lm_loss
from site_agent.pipeline.executor import OpRecord, StepTrace, check_schedule
from site_agent.pipeline.job import PipelineConfig, PipelineJob, replica_seed
from site_agent.pipeline.leader import PipelineTrainer
from site_agent.pipeline.procgroup import LocalProcessGroup
from site_agent.pipeline.runtime import LAUNCH_CHECK_MODEL, LAUNCH_CHECK_MODULES, launch_check_job
from site_agent.pipeline.schedule import Op, make_schedule
from site_agent.pipeline.simulate import simulate
from site_agent.pipeline.stage import PipelineLayout, StageModule, slice_stage
from site_agent.pipeline.worker import worker_loop
from site_agent.trainer import InnerOptimConfig, TrainStats

torch.set_num_threads(1)

pytestmark = pytest.mark.timeout(120)

TINY = ModelConfig(context_len=16, num_layers=4, d_model=32, num_heads=4)
OPTIM = InnerOptimConfig(batch_size=16, warmup_steps=0, grad_clip=1.0)
RTOL = 1e-5
ILL_CONDITIONED_GRAD = 1e-6  # |g| below ~100 x AdamW's eps
ILL_CONDITIONED_ATOL = 1e-2 * OPTIM.lr


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.from_stdlib_modules(["textwrap"], max_bytes=20_000)


@pytest.fixture(scope="module")
def group() -> Any:
    with LocalProcessGroup(4, timeout_s=100) as pool:
        yield pool


def _job(
    stages: int,
    replicas: int = 1,
    schedule: str = "1f1b",
    microbatches: int = 4,
    boundaries: tuple[int, ...] | None = None,
    p2p: str = "auto",
) -> PipelineJob:
    return PipelineJob(
        model=TINY,
        optim=OPTIM,
        pipeline=PipelineConfig(
            num_stages=stages,
            num_replicas=replicas,
            num_microbatches=microbatches,
            schedule=schedule,
            boundaries=boundaries,
            profile_steps=1,
            p2p=p2p,
        ),
    )


class _FixedBatches:
    """Stands in for a ``BatchSampler``: hands out given batches in order."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], batch_size: int) -> None:
        self.batches = list(batches)
        self.batch_size = batch_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches.pop(0)


def _global_batches(
    job: PipelineJob, corpus: ByteCorpus, num_steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What the site's replicas draw in ``num_steps`` steps, replica by replica, concatenated."""
    replicas = job.pipeline.num_replicas
    samplers = [
        BatchSampler(
            corpus,
            batch_size=job.optim.batch_size // replicas,
            context_len=job.model.context_len,
            seed=replica_seed(job.data_seed, r, replicas),
        )
        for r in range(replicas)
    ]
    batches = []
    for _ in range(num_steps):
        drawn = [s.next_batch() for s in samplers]
        batches.append((torch.cat([x for x, _ in drawn]), torch.cat([y for _, y in drawn])))
    return batches


def _reference(job: PipelineJob, corpus: ByteCorpus, num_steps: int) -> LocalTrainer:
    sampler = _FixedBatches(_global_batches(job, corpus, num_steps), job.optim.batch_size)
    return LocalTrainer(
        model=build_model(job.model, seed=job.model_seed),
        sampler=cast(BatchSampler, sampler),
        optim_cfg=job.optim,
    )


def _clipped_grads(
    params: Mapping[str, np.ndarray], batch: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, np.ndarray]:
    """The single-process gradient of ``batch`` at ``params``, clipped as the trainers clip it."""
    model = build_model(TINY, seed=0)
    model.load_state_dict({k: torch.tensor(v) for k, v in params.items()})
    x, y = batch
    torch.autograd.backward(lm_loss(model(x), y))
    torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
    return {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_update(
    before: Mapping[str, np.ndarray],
    after: Mapping[str, np.ndarray],
    ref_after: Mapping[str, np.ndarray],
    grads: Mapping[str, np.ndarray],
) -> None:
    """``after`` and ``ref_after`` are one AdamW step from ``before`` (see the module docstring)."""
    assert list(after) == list(ref_after)
    for name, ref in ref_after.items():
        update = after[name].astype(np.float64) - before[name]
        ref_update = ref.astype(np.float64) - before[name]
        assert np.abs(ref_update).max() > 0, name
        tol = RTOL * np.maximum(np.abs(ref_update), OPTIM.lr) + np.spacing(np.abs(ref))
        tol = np.where(np.abs(grads[name]) < ILL_CONDITIONED_GRAD, ILL_CONDITIONED_ATOL, tol)
        excess = np.abs(update - ref_update) - tol
        assert excess.max() <= 0, (name, np.unravel_index(excess.argmax(), excess.shape))


def _params_equal(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)


# -- scenarios: module-level so the spawned ranks can import them ---------------------------


def _one_step(rank: int, world: int, job: PipelineJob, corpus: ByteCorpus, evals: Any) -> Any:
    if rank != 0:
        worker_loop(job, corpus, device="cpu")
        return None
    with PipelineTrainer.start(job, corpus, device="cpu") as trainer:
        before = trainer.parameters_numpy()
        eval_loss = trainer.evaluate(evals)
        stats = trainer.train_steps(1)
        return {
            "before": before,
            "eval_loss": eval_loss,
            "stats": stats,
            "after": trainer.parameters_numpy(),
            "step": trainer.step,
            "boundaries": trainer.plan.boundaries,
            "traces": trainer.last_step_traces(),
        }


def _parameters_round_trip(rank: int, world: int, job: PipelineJob, corpus: ByteCorpus) -> Any:
    if rank != 0:
        worker_loop(job, corpus, device="cpu")
        return None
    with PipelineTrainer.start(job, corpus, device="cpu") as trainer:
        params = trainer.parameters_numpy()
        rng = np.random.default_rng(0)
        new = {k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in params.items()}
        for array in new.values():
            array.flags.writeable = False  # as decoded from the wire
        trainer.load_parameters(new)
        loaded = trainer.parameters_numpy()
        errors = []
        missing = dict(new)
        missing.pop("layers.1.qkv.weight")
        wrong_shape = {**new, "layers.0.position.weight": np.zeros((3, 3), np.float32)}
        extra = {**new, "layers.9.bogus": np.zeros(1, np.float32)}
        for bad in (missing, wrong_shape, extra):
            try:
                trainer.load_parameters(bad)
            except ValueError as exc:
                errors.append(str(exc))
        unchanged = trainer.parameters_numpy()
        stats = trainer.train_steps(1)  # the workers are still in step after the rejected calls
        return {
            "new": new,
            "loaded": loaded,
            "errors": errors,
            "unchanged": unchanged,
            "stats": stats,
        }


def _state_round_trip(
    rank: int, world: int, job: PipelineJob, corpus: ByteCorpus, initial: dict[str, Any] | None
) -> Any:
    if rank != 0:
        worker_loop(job, corpus, device="cpu")
        return None
    with PipelineTrainer.start(job, corpus, device="cpu") as trainer:
        if initial is not None:
            trainer.load_state_dict(initial)
        else:
            trainer.train_steps(2)
        state = trainer.state_dict()
        first = trainer.train_steps(1)
        first_params = trainer.parameters_numpy()
        trainer.load_state_dict(state)
        again = trainer.train_steps(1)
        return {
            "state": state,
            "first": first,
            "first_params": first_params,
            "again": again,
            "again_params": trainer.parameters_numpy(),
            "step": trainer.step,
        }


def _start_error(rank: int, world: int, job: PipelineJob, corpus: ByteCorpus) -> str:
    try:
        if rank == 0:
            PipelineTrainer.start(job, corpus, device="cpu")
        else:
            worker_loop(job, corpus, device="cpu")
    except ValueError as exc:
        return str(exc)
    return "no error"


# -- tests -----------------------------------------------------------------------------------

# gloo runs the preposted exchange under "auto"; "grouped" (what NCCL uses) is run here too.
LAYOUTS = [
    pytest.param(2, 1, "gpipe", None, "auto", id="pp2-gpipe"),
    pytest.param(2, 1, "1f1b", None, "auto", id="pp2-1f1b"),
    pytest.param(4, 1, "gpipe", (0, 1, 3, 5), "auto", id="pp4-gpipe"),
    pytest.param(4, 1, "1f1b", None, "auto", id="pp4-1f1b"),
    pytest.param(2, 2, "1f1b", None, "auto", id="dp2-pp2-1f1b"),
    pytest.param(2, 2, "gpipe", (0, 4), "auto", id="dp2-pp2-gpipe"),
    pytest.param(4, 1, "1f1b", None, "grouped", id="pp4-1f1b-grouped"),
    pytest.param(2, 2, "gpipe", (0, 4), "grouped", id="dp2-pp2-gpipe-grouped"),
]


@pytest.mark.parametrize(("stages", "replicas", "schedule", "boundaries", "p2p"), LAYOUTS)
def test_one_step_matches_single_process(
    group: LocalProcessGroup,
    corpus: ByteCorpus,
    stages: int,
    replicas: int,
    schedule: str,
    boundaries: tuple[int, ...] | None,
    p2p: str,
) -> None:
    job = _job(stages, replicas, schedule, boundaries=boundaries, p2p=p2p)
    evals = eval_batches(corpus, num_batches=2, batch_size=3, context_len=TINY.context_len)
    result = group.run(_one_step, job, corpus, evals, world_size=stages * replicas)[0]

    batches = _global_batches(job, corpus, 1)
    reference = _reference(job, corpus, 1)
    ref_before = reference.parameters_numpy()
    ref_eval = reference.evaluate(evals)
    ref_stats = reference.train_steps(1)
    ref_after = reference.parameters_numpy()

    # Same initial model, gathered under the single-process names and order.
    assert _params_equal(result["before"], ref_before)
    if boundaries is not None:
        assert result["boundaries"] == boundaries
    assert result["eval_loss"] == pytest.approx(ref_eval, rel=1e-6)
    stats: TrainStats = result["stats"]
    assert stats.steps == 1 and result["step"] == 1
    assert stats.tokens == ref_stats.tokens == OPTIM.batch_size * TINY.context_len
    assert stats.loss_mean == pytest.approx(ref_stats.loss_mean, rel=RTOL)
    assert stats.loss_last == stats.loss_mean
    _assert_same_update(
        ref_before, result["after"], ref_after, _clipped_grads(ref_before, batches[0])
    )

    traces = result["traces"]
    assert len(traces) == stages * replicas
    for rank, trace in enumerate(traces):
        assert (trace.stage, trace.replica) == (rank % stages, rank // stages)
        assert len(trace.ops) == 2 * job.pipeline.num_microbatches
        for record in trace.ops:
            assert trace.start_s <= record.wait_start_s <= record.start_s <= record.end_s
        assert trace.ops[-1].end_s <= trace.ops_end_s <= trace.end_s


def test_gradient_clipping_is_active_in_these_tests(corpus: ByteCorpus) -> None:
    """The equality above covers the cross-stage norm only if clipping actually scales."""
    x, y = _global_batches(_job(2), corpus, 1)[0]
    model = build_model(TINY, seed=0)
    torch.autograd.backward(lm_loss(model(x), y))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert float(norm) > 2 * OPTIM.grad_clip


def test_parameters_round_trip_across_replicas(
    group: LocalProcessGroup, corpus: ByteCorpus
) -> None:
    result = group.run(_parameters_round_trip, _job(2, 2), corpus)[0]
    assert _params_equal(result["loaded"], result["new"])
    assert _params_equal(result["unchanged"], result["new"])
    assert len(result["errors"]) == 3
    assert "missing" in result["errors"][0]
    assert "shape" in result["errors"][1]
    assert "unexpected" in result["errors"][2]
    assert np.isfinite(result["stats"].loss_mean)


def test_state_dict_round_trip_with_replicas(group: LocalProcessGroup, corpus: ByteCorpus) -> None:
    result = group.run(_state_round_trip, _job(2, 2, "gpipe"), corpus, None)[0]
    assert result["again"] == TrainStats(
        steps=1,
        tokens=result["first"].tokens,
        loss_mean=result["first"].loss_mean,
        loss_last=result["first"].loss_last,
        compute_seconds=result["again"].compute_seconds,
    )
    assert _params_equal(result["again_params"], result["first_params"])
    assert result["step"] == 3
    state = result["state"]
    assert len(state["replica_samplers"]) == 2
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert list(loaded["model"]) == list(build_model(TINY, seed=0).state_dict())


def test_local_checkpoint_resumes_in_a_pipeline(
    group: LocalProcessGroup, corpus: ByteCorpus
) -> None:
    """A LocalTrainer checkpoint restores into 4 stages and training continues identically;
    the pipeline's own checkpoint holds the same model, optimizer, sampler and step."""
    job = _job(4, 1, "1f1b", microbatches=2)
    local = LocalTrainer(
        model=build_model(TINY, seed=0),
        sampler=BatchSampler(corpus, batch_size=16, context_len=16, seed=0),
        optim_cfg=OPTIM,
    )
    local.train_steps(2)
    buffer = io.BytesIO()
    torch.save(local.state_dict(), buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    before = local.parameters_numpy()

    result = group.run(_state_round_trip, job, corpus, checkpoint)[0]
    ref_stats = local.train_steps(1)
    assert result["first"].loss_mean == pytest.approx(ref_stats.loss_mean, rel=RTOL)
    third_batch = BatchSampler(corpus, batch_size=16, context_len=16, seed=0)
    for _ in range(2):
        third_batch.next_batch()
    grads = _clipped_grads(before, third_batch.next_batch())
    _assert_same_update(before, result["first_params"], local.parameters_numpy(), grads)
    assert _params_equal(result["again_params"], result["first_params"])

    state = result["state"]
    assert _params_equal(
        {k: v.numpy() for k, v in state["model"].items()},
        {k: v.numpy() for k, v in checkpoint["model"].items()},
    )
    assert state["step"] == checkpoint["step"] == 2
    assert state["sampler"] == checkpoint["job"]["sampler"]  # the byte GPT job keeps it
    ours, theirs = state["optimizer"], checkpoint["optimizer"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for idx, entry in theirs["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(ours["state"][idx][key], value, rtol=0, atol=0)


def test_world_size_must_match_the_layout(group: LocalProcessGroup, corpus: ByteCorpus) -> None:
    messages = group.run(_start_error, _job(2, 2), corpus, world_size=2)
    assert all("2 ranks" in m and "= 4" in m for m in messages)


def test_torchrun_launch_matches_single_process() -> None:
    """The real launch path: torchrun, ``init_from_torchrun_env``, rank 0 leads, rank 1 works."""
    repo = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "site_agent.pipeline.runtime",
        "--stages",
        "2",
        "--schedule",
        "gpipe",
        "--steps",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and report["steps"] == 2
    assert "pipeline plan" in done.stderr

    job = launch_check_job(stages=2, replicas=1, microbatches=4, schedule="gpipe", batch_size=16)
    corpus = ByteCorpus.from_stdlib_modules(LAUNCH_CHECK_MODULES, max_bytes=50_000)
    reference = LocalTrainer(
        model=build_model(LAUNCH_CHECK_MODEL, seed=job.model_seed),
        sampler=BatchSampler(corpus, batch_size=16, context_len=32, seed=job.data_seed),
        optim_cfg=job.optim,
    )
    stats = reference.train_steps(2)
    assert report["loss_mean"] == pytest.approx(stats.loss_mean, rel=RTOL)
    assert report["loss_last"] == pytest.approx(stats.loss_last, rel=RTOL)


def test_rank_layout() -> None:
    layout = PipelineLayout(num_stages=3, num_replicas=2)
    assert layout.world_size == 6
    assert [layout.rank(stage=s, replica=r) for r in range(2) for s in range(3)] == list(range(6))
    assert [(layout.stage_of(k), layout.replica_of(k)) for k in range(6)] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1),
        (1, 1),
        (2, 1),
    ]
    assert layout.stage_ranks(1) == [1, 4]
    assert layout.replica_ranks(1) == [3, 4, 5]
    with pytest.raises(ValueError, match="num_stages"):
        PipelineLayout(num_stages=0, num_replicas=1)


def test_stage_module_keeps_full_model_names() -> None:
    model = build_model(TINY, seed=0)
    stages = [slice_stage(list(model.layers), idx) for idx in ((0, 1), (2, 3, 4), (5,))]
    names = [n for stage in stages for n in stage.state_dict()]
    assert names == list(model.state_dict())
    x = torch.randint(0, 256, (2, TINY.context_len))
    out = x
    for stage in stages:
        out = stage(out)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="contiguous"):
        StageModule({0: model.layers[0], 2: model.layers[2]})


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="schedule"):
        PipelineConfig(schedule="zigzag")
    with pytest.raises(ValueError, match="num_microbatches"):
        PipelineConfig(num_microbatches=0)
    with pytest.raises(ValueError, match="pipeline.p2p must be one of auto, grouped, preposted"):
        PipelineConfig(p2p="eager")
    with pytest.raises(ValueError, match="boundaries"):
        PipelineConfig(num_stages=2, boundaries=(0,))
    with pytest.raises(ValueError, match="boundaries"):
        PipelineConfig(num_stages=2, boundaries=(1, 3))
    with pytest.raises(ValueError, match="divisible"):
        PipelineJob(model=TINY, optim=OPTIM, pipeline=PipelineConfig(num_replicas=3))
    with pytest.raises(ValueError, match="exceeds"):
        PipelineJob(model=TINY, optim=OPTIM, pipeline=PipelineConfig(num_stages=8))
    with pytest.raises(ValueError, match="past"):
        PipelineJob(
            model=TINY, optim=OPTIM, pipeline=PipelineConfig(num_stages=2, boundaries=(0, 6))
        )
    assert _job(2, 2).microbatch_size == 2
    assert replica_seed(0, 0, 1) == 0
    assert len({replica_seed(s, r, 2) for s in range(3) for r in range(2)}) == 6


def test_deadlocking_schedule_is_rejected() -> None:
    f0, f1, b0, b1 = Op("F", 0), Op("F", 1), Op("B", 0), Op("B", 1)
    check_schedule([[f0, f1, b1, b0], [f0, f1, b1, b0]], 2, 2)
    with pytest.raises(ValueError, match="deadlock"):
        check_schedule([[f0, b0, f1, b1], [f1, f0, b0, b1]], 2, 2)


def test_neighbours_must_agree_on_microbatch_order() -> None:
    """Runs to the end, but stage 1 would send B(1)'s gradient where stage 0 receives B(0)'s."""
    f0, f1, b0, b1 = Op("F", 0), Op("F", 1), Op("B", 0), Op("B", 1)
    simulate([[f0, f1, b0, b1], [f0, f1, b1, b0]], 1.0, 1.0, 0.0)  # no deadlock
    with pytest.raises(ValueError, match=r"stages 0 and 1 run B ops in different micro-batch"):
        check_schedule([[f0, f1, b0, b1], [f0, f1, b1, b0]], 2, 2)
    with pytest.raises(ValueError, match=r"stages 0 and 1 run F ops in different micro-batch"):
        check_schedule([[f0, f1, b1, b0], [f1, f0, b1, b0]], 2, 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bench_analysis_reads_a_simulated_timeline_back(schedule: str) -> None:
    """Traces shaped like the simulator's own timeline give back its bubble and transfer."""
    fwd, bwd, transfer = [1.0, 2.0, 1.5], [2.0, 3.0, 2.5], 0.25
    sim = simulate(make_schedule(schedule, 3, 5), fwd, bwd, transfer)
    traces = []
    for stage, timeline in enumerate(sim.timeline):
        records, previous_end = [], 0.0
        for timing in timeline:
            records.append(OpRecord(timing.op, previous_end, timing.start_s, timing.end_s))
            previous_end = timing.end_s
        traces.append(StepTrace(stage, 0, 0, 0.0, tuple(records), previous_end, previous_end))
    figures = analyze(
        [traces, traces], schedule=schedule, num_stages=3, num_microbatches=5, transfer_s=9.0
    )
    assert figures["transfer_s"] == pytest.approx(transfer)
    assert figures["bubble_measured"] == pytest.approx(sim.bubble_fraction)
    assert figures["bubble_simulated"] == pytest.approx(sim.bubble_fraction)
    assert figures["bubble_replayed"] == pytest.approx(sim.bubble_fraction)
    assert figures["step_seconds"] == pytest.approx(sim.step_time_s)
    assert figures["bottleneck_measured"] == pytest.approx(5.0)
    assert figures["stage_forward_s"] == pytest.approx(fwd)
