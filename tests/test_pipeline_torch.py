"""Any job cut into stages by module name and trained by torch.distributed.pipelining.

Unit tests (one process): the candidate units of the byte GPT and of a Hugging Face Llama, the
stages' forwards composing to the whole model's exactly, the job contract's pipeline members and
the per-unit profile. Distributed tests (spawned CPU processes in a gloo group): a pipelined
step equals one process training on the same global batch, to float rounding, for torch's
GPipe, 1F1B, interleaved 1F1B and zero-bubble V schedules, for the Hugging Face job, and for two
stages x two replicas averaging by one all-reduce (DDP and FSDP: ``test_pipeline_dp.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from site_agent.jobs.contract import JobContext, JobError, check_pipeline_job
from site_agent.pipeline.chain import chain_companions, check_stages_compose
from site_agent.pipeline.cut import (
    PassThrough,
    StageForward,
    profile_units,
    strip_to_stage,
    units_of,
)
from site_agent.pipeline.engine import PipelineConfig, RankPipeline, make_stage_plan
from site_agent.pipeline.layout import stage_indices, stages_per_rank
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


EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


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


def make_job(kind: str, seed: int = 3) -> Any:
    ctx = dict(site_id="t", seed=seed, device=torch.device("cpu"))
    if kind == "masked":
        return _MaskedJob(seed)
    if kind == "inplace":
        return _InplaceJob(seed)
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


# -- one process ---------------------------------------------------------------------------


def test_units_of_the_byte_gpt_are_its_layers() -> None:
    units = units_of(make_job("bytegpt").model)
    assert units.names == tuple(f"layers.{i}" for i in range(6))
    assert units.tensors[0] == ("layers.0.token.weight", "layers.0.position.weight")


def test_units_of_a_llama_are_prefix_blocks_and_suffix() -> None:
    units = units_of(make_job("hf").model)
    assert units.names == (
        "<prefix>",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
    )
    assert units.tensors[0] == ("model.embed_tokens.weight",)
    assert units.tensors[-1] == ("model.norm.weight", "lm_head.weight")


def test_cut_points_named_by_the_job() -> None:
    model = make_job("hf").model
    units = units_of(model, ["model.layers.1", "model.norm"])
    assert units.names == ("<prefix>", "model.layers.1", "model.norm")
    assert units.tensors[0][0] == "model.embed_tokens.weight"
    assert units.tensors[0][-1].startswith("model.layers.0.")
    with pytest.raises(ValueError, match="not a module"):
        units_of(model, ["model.layers.9"])
    with pytest.raises(ValueError, match="comes before"):
        units_of(model, ["model.layers.1", "model.layers.0"])
    with pytest.raises(ValueError, match="holds no parameters"):
        units_of(model, ["model.rotary_emb"])


@pytest.mark.parametrize("kind", ["bytegpt", "hf"])
def test_stages_compose_to_the_whole_model(kind: str) -> None:
    model = make_job(kind).model.eval()
    units = units_of(model)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        whole = StageForward(model)(x)
        cuts = [(0, 2), (2, 4), (4, len(units))]
        stages = [
            StageForward(strip_to_stage(copy.deepcopy(model), units.owned(range(a, b))))
            for a, b in cuts
        ]
        out: torch.Tensor = x
        for stage in stages:
            out = stage(out)
    torch.testing.assert_close(out, whole, rtol=0, atol=0)
    # Each stage holds exactly its units' tensors, under the whole model's names.
    for stage, (a, b) in zip(stages, cuts, strict=True):
        assert set(stage.model.state_dict()) == units.owned(range(a, b))
    assert any(isinstance(m, PassThrough) for m in stages[0].modules())


def test_a_sequential_is_cut_at_its_layers_each_activation_with_its_consumer() -> None:
    model = nn.Sequential(nn.Tanh(), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4), nn.Tanh())
    x = torch.randn(5, 8)
    units = chain_companions(model, units_of(model), (x,))
    assert units.names == ("1", "3")  # no ModuleList: the Sequential's entries with tensors
    # Each activation goes with the layer that takes its output; the last, whose output is the
    # model's, with the last layer.
    assert units.placed() == {"0": "1", "2": "3", "4": "3"}
    first = strip_to_stage(copy.deepcopy(model), units.owned([0]), units.companions)
    last = strip_to_stage(copy.deepcopy(model), units.owned([1]), units.companions)
    assert [type(m).__name__ for m in first] == ["Tanh", "Linear"] + ["PassThrough"] * 3
    assert [type(m).__name__ for m in last] == ["PassThrough"] * 2 + ["GELU", "Linear", "Tanh"]
    with torch.no_grad():
        torch.testing.assert_close(last(first(x)), model(x), rtol=0, atol=0)
    check_stages_compose(model, units, [[0], [1]], (x,))


def test_the_digits_plan_places_its_relu_and_leaves_its_statistics() -> None:
    from site_agent.jobs.digits import make_job as make_digits

    ctx = JobContext(site_id="t", seed=3, device=torch.device("cpu"), options={"batch_size": 32})
    job = make_digits(ctx)
    before = copy.deepcopy(job.model.state_dict())
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1)
    plan = make_stage_plan(job, next(iter(job.batches())), cfg)
    # nn.Sequential(Linear, BatchNorm1d, ReLU, Linear): the ReLU runs with the last Linear.
    assert plan.units.names == ("0", "1", "3")
    assert plan.units.placed() == {"2": "3"}
    for name, value in job.model.state_dict().items():  # BatchNorm's statistics included
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


class _FinalNorm(nn.Module):
    """Blocks in a ModuleList, then a norm without parameters and a head (as OLMo's
    ``model.norm``), and a side module whose output every block takes beside its input."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Identity()  # a side input, as a rotary embedding is
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.norm = nn.LayerNorm(8, elementwise_affine=False)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.scale(torch.ones(()))
        for block in self.blocks:
            x = block(x) * side
        return self.head(self.norm(x))


