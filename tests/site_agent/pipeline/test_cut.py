"""Cutting any job's model into pipeline stages, in one process: the candidate units, where each
stage's section of the forward begins, stand-ins for other stages' modules, the stages composing
to the whole model (or the cut refused by name), the job contract's pipeline members and the
per-unit profile. Trained by torch's schedules: ``test_pipeline_torch.py``.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from site_agent.jobs.contract import JobContext, JobError, check_pipeline_job
from site_agent.pipeline.chain import Cut, check_stages_compose, cut_stage, stage_entries
from site_agent.pipeline.cut import PassThrough, Units, strip_to_stage, units_of
from site_agent.pipeline.engine import PipelineConfig, make_stage_plan
from site_agent.pipeline.layout import stage_indices, stages_per_rank
from site_agent.pipeline.profile import profile_units
from tests.site_agent.pipeline.test_torch import HF_OPTIONS, TorchTransformer, make_job

pytestmark = pytest.mark.timeout(120)


def cut_of(
    model: nn.Module, stages: list[list[int]], *inputs: torch.Tensor, points: Any = None
) -> Cut:
    """``model``'s units (at ``points``, or the default) cut into ``stages``, entries traced on
    ``inputs``."""
    return Cut.traced(model, units_of(model, points), stages, inputs)


def run_stages(model: nn.Module, cut: Cut, *inputs: torch.Tensor) -> torch.Tensor:
    """The stages of ``cut`` (on copies) one after the other, without gradients."""
    out: Any = inputs
    with torch.no_grad():
        for k in range(len(cut.stages)):
            out = cut_stage(copy.deepcopy(model), cut, k)(*out)
            out = out if isinstance(out, tuple) else (out,)
    return out[0]  # type: ignore[no-any-return]


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
    x = torch.randint(0, 256, (2, 16))
    cut = cut_of(model, [[0, 1], [2, 3], list(range(4, len(units_of(model))))], x)
    assert cut.hand_first  # token ids travel with the activations
    with torch.no_grad():
        whole = model(x)
    whole = whole if isinstance(whole, torch.Tensor) else whole.logits
    torch.testing.assert_close(run_stages(model, cut, x), whole, rtol=0, atol=0)
    # Each stage holds exactly its units' tensors, under the whole model's names.
    for k, stage_units in enumerate(cut.stages):
        stage = cut_stage(copy.deepcopy(model), cut, k)
        assert set(stage.model.state_dict()) == cut.units.owned(stage_units)
        assert any(isinstance(m, PassThrough) for m in stage.modules())


def test_a_sequential_is_cut_at_its_layers_and_runs_each_module_once() -> None:
    model = nn.Sequential(nn.Tanh(), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4), nn.Tanh())
    x = torch.randn(5, 8)
    cut = cut_of(model, [[0], [1]], x)
    assert cut.units.names == ("1", "3")  # no ModuleList: the Sequential's entries with tensors
    # Stage 1 begins at its Linear: the GELU between the two runs on stage 0, before it leaves.
    assert cut.entries == (None, "3") and not cut.hand_first
    torch.testing.assert_close(run_stages(model, cut, x), model(x), rtol=0, atol=0)
    check_stages_compose(model, cut, (x,))


def test_the_digits_plan_leaves_its_statistics() -> None:
    from site_agent.jobs.digits import make_job as make_digits

    ctx = JobContext(site_id="t", seed=3, device=torch.device("cpu"), options={"batch_size": 32})
    job = make_digits(ctx)
    before = copy.deepcopy(job.model.state_dict())
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1)
    plan = make_stage_plan(job, next(iter(job.batches())), cfg)
    # nn.Sequential(Linear, BatchNorm1d, ReLU, Linear): stage 1 begins at a unit's module.
    assert plan.cut.units.names == ("0", "1", "3")
    assert plan.cut.entries[1] in ("1", "3")
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


def test_a_norm_without_parameters_runs_once_before_the_head() -> None:
    model = _FinalNorm()
    x = torch.randn(4, 8)
    cut = cut_of(model, [[0, 1, 2], [3]], x)
    assert cut.units.names == ("blocks.0", "blocks.1", "blocks.2", "head")
    assert cut.entries == (None, "head")  # the norm runs on stage 0; the side module on both
    torch.testing.assert_close(run_stages(model, cut, x), model(x), rtol=0, atol=0)
    check_stages_compose(model, cut, (x,))


def test_an_olmo_norm_without_parameters_runs_once() -> None:
    from site_agent.jobs.hf import make_job as make_hf

    options = {**HF_OPTIONS, "model_type": "olmo"}
    options["config"] = {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128}
    options["config"] |= {"num_attention_heads": 4, "vocab_size": 256, "pad_token_id": 0}
    ctx = JobContext(site_id="t", seed=3, device=torch.device("cpu"), options=options)
    model = make_hf(ctx).model.eval()
    x = torch.randint(0, 256, (2, 16))
    # OLMo's final LayerNorm has no parameters: the head takes a slice of its output.
    cut = cut_of(model, [[0, 1, 2, 3], [4]], x)
    assert cut.units.names[-2:] == ("model.layers.2", "lm_head")
    assert cut.entries == (None, "lm_head")
    check_stages_compose(model, cut, (x,))


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


def test_a_module_fed_position_ids_returns_zeros_shaped_as_its_output() -> None:
    model = _Positions()
    x = torch.randn(2, 5, 8)
    cut = cut_of(model, [[0, 1], [2]], x)
    assert cut.units.names == ("<prefix>", "blocks.0", "blocks.1")
    # On stage 1, wpe (stage 0's) returns zeros [5, 8], not the position ids it is given.
    check_stages_compose(model, cut, (x,))


class _Validates(nn.Module):
    """Code between modules that refuses what a stand-in returns."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(1, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.unsqueeze(-1))
        if h.dim() != 3:
            raise ValueError(f"expected [batch, time, features], got {list(h.shape)}")
        for block in self.blocks:
            h = block(h)
        return h


