"""Any job cut into stages by module name and trained by torch.distributed.pipelining.

Unit tests (one process): the candidate units of the byte GPT and of a Hugging Face Llama, the
stages' forwards composing to the whole model's exactly, the job contract's pipeline members and
the per-unit profile. Distributed tests (spawned CPU processes in a gloo group): a pipelined
step equals one process training on the same global batch, to float rounding, for torch's
GPipe, 1F1B, interleaved 1F1B and zero-bubble V schedules, for the Hugging Face job, and for two
stages x two replicas averaging by one all-reduce (DDP and FSDP: ``test_pipeline_dp.py``).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from site_agent.jobs.contract import JobContext
from site_agent.pipeline.engine import PipelineConfig, RankPipeline, make_stage_plan
from site_agent.trainer import JobTrainer
from tests.support.procgroup import LocalProcessGroup

pytestmark = pytest.mark.timeout(300)

BYTEGPT_OPTIONS = {
    "model": {"context_len": 16, "num_layers": 4, "d_model": 32, "num_heads": 4},
    "data": {"max_bytes": 20_000},
    "optim": {"batch_size": 8, "warmup_steps": 2},
}
HF_OPTIONS = {
    "context_len": 16,
    "batch_size": 8,
    "warmup_steps": 2,
    "config": {"num_hidden_layers": 3},
    "data": {"max_bytes": 20_000},
}


EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"


class _MaskedBlock(nn.Linear):
    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.tanh(super().forward(x)) * keep.unsqueeze(-1)


class _Masked(nn.Module):
    """Blocks whose forward takes a second input, a mask of the positions to keep."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_MaskedBlock(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, keep)
        return x


class _MaskedJob:
    """A job whose model takes two inputs: ``split`` gives ``((x, keep), y)``."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = _Masked()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(seed)
        self.data = [
            (torch.randn(16, 5, 8, generator=g), torch.randint(0, 2, (16, 5), generator=g))
            for _ in range(4)
        ]

    def batches(self) -> Iterator[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
        for x, keep in self.data:
            yield (x, keep), x.flip(-1)

    def split(self, batch: Any) -> Any:
        return batch

    def output_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        (x, keep), y = batch
        return self.output_loss(model(x, keep), y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"loss": float(self.loss(model, next(self.batches())))}


class _InplaceJob(_MaskedJob):
    """One input; ReLUs that change their input in place, one beginning a stage."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(True), nn.Linear(8, 8)
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def batches(self) -> Iterator[Any]:
        for x, _ in self.data:
            yield x, x.flip(-1)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.output_loss(model(batch[0]), batch[1])


class TorchTransformer(nn.Module):
    """torch's own nn.TransformerEncoder, whose forward reads ``layers[0].self_attn``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        # No biases: a key bias gets gradients of float noise only, which AdamW scales up.
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(16, 30)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, time = ids.shape  # the token ids' shape, on every stage
        mask = nn.Transformer.generate_square_subsequent_mask(time)
        return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=True))


class _TransformerJob(_MaskedJob):
    """torch's own nn.TransformerEncoder on token ids, next-token targets."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        torch.manual_seed(seed)
        self.model = TorchTransformer()  # type: ignore[assignment]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(seed)
        self.ids = [torch.randint(0, 30, (16, 7), generator=g) for _ in range(4)]

    def batches(self) -> Iterator[Any]:
        for ids in self.ids:
            yield ids, ids.roll(-1, dims=1)

    def output_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.output_loss(model(batch[0]), batch[1])