def test_a_norm_without_parameters_goes_with_the_head() -> None:
    model = _FinalNorm()
    x = torch.randn(4, 8)
    units = chain_companions(model, units_of(model), (x,))
    assert units.names == ("blocks.0", "blocks.1", "blocks.2", "head")
    assert units.placed() == {"norm": "head"}  # the side module stays on every stage
    stages = [[0, 1], [2, 3]]
    check_stages_compose(model, units, stages, (x,))
    without = dataclasses.replace(units, companions={})  # the norm on every stage
    with pytest.raises(ValueError, match=r"modules without tensors on every stage: \['norm'"):
        check_stages_compose(model, without, stages, (x,))


def test_an_olmo_norm_without_parameters_runs_on_the_heads_stage() -> None:
    from site_agent.jobs.hf import make_job as make_hf

    options = {**HF_OPTIONS, "model_type": "olmo"}
    options["config"] = {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128}
    options["config"] |= {"num_attention_heads": 4, "vocab_size": 256, "pad_token_id": 0}
    ctx = JobContext(site_id="t", seed=3, device=torch.device("cpu"), options=options)
    model = make_hf(ctx).model.eval()
    x = torch.randint(0, 256, (2, 16))
    units = chain_companions(model, units_of(model), (x,))
    # OLMo's final LayerNorm has no parameters: the head takes a slice of its output.
    assert units.names[-2:] == ("model.layers.2", "lm_head")
    assert units.placed() == {"model.norm": "lm_head"}  # its rotary embedding: every stage
    check_stages_compose(model, units, [[0, 1, 2], [3, 4]], (x,))


class _Positions(nn.Module):
    """A position embedding fed position ids, not the activation (as GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.wpe = nn.Embedding(5, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.wpe(torch.arange(x.shape[1])).unsqueeze(0)
        for block in self.blocks:
            x = block(x)
        return x


def test_a_cut_whose_later_stage_fails_is_refused_by_name() -> None:
    model = _Positions()
    x = torch.randn(2, 5, 8)
    units = chain_companions(model, units_of(model), (x,))
    assert units.names == ("<prefix>", "blocks.0", "blocks.1")
    with pytest.raises(
        ValueError, match="stage 1 of this cut fails on the tensor the stage before"
    ):
        check_stages_compose(model, units, [[0, 1], [2]], (x,))


def test_the_plan_refuses_floating_point_inputs_beyond_the_first() -> None:
    job = make_job("masked")
    (x, keep), y = next(iter(job.batches()))
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1)
    with pytest.raises(ValueError, match="the model's input 1 .after split. is floating point"):
        make_stage_plan(job, ((x, keep.float()), y), cfg)


def test_one_in_place_module_at_two_places_is_refused() -> None:
    relu = nn.ReLU(inplace=True)  # the same module after both Linears: on every stage
    model = nn.Sequential(nn.Linear(8, 8), relu, nn.Linear(8, 8), relu, nn.Linear(8, 8))
    x = torch.randn(4, 8)
    units = chain_companions(model, units_of(model), (x,))
    assert units.placed() == {}
    with pytest.raises(ValueError, match="stage 1 of this cut fails in its backward"):
        check_stages_compose(model, units, [[0, 1], [2]], (x,))


def test_the_longest_list_without_tensors_is_no_cut() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.GELU(), nn.Dropout(), nn.Identity(), nn.Tanh()),
        nn.Linear(4, 4),
        nn.Linear(4, 4),
    )
    assert units_of(model).names == ("1", "2")


class _SharedActivation(nn.Module):
    """Blocks in a ModuleList with one activation module the forward applies after each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.act(block(x))
        return x