def test_a_cut_whose_later_stage_fails_is_refused_by_name() -> None:
    model = _Validates()
    x = torch.randn(2, 5)
    cut = cut_of(model, [[0, 1], [2]], x)
    with pytest.raises(ValueError, match=r"stage 1 of this cut fails .*expected \[batch"):
        check_stages_compose(model, cut, (x,))


def test_the_plan_refuses_floating_point_inputs_beyond_the_first() -> None:
    job = make_job("masked")
    (x, keep), y = next(iter(job.batches()))
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1)
    with pytest.raises(ValueError, match="the model's input 1 .after split. is floating point"):
        make_stage_plan(job, ((x, keep.float()), y), cfg)


def test_one_in_place_module_at_two_places_runs_once_on_each_stage() -> None:
    relu = nn.ReLU(inplace=True)  # the same module after both Linears: on every stage
    model = nn.Sequential(nn.Linear(8, 8), relu, nn.Linear(8, 8), relu, nn.Linear(8, 8))
    x = torch.randn(4, 8)
    cut = cut_of(model, [[0, 1], [2]], x)
    assert cut.entries == (None, "4")
    check_stages_compose(model, cut, (x,))  # forward and backward, as training runs them


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


def test_a_shared_dropout_draws_as_in_one_process_and_the_mode_is_put_back() -> None:
    class Job:
        model = _SharedActivation()
        split = staticmethod(lambda batch: batch)
        output_loss = staticmethod(lambda out, y: ((out - y) ** 2).mean())

    # The same Dropout after every block: the check runs in training mode, and each stage's
    # section draws from the RNG state the stage began with, whatever ran before its entry.
    Job.model.act = nn.Dropout(0.5)
    Job.model.eval()
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1)
    plan = make_stage_plan(Job(), (torch.randn(8, 8), torch.randn(8, 8)), cfg)
    assert plan.cut.entries[1] is not None
    assert not Job.model.training  # its mode put back


class _SideFromBlock(nn.Module):
    """The first block's output is added by every later block: a value another stage's module
    computes beside the activation."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = side = self.blocks[0](x)
        for block in self.blocks[1:]:
            x = block(x) + side
        return x


def test_a_cut_whose_stages_do_not_compose_is_refused() -> None:
    class Job:
        model = _SideFromBlock()
        split = staticmethod(lambda batch: batch)
        output_loss = staticmethod(lambda out, y: ((out - y) ** 2).mean())

    batch = (torch.randn(8, 8), torch.randn(8, 8))
    before = copy.deepcopy(Job.model.state_dict())
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1)
    with pytest.raises(ValueError, match="do not compute the model's output"):
        make_stage_plan(Job(), batch, cfg)
    for name, value in Job.model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_a_module_split_between_stages_is_refused() -> None:
    model = make_job("bytegpt").model
    bias = "layers.1.ln_attn.bias"  # a LayerNorm's bias in another unit than its weight
    rest = tuple(n for n in model.state_dict() if n != bias)
    units = Units(names=("rest", "bias"), tensors=(rest, (bias,)))
    with pytest.raises(ValueError, match="split between stages"):
        strip_to_stage(model, units, [0])


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

    class TooManyInputs(NoSplit):  # the model takes one input; split gives two
        output_loss = job.output_loss

        def split(self, batch: Any) -> Any:
            inputs, target = job.split(batch)
            return (inputs, inputs), target

    with pytest.raises(JobError, match=r"split\(batch\), fails: TypeError: .*positional"):
        check_pipeline_job(TooManyInputs(), next(iter(job.batches())))  # type: ignore[arg-type]


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


def test_a_stand_in_returns_zeros_shaped_as_the_output_and_reads_its_attributes() -> None:
    gru = nn.GRU(4, 6, batch_first=True)
    stand_in = PassThrough(gru)
    assert dict(stand_in.state_dict()) == {} and not list(stand_in.parameters())
    assert stand_in.hidden_size == 6 and stand_in.weight_ih_l0.is_meta  # read from the module
    out, h = stand_in(torch.randn(3, 5, 4))  # a tuple, as the GRU's
    assert out.shape == (3, 5, 6) and h.shape == (1, 3, 6)
    assert not out.any() and out.device.type == "cpu"

    # A module that cannot run on the meta device hands on its first input.
    class NoMeta(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * float(x.sum())

    x = torch.randn(2, 4)
    assert PassThrough(NoMeta(4, 3))(x) is x
    assert PassThrough()(x) is x


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, 30)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(ids))[0])  # the GRU's output is a tuple


class _Blocks(nn.Module):
    """Blocks in an nn.ModuleDict (as torchtitan's models hold them), the residual in the
    model's own loop."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleDict(
            {str(i): nn.Sequential(nn.Linear(16, 16), nn.GELU()) for i in range(4)}
        )
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers.values():
            h = h + layer(h)
        return self.out(h)