def make_job(kind: str, seed: int = 3) -> Any:
    ctx = dict(site_id="t", seed=seed, device=torch.device("cpu"))
    if kind == "masked":
        return _MaskedJob(seed)
    if kind == "inplace":
        return _InplaceJob(seed)
    if kind == "transformer":
        return _TransformerJob(seed)
    if kind == "regression":  # a job written outside the package: an nn.Sequential with a Tanh
        spec = importlib.util.spec_from_file_location(
            "regression_job", EXAMPLES / "regression_job.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.make_job(JobContext(**ctx, options={}))  # type: ignore[arg-type]
    if kind == "hf":
        from site_agent.jobs.hf import make_job as make_hf

        return make_hf(JobContext(**ctx, options=HF_OPTIONS))  # type: ignore[arg-type]
    from site_agent.jobs.bytegpt import make_job as make_bytegpt

    return make_bytegpt(JobContext(**ctx, options=BYTEGPT_OPTIONS))  # type: ignore[arg-type]


# -- spawned processes ------------------------------------------------------------------------


def _pipeline_config(
    schedule: str,
    num_stages: int,
    num_replicas: int,
    *,
    microbatches: int,
    data_parallel: str = "ddp",
) -> PipelineConfig:
    return PipelineConfig(
        num_stages=num_stages,
        num_replicas=num_replicas,
        num_microbatches=microbatches,
        schedule=schedule,
        data_parallel=data_parallel,
        profile_steps=1,
    )


@pytest.fixture(scope="module")
def group() -> Iterator[LocalProcessGroup]:
    with LocalProcessGroup(4, timeout_s=280) as pool:
        yield pool


def _make_pipeline(
    rank: int,
    world_size: int,
    job: Any,
    sample: Any,
    schedule: str,
    num_replicas: int,
    data_parallel: str,
) -> RankPipeline:
    """This rank's stages of ``job`` (its plan made on rank 0 from ``sample``), as the site
    makes them."""
    cfg = _pipeline_config(
        schedule,
        world_size // num_replicas,
        num_replicas,
        microbatches=4,
        data_parallel=data_parallel,
    )
    box: list[Any] = [make_stage_plan(job, sample, cfg) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return RankPipeline(job, box[0], cfg, rank=rank, device=torch.device("cpu"))


def _train(
    pipeline: RankPipeline, batches: list[Any], rank: int
) -> tuple[dict[str, np.ndarray], list[float | None]]:
    """Replica r's share of each global batch, one step each; the whole federated tensors
    (every rank takes part: under FSDP they are gathered) and the losses of the last stage."""
    from site_agent.pipeline.rank import _share

    replica, num_replicas = pipeline.layout.replica_of(rank), pipeline.layout.num_replicas
    losses = []
    for batch in batches:
        loss = pipeline.train_step(_share(batch, replica, num_replicas))
        losses.append(None if loss is None else float(loss))
    return {k: v.detach().numpy().copy() for k, v in pipeline.full_state().items()}, losses


def _rank_run(
    rank: int,
    world_size: int,
    kind: str,
    schedule: str,
    num_replicas: int,
    steps: int,
    data_parallel: str = "allreduce",
) -> tuple[dict[str, np.ndarray], list[float | None]]:
    torch.set_num_threads(1)
    job = make_job(kind)
    batches = [next(iter(job.batches())) for _ in range(steps)]
    pipeline = _make_pipeline(
        rank, world_size, job, batches[0], schedule, num_replicas, data_parallel
    )
    return _train(pipeline, batches, rank)


def _single_process(kind: str, steps: int) -> tuple[dict[str, np.ndarray], list[float]]:
    job = make_job(kind)
    trainer = JobTrainer(job, grad_clip=1.0)
    batches = [next(iter(job.batches())) for _ in range(steps)]
    losses = []
    for batch in batches:
        trainer._batches = iter([batch])
        losses.append(trainer.train_steps(1).loss_mean)
    return trainer.parameters_numpy(), losses


@pytest.mark.parametrize(
    ("kind", "schedule", "world_size", "num_replicas"),
    [
        ("bytegpt", "gpipe", 2, 1),
        ("bytegpt", "1f1b", 2, 1),
        ("bytegpt", "interleaved_1f1b", 2, 1),
        ("bytegpt", "zbv", 2, 1),
        ("hf", "1f1b", 2, 1),
        ("hf", "zbv", 2, 1),
        ("bytegpt", "1f1b", 4, 2),
        ("bytegpt", "gpipe", 4, 2),
        ("regression", "1f1b", 2, 1),
        ("regression", "gpipe", 4, 2),
        ("masked", "1f1b", 2, 1),
        ("masked", "zbv", 2, 1),
        ("masked", "interleaved_1f1b", 4, 2),
        ("inplace", "1f1b", 2, 1),
        ("transformer", "1f1b", 2, 1),
        ("transformer", "zbv", 2, 1),
    ],
)
def test_pipelined_steps_equal_one_process(
    group: LocalProcessGroup, kind: str, schedule: str, world_size: int, num_replicas: int
) -> None:
    steps = 3
    results = group.run(_rank_run, kind, schedule, num_replicas, steps, world_size=world_size)
    check_equals_one_process(results, kind, steps, num_replicas)


def check_equals_one_process(
    results: list[tuple[dict[str, np.ndarray], list[float | None]]],
    kind: str,
    steps: int,
    num_replicas: int,
) -> None:
    """Every rank's (federated tensors, last-stage losses) after ``steps`` pipelined steps
    against one process's ``steps`` steps on the same global batches. The parameters differ by
    float summation order only (micro-batch and replica gradients summed in another order than
    one batch's mean, and the clipping norm summed by stage): 5e-5 absolute, where three steps
    of every layout so far differed by at most 6e-6."""
    world_size = len(results)
    expected, expected_losses = _single_process(kind, steps)
    merged: dict[str, np.ndarray] = {}
    pp_size = world_size // num_replicas
    for params, _ in results[:pp_size]:  # replica 0
        assert not set(params) & set(merged), "each stage holds its own tensors"
        merged.update(params)
    for rank in range(pp_size, world_size):  # the other replicas hold the same values
        for name, value in results[rank][0].items():
            np.testing.assert_array_equal(value, results[rank % pp_size][0][name])
    assert list(expected) == [n for n in expected if n in merged] and set(merged) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(merged[name], value, rtol=0, atol=5e-5, err_msg=name)
    # The loss of a replica's last stage: the whole batch's when there is one replica.
    last_losses = [losses for _, losses in results if losses[0] is not None]
    assert len(last_losses) == num_replicas
    if num_replicas == 1:
        np.testing.assert_allclose(last_losses[0], expected_losses, rtol=1e-5)
    else:
        np.testing.assert_allclose(np.mean(last_losses, axis=0), expected_losses, rtol=1e-5)


# -- the leader's trainer and the workers' loop -----------------------------------------------


def _site_run(
    rank: int, world_size: int, schedule: str, num_replicas: int, data_parallel: str = "ddp"
) -> Any:
    from site_agent.pipeline.leader import PipelineTrainer
    from site_agent.pipeline.rank import worker_loop

    torch.set_num_threads(1)
    cfg = _pipeline_config(
        schedule,
        world_size // num_replicas,
        num_replicas,
        microbatches=2,
        data_parallel=data_parallel,
    )
    job, device = make_job("bytegpt"), torch.device("cpu")
    if rank != 0:
        worker_loop(job, cfg, device)
        return None
    with PipelineTrainer(job, cfg, device) as trainer:
        first = trainer.train_steps(2)
        state = trainer.state_dict()
        after_three = trainer.train_steps(1)
        params_three = trainer.parameters_numpy()
        metrics = trainer.validate()
        trainer.load_state_dict(state)  # back to step 2: the third step again
        again = trainer.train_steps(1)
        params_again = trainer.parameters_numpy()
        # As a checkpoint from before data_parallel was recorded (its ranks held whole tensors).
        trainer.load_state_dict({**state, "layout": state["layout"][:3]})
        legacy = trainer.train_steps(1)
        params_legacy = trainer.parameters_numpy()
        # A checkpoint of another cut into stages: the model by name, the optimizer afresh.
        trainer.load_state_dict({**state, "layout": [*state["layout"][:4], [0]]})
        other_cut = trainer.train_steps(1)
        params_other_cut = trainer.parameters_numpy()
        trainer.load_parameters({k: v * 0 for k, v in params_again.items()})
        zeros = trainer.parameters_numpy()
        return {
            "losses": [first.loss_mean, after_three.loss_mean, again.loss_mean],
            "params": params_three,
            "params_again": params_again,
            "loss_legacy": legacy.loss_mean,
            "params_legacy": params_legacy,
            "loss_other_cut": other_cut.loss_mean,
            "params_other_cut": params_other_cut,
            "layout": state["layout"],
            "zeros": max(float(np.abs(v).max()) for v in zeros.values()),
            "metrics": metrics,
            "fingerprint": trainer.fingerprint("site_agent.jobs.bytegpt:make_job"),
            "state_keys": sorted(state),
        }


@pytest.mark.parametrize(("schedule", "world_size", "num_replicas"), [("1f1b", 2, 1)])
def test_a_pipelined_job_site_trains_resumes_and_syncs_by_name(
    group: LocalProcessGroup, schedule: str, world_size: int, num_replicas: int
) -> None:
    out = group.run(_site_run, schedule, num_replicas, world_size=world_size)[0]
    check_site_run(out, data_parallel="ddp" if num_replicas > 1 else "allreduce")


def check_site_run(out: dict[str, Any], data_parallel: str) -> None:
    """What ``_site_run`` saw on the leader against one process training the same batches."""
    from site_agent.jobs.contract import build_job

    job = build_job(
        "site_agent.jobs.bytegpt:make_job",
        JobContext(site_id="t", seed=3, device=torch.device("cpu"), options=BYTEGPT_OPTIONS),
    )
    single = JobTrainer(job, grad_clip=1.0)
    stats = [single.train_steps(2), single.train_steps(1)]
    for name, value in single.parameters_numpy().items():
        np.testing.assert_allclose(out["params"][name], value, rtol=0, atol=5e-5, err_msg=name)
    np.testing.assert_allclose(out["losses"][:2], [s.loss_mean for s in stats], rtol=1e-5)
    # Resumed from its own checkpoint, the site takes the same third step again.
    assert out["losses"][2] == out["losses"][1]
    for name, value in out["params"].items():
        np.testing.assert_array_equal(out["params_again"][name], value, err_msg=name)
    assert out["layout"][3] == data_parallel
    # An old checkpoint: the model loads by name (the same third loss), and the optimizer
    # state too where the ranks hold whole tensors; under FSDP, whose ranks hold shards, not.
    assert out["loss_legacy"] == out["losses"][1]
    legacy_equal = all(
        np.array_equal(out["params_legacy"][name], value) for name, value in out["params"].items()
    )
    assert legacy_equal == (data_parallel != "fsdp")
    assert out["loss_other_cut"] == out["losses"][1]
    assert not all(
        np.array_equal(out["params_other_cut"][name], value)
        for name, value in out["params"].items()
    )
    assert len(out["layout"]) == 5 and out["layout"][4][0] == 0
    assert out["zeros"] == 0.0
    assert out["metrics"]["loss"] > 0
    assert out["fingerprint"] == single.fingerprint("site_agent.jobs.bytegpt:make_job")
    assert out["state_keys"] == ["job", "layout", "model", "ranks", "step"]


def _regression_site_run(rank: int, world_size: int, steps: int) -> dict[str, np.ndarray] | None:
    from site_agent.pipeline.leader import PipelineTrainer
    from site_agent.pipeline.rank import worker_loop

    torch.set_num_threads(1)
    cfg = _pipeline_config("1f1b", world_size, 1, microbatches=4)
    job, device = make_job("regression"), torch.device("cpu")
    if rank != 0:
        worker_loop(job, cfg, device)
        return None
    with PipelineTrainer(job, cfg, device) as trainer:
        trainer.train_steps(steps)
        return trainer.parameters_numpy()


def test_a_pipelined_site_begins_the_jobs_batches_again_when_they_run_out(
    group: LocalProcessGroup,
) -> None:
    steps = 20  # the job's batches() yields 16 batches a pass
    assert len(list(make_job("regression").batches())) < steps
    params = group.run(_regression_site_run, steps, world_size=2)[0]
    single = JobTrainer(make_job("regression"), grad_clip=1.0)
    single.train_steps(steps)
    for name, value in single.parameters_numpy().items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=5e-5, err_msg=name)


@pytest.mark.timeout(120)
def test_a_restart_cuts_as_the_last_start_did(tmp_path: Path) -> None:
    """With ``cut_record``, rank 0 keeps the cut it made and the next start of the same job into
    as many stages takes it instead of cutting by the step times it measures (which vary);
    a record of another model or number of stages is ignored."""
    torch.set_num_threads(1)
    record = tmp_path / "state" / "pipeline-cut.json"
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1, cut_record=str(record))
    job = make_job("bytegpt")
    sample = next(iter(job.batches()))
    first = make_stage_plan(job, sample, cfg)
    kept = json.loads(record.read_text())
    assert kept["boundaries"] == list(first.partition.boundaries)
    units = kept["units"]
    # Another cut than the measured one, as a start under another load may have made.
    other = [0, len(units) - 1] if first.partition.boundaries != (0, len(units) - 1) else [0, 1]
    record.write_text(json.dumps({**kept, "boundaries": other}))
    again = make_stage_plan(make_job("bytegpt"), sample, cfg)
    assert list(again.partition.boundaries) == other
    assert json.loads(record.read_text())["boundaries"] == other
    # Kept for another model (other units, or the same names in other shapes), or not a cut
    # of this one: cut afresh, and keep the new cut.
    for stale in (
        {**kept, "units": [*units, "extra"], "boundaries": other},
        {**kept, "model": "another", "boundaries": other},
        {**kept, "boundaries": [0, len(units)]},
    ):
        record.write_text(json.dumps(stale))
        fresh = make_stage_plan(make_job("bytegpt"), sample, cfg)
        assert json.loads(record.read_text()) == {
            **kept,
            "boundaries": list(fresh.partition.boundaries),
        }
