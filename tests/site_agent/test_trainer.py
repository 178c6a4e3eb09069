"""The inner loop: learning, parameter exchange, and checkpoint resume."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from crossdc.bench.local_trainer import LocalTrainer
from site_agent.jobs.bytegpt.data import BatchSampler, ByteCorpus, eval_batches
from site_agent.jobs.bytegpt.model import ModelConfig, build_model
from site_agent.jobs.bytegpt.optim import InnerOptimConfig, learning_rate
from site_agent.trainer import TrainStats

torch.set_num_threads(1)

TINY = ModelConfig(context_len=32, num_layers=2, d_model=64, num_heads=4)
OPTIM = InnerOptimConfig(batch_size=8, warmup_steps=5)


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.from_stdlib_modules(["textwrap", "argparse"], max_bytes=64_000)


def _trainer(corpus: ByteCorpus, *, model_seed: int = 0, data_seed: int = 0) -> LocalTrainer:
    sampler = BatchSampler(
        corpus, batch_size=OPTIM.batch_size, context_len=TINY.context_len, seed=data_seed
    )
    return LocalTrainer(model=build_model(TINY, seed=model_seed), sampler=sampler, optim_cfg=OPTIM)


def _params_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return list(a) == list(b) and all(np.array_equal(a[name], b[name]) for name in a)


def test_loss_decreases_on_stdlib_text(corpus: ByteCorpus) -> None:
    trainer = _trainer(corpus)
    batches = eval_batches(corpus, num_batches=2, batch_size=8, context_len=TINY.context_len)
    before = trainer.evaluate(batches)
    assert before == pytest.approx(np.log(256), abs=0.2)
    stats = trainer.train_steps(30)
    after = trainer.evaluate(batches)
    assert after < before - 1.0
    assert isinstance(stats, TrainStats)
    assert stats.steps == 30
    assert stats.tokens == 30 * 8 * TINY.context_len
    assert stats.loss_last < stats.loss_mean < before
    assert stats.compute_seconds > 0
    assert trainer.step == 30


def test_evaluate_is_pure(corpus: ByteCorpus) -> None:
    trainer = _trainer(corpus)
    batches = eval_batches(corpus, num_batches=1, batch_size=2, context_len=TINY.context_len)
    params = trainer.parameters_numpy()
    assert trainer.evaluate(batches) == trainer.evaluate(batches)
    assert _params_equal(params, trainer.parameters_numpy())
    assert trainer.model.training
    with pytest.raises(ValueError, match="at least one batch"):
        trainer.evaluate([])


def test_learning_rate_warms_up_linearly_then_holds() -> None:
    cfg = InnerOptimConfig(lr=1.0, warmup_steps=4)
    assert [learning_rate(cfg, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert learning_rate(InnerOptimConfig(lr=0.5, warmup_steps=0), 0) == 0.5


def test_parameters_numpy_are_float32_copies_in_state_dict_order(corpus: ByteCorpus) -> None:
    trainer = _trainer(corpus)
    params = trainer.parameters_numpy()
    assert list(params) == list(trainer.model.state_dict())
    assert all(a.dtype == np.float32 for a in params.values())
    params["layers.0.token.weight"][:] = 0.0
    assert trainer.model.state_dict()["layers.0.token.weight"].abs().sum() > 0


def test_load_parameters_copies_in_place_and_keeps_optimizer(corpus: ByteCorpus) -> None:
    trainer = _trainer(corpus, model_seed=0)
    trainer.train_steps(2)
    moments_before = {
        k: v["exp_avg"].clone() for k, v in trainer.optimizer.state_dict()["state"].items()
    }
    param_ids = [id(p) for p in trainer.model.parameters()]
    incoming = _trainer(corpus, model_seed=1).parameters_numpy()
    for array in incoming.values():
        array.setflags(write=False)  # decoded wire payloads are read-only
    trainer.load_parameters(incoming)
    assert _params_equal(trainer.parameters_numpy(), incoming)
    assert [id(p) for p in trainer.model.parameters()] == param_ids
    moments_after = trainer.optimizer.state_dict()["state"]
    assert all(torch.equal(moments_before[k], moments_after[k]["exp_avg"]) for k in moments_before)
    assert trainer.step == 2


def test_load_parameters_errors_name_the_parameter(corpus: ByteCorpus) -> None:
    trainer = _trainer(corpus)
    original = trainer.parameters_numpy()

    missing = dict(original)
    del missing["layers.1.qkv.bias"]
    with pytest.raises(ValueError, match=r"'layers.1.qkv.bias' is missing"):
        trainer.load_parameters(missing)

    extra = {**original, "layers.9.bogus": np.zeros(3, dtype=np.float32)}
    with pytest.raises(ValueError, match=r"unexpected parameter 'layers.9.bogus'"):
        trainer.load_parameters(extra)

    wrong_shape = {name: np.zeros_like(a) for name, a in original.items()}
    wrong_shape["layers.3.proj.weight"] = np.zeros((3, 3), dtype=np.float32)
    with pytest.raises(ValueError, match=r"'layers.3.proj.weight' has shape \(3, 3\)"):
        trainer.load_parameters(wrong_shape)
    # Nothing was copied by the rejected call.
    assert _params_equal(trainer.parameters_numpy(), original)


def test_state_dict_round_trip_continues_bit_identically(corpus: ByteCorpus) -> None:
    trainer = _trainer(corpus, model_seed=0, data_seed=3)
    trainer.train_steps(3)
    buffer = io.BytesIO()
    torch.save(trainer.state_dict(), buffer)
    trainer.train_steps(4)
    expected = trainer.parameters_numpy()

    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    json.dumps(state["job"]["sampler"])  # the sampler's part is plain JSON
    restarted = _trainer(corpus, model_seed=5, data_seed=11)
    restarted.load_state_dict(state)
    assert restarted.step == 3
    restarted.train_steps(4)
    assert _params_equal(restarted.parameters_numpy(), expected)


def test_state_dict_is_a_snapshot(corpus: ByteCorpus) -> None:
    trainer = _trainer(corpus)
    trainer.train_steps(1)
    state = trainer.state_dict()
    before = state["model"]["layers.0.token.weight"].clone()
    trainer.train_steps(1)
    assert torch.equal(state["model"]["layers.0.token.weight"], before)


def test_batch_size_must_agree(corpus: ByteCorpus) -> None:
    sampler = BatchSampler(corpus, batch_size=4, context_len=TINY.context_len, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        LocalTrainer(model=build_model(TINY, seed=0), sampler=sampler, optim_cfg=OPTIM)


def test_train_steps_rejects_non_positive(corpus: ByteCorpus) -> None:
    with pytest.raises(ValueError, match="num_steps"):
        _trainer(corpus).train_steps(0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": 0.0}, "inner_optim.lr"),
        ({"weight_decay": -0.1}, "inner_optim.weight_decay"),
        ({"beta1": 1.0}, "inner_optim.beta1"),
        ({"beta2": -0.5}, "inner_optim.beta2"),
        ({"warmup_steps": -1}, "inner_optim.warmup_steps"),
        ({"batch_size": 0}, "inner_optim.batch_size"),
    ],
)
def test_optim_config_validation_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        InnerOptimConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trains_and_resumes_on_cuda(corpus: ByteCorpus) -> None:
    sampler = BatchSampler(corpus, batch_size=8, context_len=TINY.context_len, seed=0)
    model = build_model(TINY, seed=0, device="cuda")
    cpu_init = build_model(TINY, seed=0).state_dict()
    assert all(torch.equal(t.cpu(), cpu_init[n]) for n, t in model.state_dict().items())
    trainer = LocalTrainer(model=model, sampler=sampler, optim_cfg=OPTIM, device="cuda")
    batches = eval_batches(corpus, num_batches=2, batch_size=8, context_len=TINY.context_len)
    before = trainer.evaluate(batches)
    trainer.train_steps(30)
    assert trainer.evaluate(batches) < before - 1.0
    state = trainer.state_dict()
    assert state["model"]["layers.0.token.weight"].device.type == "cpu"
    params = trainer.parameters_numpy()
    trainer.load_parameters(params)
    assert _params_equal(trainer.parameters_numpy(), params)
    trainer.load_state_dict(state)
    trainer.train_steps(1)