@pytest.mark.parametrize(
    ("model", "stages", "x"),
    [
        (_Recurrent(), [[0, 1], [2]], torch.randint(0, 30, (3, 7))),  # cut at rnn and head
        (TorchTransformer(), [[0, 1, 2], [3, 4, 5]], torch.randint(0, 30, (3, 7))),
        (TorchTransformer(), [[0, 1], [2, 3], [4], [5]], torch.randint(0, 30, (3, 7))),
    ],
    ids=["gru-tuple", "torch-transformer", "torch-transformer-4"],
)
def test_models_not_written_for_pipelines_compose(
    model: nn.Module, stages: list[list[int]], x: torch.Tensor
) -> None:
    torch.manual_seed(0)
    points = ["rnn", "head"] if isinstance(model, _Recurrent) else None
    cut = cut_of(model.train(), stages, x, points=points)
    with torch.no_grad():
        whole = model(x)
    torch.testing.assert_close(run_stages(model, cut, x), whole)
    check_stages_compose(model, cut, (x,))


def test_a_residual_in_the_models_own_loop_is_refused_by_its_gradient() -> None:
    model = _Blocks()
    x = torch.randn(3, 8)
    cut = cut_of(model, [[0, 1, 2], [3, 4, 5]], x)
    # The output matches (the stand-ins hand the activation through), its gradient does not: the
    # residual's own use of the activation on stage 1 is not the one stage 0 sent.
    torch.testing.assert_close(run_stages(model, cut, x), model(x))
    with pytest.raises(ValueError, match="gradient of 'inp.bias'.*residual h . layer.h. in the"):
        check_stages_compose(model, cut, (x,))


def test_the_default_cut_takes_a_module_dict_of_blocks() -> None:
    assert units_of(_Blocks()).names == (
        "<prefix>",
        "layers.0",
        "layers.1",
        "layers.2",
        "layers.3",
        "out",
    )


class _NormFirst(nn.Module):
    """A final norm registered before the blocks it follows (as OPT's decoder does)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def test_modules_called_out_of_state_dict_order_are_refused_by_name() -> None:
    model = _NormFirst()
    units = units_of(model)
    assert units.names == ("<prefix>", "blocks.0", "blocks.1", "blocks.2")
    with pytest.raises(ValueError, match="module 'norm' runs after 'blocks.1', which begins"):
        stage_entries(model, units, [[0, 1], [2, 3]], (torch.randn(2, 8),))


def test_a_stage_hands_on_contiguous_tensors() -> None:
    model = TorchTransformer().eval()
    ids = torch.randint(0, 30, (3, 8))[:, :-1]  # a slice of a batch, as a job's split gives
    assert not ids.is_contiguous()
    cut = cut_of(model, [[0, 1, 2], [3, 4, 5]], ids)
    with torch.no_grad():
        out, handed = cut_stage(copy.deepcopy(model), cut, 0)(ids)
    assert out.is_contiguous() and handed.is_contiguous()  # gloo and NCCL send only these
    torch.testing.assert_close(handed, ids, rtol=0, atol=0)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class _Checkpointed(nn.Module):
    """Activation checkpointing around each block's call: the recompute calls the block again
    in the backward, with what the forward gave it."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList([_Residual() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_around_a_stages_first_module_is_refused(reentrant: bool) -> None:
    model = _Checkpointed(reentrant)
    x = torch.randn(4, 8, requires_grad=reentrant)  # the reentrant form needs an input to grad
    cut = cut_of(model, [[0, 1], [2, 3]], x)
    # Non-reentrant: the recompute calls the entry again; reentrant: no gradient reaches it.
    refusal = "'blocks.2' runs again in the backward|stage 1 of this cut sends no gradient back"
    with pytest.raises(ValueError, match=refusal):
        check_stages_compose(model, cut, (x,))