def test_the_plan_checks_the_cut_in_training_mode() -> None:
    class Job:
        model = _SharedActivation()
        split = staticmethod(lambda batch: batch)
        output_loss = staticmethod(lambda out, y: ((out - y) ** 2).mean())

    Job.model.act = nn.Dropout(0.5)  # the same at every block: equal to one process in eval only
    Job.model.eval()
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1)
    with pytest.raises(ValueError, match=r"modules without tensors on every stage: \['act'\]"):
        make_stage_plan(Job(), (torch.randn(8, 8), torch.randn(8, 8)), cfg)
    assert not Job.model.training  # its mode put back


def test_a_cut_whose_stages_do_not_compose_is_refused() -> None:
    class Job:
        model = _SharedActivation()
        split = staticmethod(lambda batch: batch)
        output_loss = staticmethod(lambda out, y: ((out - y) ** 2).mean())

    batch = (torch.randn(8, 8), torch.randn(8, 8))
    before = copy.deepcopy(Job.model.state_dict())
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1)
    # Every stage would apply ``act`` to what it receives: the plan is refused, naming it.
    with pytest.raises(ValueError, match=r"modules without tensors on every stage: \['act'\]"):
        make_stage_plan(Job(), batch, cfg)
    for name, value in Job.model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_a_module_split_between_stages_is_refused() -> None:
    model = make_job("bytegpt").model
    owned = set(model.state_dict()) - {"layers.1.ln_attn.bias"}  # a LayerNorm's weight alone
    with pytest.raises(ValueError, match="split between stages"):
        strip_to_stage(model, owned)


@pytest.mark.parametrize("kind", ["bytegpt", "hf"])
def test_output_loss_agrees_with_loss(kind: str) -> None:
    job = make_job(kind)
    batch = next(iter(job.batches()))
    assert check_pipeline_job(job, batch) > 0


def test_a_job_without_split_cannot_be_pipelined() -> None:
    job = make_job("bytegpt")

    class NoSplit:
        model, optimizer = job.model, job.optimizer
        loss, evaluate, batches = job.loss, job.evaluate, job.batches

    with pytest.raises(JobError, match="no 'split'"):
        check_pipeline_job(NoSplit(), next(iter(job.batches())))  # type: ignore[arg-type]

    class Disagrees(NoSplit):
        split = job.split

        def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return job.output_loss(output, target) * 2

    with pytest.raises(JobError, match="differs from"):
        check_pipeline_job(Disagrees(), next(iter(job.batches())))  # type: ignore[arg-type]


def test_profile_units_times_every_unit() -> None:
    job = make_job("hf")
    units = units_of(job.model)
    x, y = next(iter(job.batches()))
    before = copy.deepcopy(job.model.state_dict())
    costs, sizes = profile_units(
        job.model, units, lambda: job.output_loss(job.model(x).logits, y), steps=1
    )
    assert len(costs) == len(sizes) == len(units)
    assert all(c > 0 for c in costs)
    assert sizes[:-1] == [8 * 16 * 64 * 4] * 4  # hidden states out of every unit but the last
    assert sizes[-1] == 8 * 16 * 256 * 4  # the logits
    assert all(p.grad is None for p in job.model.parameters())
    for name, value in job.model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_stage_indices() -> None:
    assert stage_indices("1f1b", 1, 2) == [1]
    assert stage_indices("interleaved_1f1b", 1, 2) == [1, 3]
    assert stage_indices("zbv", 0, 2) == [0, 3]
    assert stage_indices("zbv", 1, 2) == [1, 2]
    with pytest.raises(ValueError, match="schedule must be one of"):
        stages_per_rank("pipedream")


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
        trainer.load_parameters({k: v * 0 for k, v in params_again.items()})
        zeros = trainer.parameters_numpy()
        return {
            "losses": [first.loss_mean, after_three.loss_mean, again.loss_mean],
            "params": params_three,
            "params_again": params_again,
            "loss_legacy": legacy.loss_mean,
            "params_legacy": params_legacy,
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