class _RootPosition(nn.Module):
    """A parameter held by the model itself (as a ViT's position embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(5, 8))
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos
        for block in self.blocks:
            x = block(x)
        return x


def test_a_parameter_on_the_model_itself_stays_with_its_unit() -> None:
    model = _RootPosition()
    x = torch.randn(2, 5, 8)
    cut = cut_of(model, [[0, 1], [2, 3]], x)
    assert cut.units.tensors[0] == ("pos",)
    check_stages_compose(model, cut, (x,))
    stage = cut_stage(copy.deepcopy(model), cut, 1)
    assert set(stage.model.state_dict()) == cut.units.owned([2, 3])  # zeros stand in for pos
    assert "pos" not in dict(stage.model.named_parameters())


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freq", torch.arange(8.0) / 8, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.freq.cos()


class _Scaled(nn.Module):
    def __init__(self, scale: nn.Module) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(8, 8), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.lin(x))


def test_a_module_shared_by_every_block_is_left_where_the_stage_holds_it() -> None:
    shared = _Scale()  # no state_dict tensors: in every block, on every stage
    model = nn.Sequential(*[_Scaled(shared) for _ in range(4)])
    x = torch.randn(4, 8)
    cut = cut_of(model, [[0, 1], [2, 3]], x)
    check_stages_compose(model, cut, (x,))
    stage = cut_stage(copy.deepcopy(model), cut, 1)
    assert stage.model[3].scale.freq.device.type == "cpu"  # not moved with a stand-in


def test_a_tie_within_one_stage_is_kept() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    model[3].weight = model[2].weight
    x = torch.randn(4, 8)
    cut = cut_of(model, [[0, 1], [2, 3]], x)
    check_stages_compose(model, cut, (x,))
    with pytest.raises(ValueError, match="tied under the names"):
        strip_to_stage(copy.deepcopy(model), cut.units, [0, 1, 2])


def test_a_stand_in_tells_calls_apart_by_keyword_and_takes_no_tensor_calls() -> None:
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 5)

        def forward(self, x: torch.Tensor, **flags: torch.Tensor) -> torch.Tensor:
            return self.a(x) if "task_a" in flags else self.b(x)

    stand_in, x, flag = PassThrough(Heads()), torch.randn(2, 4), torch.ones(1)
    assert stand_in(x, task_a=flag).shape == (2, 3)
    assert stand_in(x, task_b=flag).shape == (2, 5)

    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rows = nn.Parameter(torch.randn(5, 3))

        def forward(self, n: int) -> torch.Tensor:
            return self.rows[:n]

    assert PassThrough(Table())(4) == 4  # no tensor to place zeros by: its first input


def test_a_stage_is_freed_without_the_garbage_collector() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    cut = cut_of(model, [[0], [1]], torch.randn(2, 8))
    stage = cut_stage(copy.deepcopy(model), cut, 1)
    weight = weakref.ref(stage.model[1].weight)
    gc.disable()
    try:
        del stage  # its hooks hold no reference back to it
        assert weight() is None
    finally:
        gc.enable()


def test_a_head_tied_to_the_embedding_is_refused_by_name() -> None:
    from site_agent.jobs.hf import make_job as make_hf

    options = {**HF_OPTIONS, "config": {"num_hidden_layers": 3, "tie_word_embeddings": True}}
    job = make_hf(JobContext(site_id="t", seed=3, device=torch.device("cpu"), options=options))
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1)
    tied = r"tied under the names \['model.embed_tokens.weight', 'lm_head.weight'\]"
    with pytest.raises(ValueError, match=tied + ".*tie_word_embeddings = false"):
        make_stage_plan(job, next(iter(job.batches())), cfg)


def test_a_torch_too_old_to_hand_on_integer_inputs_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.torch_version import TorchVersion

    job = make_job("bytegpt")
    cfg = PipelineConfig(num_stages=2, num_microbatches=2, profile_steps=1)
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.12.0"))
    with pytest.raises(ValueError, match=r"needs torch >= 2\.13, this is torch 2\.12\.0"):
        make_stage_plan(job, next(iter(job.batches())), cfg)
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.13.0+cu130"))
    assert make_stage_plan(job, next(iter(job.batches())), cfg).partition.num_stages == 2
