"""The job contract as a user meets it: a job module written outside the package, federated by
real ``crossdc agent`` processes from TOML; every bad input refused before anything connects."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from comm.ops.configio import ConfigError, build, dump_toml
from comm.security.rolekits import SecurityConfig
from site_agent.config import JobConfig, SiteConfig, site_config_from_table
from site_agent.jobs.bytegpt.model import ModelConfig, model_fingerprint
from site_agent.jobs.contract import (
    BYTEGPT_FACTORY,
    JobContext,
    JobError,
    build_job,
    federated_state,
    job_fingerprint,
    state_spec,
)
from site_agent.launch import build_agent, build_job_trainer
from site_agent.trainer import JobTrainer, NonFiniteLossError
from tests.conftest import ROOT, Procs, read_status, wait_for, write_coordinator_config

pytestmark = pytest.mark.timeout(240)

# A user's job: least squares on synthetic data, each site's inputs drawn around its own centre
# (non-IID), one fixed validation set common to all. Options: ``centre`` and ``hidden``.
USER_JOB = '''
"""A user's regression job, outside crossdc."""
import torch
from torch import nn

from site_agent.jobs.contract import CheckedOptions, checks_options

W_TRUE = torch.linspace(-1.0, 1.0, 8)


def _data(seed, centre, n):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g) + centre
    y = x @ W_TRUE + 0.1 * torch.randn(n, generator=g)
    return x, y


class RegressionJob:
    def __init__(self, ctx):
        unknown = set(ctx.options) - {"centre", "hidden", "bad", "unseeded"}
        if unknown:
            raise ValueError(f"unknown option {sorted(unknown)[0]!r}")
        hidden = int(ctx.options.get("hidden", 16))
        with torch.random.fork_rng():
            torch.manual_seed(ctx.seed + (1 if ctx.options.get("unseeded") else 0))
            self.model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.x, self.y = _data(100 + int(ctx.options.get("centre", 0) * 10), ctx.options.get("centre", 0.0), 512)
        self.vx, self.vy = _data(7, 0.0, 256)
        self.bad = ctx.options.get("bad", "")

    def batches(self):
        for i in range(0, 512, 32):
            yield self.x[i : i + 32], self.y[i : i + 32]

    def loss(self, model, batch):
        x, y = batch
        out = model(x).squeeze(-1)
        if self.bad == "vector":
            return (out - y) ** 2
        self.calls = getattr(self, "calls", 0) + 1
        if self.bad == "nan_after_5" and self.calls > 6:  # the preflight's call, then 5 steps
            return ((out - y) ** 2).mean() * float("nan")
        return ((out - y) ** 2).mean()

    def evaluate(self, model):
        loss = float(((model(self.vx).squeeze(-1) - self.vy) ** 2).mean())
        return {"mse": loss} if self.bad == "noloss" else {"loss": loss, "rmse": loss ** 0.5}


def make_job(ctx):
    return RegressionJob(ctx)


def no_optimizer(ctx):
    job = RegressionJob(ctx)
    del job.optimizer
    return job


NOT_CALLABLE = 3


def _check(options, where):
    """The regression job's options, checked before it is made: a model of three layers."""
    if int(options.get("hidden", 16)) < 1:
        raise ValueError(f"{where}.hidden must be >= 1")
    return CheckedOptions(layers=3)


@checks_options(_check)
def checked(ctx):
    return RegressionJob(ctx)
'''


@pytest.fixture
def user_jobs(tmp_path: Path) -> Path:
    directory = tmp_path / "userjobs"
    directory.mkdir()
    (directory / "regression_job.py").write_text(textwrap.dedent(USER_JOB))
    return directory


def _site(
    tmp_path: Path, jobs: Path, site_id: str, coordinator: str = "", **job: Any
) -> dict[str, Any]:
    return {
        **({"coordinator": coordinator} if coordinator else {}),
        "site_id": site_id,
        "coordinator_endpoint_file": str(tmp_path / "coordinator" / "endpoint.json"),
        "state_dir": str(tmp_path / f"site-{site_id}"),
        "num_threads": 1,
        "device": "cpu",
        "security": {"insecure": True},
        "job": {
            "factory": "regression_job:make_job",
            "python_path": [str(jobs)],
            **job,
        },
    }


def _write(tmp_path: Path, table: dict[str, Any]) -> Path:
    path = tmp_path / f"site-{table['site_id']}.toml"
    path.write_text(dump_toml({"site": table}))
    return path


def test_a_job_outside_the_package_federates_across_three_agents(
    procs: Procs, tmp_path: Path, user_jobs: Path
) -> None:
    assert importlib.util.find_spec("regression_job") is None  # only python_path finds it
    cfg = write_coordinator_config(
        tmp_path, min_sites=3, num_inner_steps=16, max_rounds=4, eval_every_rounds=1
    )
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    for site_id, centre in (("eu", -1.0), ("us", 0.0), ("ap", 1.0)):
        table = _site(tmp_path, user_jobs, site_id, options={"centre": centre})
        procs.start(f"site-{site_id}", "agent", "--config", str(_write(tmp_path, table)))
    assert procs.procs["coordinator"].wait(timeout=200) == 0, procs.log("coordinator")
    for site_id in ("eu", "us", "ap"):
        assert procs.procs[f"site-{site_id}"].wait(timeout=60) == 0, procs.log(f"site-{site_id}")
    status = read_status(tmp_path)
    assert status is not None and status["finished"] and status["rounds_completed"] == 4
    assert all(sorted(h["merged"]) == ["ap", "eu", "us"] for h in status["history"])
    vals = {int(k): v for k, v in status["val_losses"].items()}
    assert vals[4] < 0.5 * vals[0], vals
    # The job's other metric travels beside the loss and is kept with it.
    final = status["val_metrics"]["4"]
    assert math.isclose(final["rmse"], math.sqrt(vals[4]), rel_tol=1e-6)
    # Every site ends on the coordinator's model: their checkpoints hold version 4.
    for site_id in ("eu", "us", "ap"):
        ckpt = torch.load(tmp_path / f"site-{site_id}" / "checkpoint.pt", weights_only=True)
        assert ckpt["global_version"] == 4


def test_a_site_whose_model_differs_in_one_shape_is_refused_naming_it(
    procs: Procs, tmp_path: Path, user_jobs: Path
) -> None:
    cfg = write_coordinator_config(tmp_path, min_sites=2, max_rounds=1)
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    procs.start(
        "site-eu", "agent", "--config", str(_write(tmp_path, _site(tmp_path, user_jobs, "eu")))
    )
    wait_for(
        lambda: "initial model" in procs.log("coordinator"),
        timeout_s=120,
        what="eu's model to become the federation's",
        procs=procs,
    )
    other = _site(tmp_path, user_jobs, "us", options={"hidden": 17})
    code = procs.start("site-us", "agent", "--config", str(_write(tmp_path, other))).wait(120)
    log = procs.log("site-us")
    assert code == 3, log
    assert "'0.weight' has shape (17, 8) at the site, (16, 8) in the federation" in log, log
    # The same model from a factory that ignores its seed: caught by the θ0 hash, and said so.
    unseeded = _site(tmp_path, user_jobs, "ap", options={"unseeded": True})
    procs.start("site-ap", "agent", "--config", str(_write(tmp_path, unseeded)))
    assert procs.procs["coordinator"].wait(timeout=120) == 0, procs.log("coordinator")
    assert procs.procs["site-ap"].wait(timeout=60) == 0, procs.log("site-ap")
    assert "not deterministic in its seed" in procs.log("site-ap")
    assert "not deterministic" not in procs.log("site-eu")


def _cfg(tmp_path: Path, jobs: Path, **job: Any) -> SiteConfig:
    table = _site(tmp_path, jobs, "eu", coordinator="tcp://127.0.0.1:1", **job)
    del table["coordinator_endpoint_file"]
    return build(SiteConfig, table, prefix="site.")


@pytest.mark.parametrize(
    ("job", "message"),
    [
        ({"factory": "no_such_module:make_job"}, "cannot import 'no_such_module'"),
        ({"factory": "regression_job:missing"}, "has no 'missing'"),
        ({"factory": "regression_job:NOT_CALLABLE"}, "is not callable (int)"),
        ({"factory": "regression_job:no_optimizer"}, "has no 'optimizer'"),
        ({"options": {"colour": 1}}, "refused its options: unknown option 'colour'"),
        ({"options": {"bad": "noloss"}}, "evaluate must return a 'loss'"),
        ({"options": {"bad": "vector"}}, "loss must return a scalar tensor, got (32,)"),
    ],
)
def test_a_bad_job_is_refused_before_anything_connects(
    tmp_path: Path, user_jobs: Path, job: dict[str, Any], message: str
) -> None:
    with pytest.raises(JobError) as err:
        build_agent(_cfg(tmp_path, user_jobs, **job))
    assert message in str(err.value)


@pytest.mark.timeout(60)
def test_the_agent_exits_2_naming_the_bad_job(tmp_path: Path, user_jobs: Path) -> None:
    table = _site(tmp_path, user_jobs, "eu", options={"bad": "noloss"})
    result = subprocess.run(
        [sys.executable, "-m", "crossdc", "agent", "--config", str(_write(tmp_path, table))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 2, result.stderr
    assert "evaluate must return a 'loss'" in result.stderr


def test_the_byte_gpt_sections_are_refused_for_another_job(tmp_path: Path, user_jobs: Path) -> None:
    table = _site(tmp_path, user_jobs, "eu", coordinator="tcp://127.0.0.1:1")
    del table["coordinator_endpoint_file"]
    for key, value in (("model", {"num_layers": 3}), ("eval_batches", 2), ("optim", {"lr": 0.1})):
        with pytest.raises(
            ValueError, match=f"site.{key} configures the built-in byte GPT job only"
        ):
            site_config_from_table({**table, key: value})
    # Clipping applies to every job: site.optim.grad_clip alone is read as site.job.grad_clip.
    assert site_config_from_table({**table, "optim": {"grad_clip": 0.5}}).job.grad_clip == 0.5


def test_the_byte_gpt_sections_at_their_defaults_are_accepted_for_another_job(
    tmp_path: Path, user_jobs: Path
) -> None:
    """Another job's [site] may hold the byte GPT's sections at their defaults: they change
    nothing, and are dropped. A value that differs is refused, a bad one named as written."""
    table = _site(tmp_path, user_jobs, "eu", coordinator="tcp://127.0.0.1:1")
    del table["coordinator_endpoint_file"]
    defaults = {
        "model": {"num_layers": 4, "d_model": 128},
        "data": {"source": "stdlib"},
        "optim": {"lr": 3e-3, "grad_clip": 0.5},
        "eval_batches": 8,
        "eval_batch_size": 16,
    }
    cfg = site_config_from_table({**table, **defaults})
    assert cfg.job.factory == "regression_job:make_job"
    assert cfg.job.options == {} and cfg.job.grad_clip == 0.5
    with pytest.raises(ConfigError, match="site.optim configures the built-in byte GPT job only"):
        site_config_from_table({**table, **defaults, "optim": {"lr": 3e-3, "batch_size": 8}})
    with pytest.raises(ConfigError, match="unknown key site.model.num_layer"):
        site_config_from_table({**table, "model": {"num_layer": 4}})


def test_the_byte_gpt_sections_are_read_as_its_options() -> None:
    """[site.model], [site.data], [site.optim] and site.eval_* of a byte GPT site are its job's
    options (a key given in [site.job.options] wins); site.optim.grad_clip is site.job.grad_clip."""
    base = {"site_id": "eu", "coordinator": "tcp://h:1", "security": {"insecure": True}}
    legacy = site_config_from_table(
        {
            **base,
            "model": {"d_model": 64, "num_heads": 4},
            "data": {"shard_index": 1, "num_shards": 3},
            "optim": {"lr": 0.01, "grad_clip": 0.5},
            "eval_batches": 2,
            "job": {"options": {"model": {"d_model": 32}}},
        }
    )
    assert legacy.job.factory == BYTEGPT_FACTORY and legacy.job.grad_clip == 0.5
    assert legacy.job.options == {
        "model": {"d_model": 32, "num_heads": 4},
        "data": {"shard_index": 1, "num_shards": 3},
        "optim": {"lr": 0.01},
        "eval_batches": 2,
    }
    options = {"model": {"d_model": 32, "num_heads": 4}, "optim": {"lr": 0.01}}
    canonical = site_config_from_table(
        {**base, "job": {"grad_clip": 0.5, "options": {**options, "eval_batches": 2}}}
    )
    assert canonical.job.options["model"] == legacy.job.options["model"]
    assert site_config_from_table(base).job == JobConfig()


_BASE = {"site_id": "eu", "coordinator": "tcp://h:1", "security": {"insecure": True}}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        # Written as the job's options: named there.
        (
            {"job": {"options": {"model": {"num_layer": 3}}}},
            "unknown key site.job.options.model.num_layer",
        ),
        ({"job": {"options": {"colour": 1}}}, "unknown key site.job.options.colour"),
        ({"job": {"options": {"model": {"d_model": 30}}}}, "model.d_model must be divisible"),
        (
            {"job": {"options": {"eval_batches": 0}}},
            "eval_batches and eval_batch_size must be >= 1",
        ),
        ({"job": {"options": {"optim": {"lr": -1.0}}}}, "inner_optim.lr must be > 0"),
        ({"job": {"options": {"data": {"num_shards": 0}}}}, "data.num_shards must be >= 1"),
        # Written the old way ([site.model] ...): named as written.
        ({"model": {"num_layer": 3}}, "unknown key site.model.num_layer"),
        ({"model": {"d_model": 30}}, "model.d_model must be divisible"),
        ({"eval_batches": 0}, "eval_batches and eval_batch_size must be >= 1"),
        ({"optim": {"lr": -1.0}}, "inner_optim.lr must be > 0"),
        # The model's 4 blocks, its embedding and its head: at most 6 stages.
        ({"stages": 20}, "site.stages=20 exceeds the model's 6 layers"),
        ({"stages": 7}, "site.stages=7 exceeds the model's 6 layers"),
        ({"stages": 4, "model": {"num_layers": 1}}, "site.stages=4 exceeds the model's 3 layers"),
    ],
)
def test_the_byte_gpt_options_are_checked_when_the_config_is_read(
    table: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        site_config_from_table({**_BASE, **table})


def test_the_stage_bound_follows_the_byte_gpt_model() -> None:
    assert site_config_from_table({**_BASE, "stages": 6}).stages == 6
    deeper = {"job": {"options": {"model": {"num_layers": 18}}}}
    assert site_config_from_table({**_BASE, "stages": 20, **deeper}).stages == 20
    assert site_config_from_table({**_BASE, "stages": 20, "model": {"num_layers": 18}}).stages == 20


def test_a_job_may_check_its_options_when_the_config_is_read(
    tmp_path: Path, user_jobs: Path
) -> None:
    table = _site(tmp_path, user_jobs, "eu", coordinator="tcp://127.0.0.1:1")
    del table["coordinator_endpoint_file"]
    checked = {**table, "job": {**table["job"], "factory": "regression_job:checked"}}
    assert site_config_from_table(checked).job.factory == "regression_job:checked"
    with pytest.raises(ConfigError, match=r"site\.job\.options\.hidden must be >= 1"):
        site_config_from_table({**checked, "job": {**checked["job"], "options": {"hidden": 0}}})
    with pytest.raises(ConfigError, match="site.stages=4 exceeds the model's 3 layers"):
        site_config_from_table({**checked, "stages": 4})
    # A job without a check is checked when it is built; one that does not import, too.
    assert site_config_from_table({**table, "stages": 4}).stages == 4
    missing = {**table, "job": {**table["job"], "factory": "no_such_module:make_job"}}
    assert site_config_from_table(missing).job.factory == "no_such_module:make_job"


@pytest.mark.timeout(60)
def test_a_site_with_more_stages_than_layers_exits_2_before_torchrun(tmp_path: Path) -> None:
    path = tmp_path / "site.toml"
    path.write_text(
        dump_toml({"site": {**_BASE, "state_dir": str(tmp_path / "state"), "stages": 20}})
    )
    result = subprocess.run(
        [sys.executable, "-m", "crossdc", "agent", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 2, result.stderr
    assert "bad config: site.stages=20 exceeds the model's 6 layers" in result.stderr
    assert "torchrun" not in result.stderr


class _NanAfter:
    """A job whose loss turns NaN after ``good`` steps."""

    def __init__(self, good: int) -> None:
        self.model = nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.good, self.calls = good, 0

    def batches(self) -> Any:
        while True:
            yield torch.ones(4, 2)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = model(batch).mean()
        return out * float("nan") if self.calls > self.good else out

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"loss": 0.0}


def test_a_non_finite_loss_skips_its_step_and_a_run_of_them_stops_naming_the_step() -> None:
    skipped: list[int] = []
    trainer = JobTrainer(_NanAfter(good=3), max_nonfinite_steps=4, on_skipped=skipped.append)
    stats = trainer.train_steps(3)
    assert stats.steps == 3 and math.isfinite(stats.loss_mean)
    before = trainer.parameters_numpy()
    with pytest.raises(
        NonFiniteLossError, match="4 inner steps in a row, the last at inner step 7"
    ):
        trainer.train_steps(10)
    assert skipped == [4, 5, 6, 7]
    after = trainer.parameters_numpy()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # no NaN step was taken


def test_federated_state_averages_float_buffers_keeps_integer_ones_and_ties_once() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.BatchNorm1d(4), nn.Linear(4, 10))
    model[2].weight = model[0].weight  # tied: one tensor under two names
    names = list(federated_state(model))
    assert "1.running_mean" in names and "1.running_var" in names
    assert "1.num_batches_tracked" not in names
    assert "0.weight" in names and "2.weight" not in names
    spec = state_spec(model)
    assert ("1.running_mean", (4,), "float32") in spec
    assert job_fingerprint("a:b", spec) != job_fingerprint("a:c", spec)
    assert job_fingerprint("a:b", spec, {"heads": 2}) != job_fingerprint("a:b", spec, {"heads": 4})


def test_the_byte_gpt_job_is_the_default_and_matches_its_config(tmp_path: Path) -> None:
    cfg = SiteConfig(
        site_id="eu",
        coordinator="tcp://127.0.0.1:1",
        state_dir=str(tmp_path),
        device="cpu",
        job=JobConfig(
            options={
                "model": {"context_len": 16, "num_layers": 1, "d_model": 16, "num_heads": 2},
                "data": {"max_bytes": 20_000},
            }
        ),
        security=SecurityConfig(insecure=True),
    )

    trainer = build_job_trainer(cfg)
    model = ModelConfig(context_len=16, num_layers=1, d_model=16, num_heads=2)
    assert trainer.fingerprint(cfg.job.factory) == model_fingerprint(model)
    ctx = JobContext(
        site_id="eu", seed=cfg.seed, device=torch.device("cpu"), options=cfg.job.options
    )
    twin = JobTrainer(build_job(cfg.job.factory, ctx))
    a, b = trainer.parameters_numpy(), twin.parameters_numpy()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_three_skewed_digits_sites_federated_beat_any_site_alone(
    procs: Procs, tmp_path: Path
) -> None:
    """Each site holds only its own classes (skew 1: c % 3 == site), so alone it can be right
    on at most its classes' share of the common validation set (about 0.40 for site 0); the
    federated model must do better than any of them."""
    pytest.importorskip("sklearn")
    from site_agent.jobs.digits import load_data, validation_indices

    labels = load_data()[1]
    val = labels[validation_indices(labels, 0.25, 0)]
    alone_bound = max(
        float(np.isin(val, [c for c in range(10) if c % 3 == i]).mean()) for i in range(3)
    )
    cfg = write_coordinator_config(
        tmp_path, min_sites=3, num_inner_steps=30, max_rounds=8, eval_every_rounds=1
    )
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    for i, site_id in enumerate(("eu", "us", "ap")):
        table = {
            **_site(tmp_path, tmp_path, site_id),
            "job": {
                "factory": "site_agent.jobs.digits:make_job",
                "options": {"site_index": i, "num_sites": 3, "skew": 1.0},
            },
        }
        procs.start(f"site-{site_id}", "agent", "--config", str(_write(tmp_path, table)))
    assert procs.procs["coordinator"].wait(timeout=200) == 0, procs.log("coordinator")
    status = read_status(tmp_path)
    assert status is not None and status["rounds_completed"] == 8
    accuracy = {int(v): m["accuracy"] for v, m in status["val_metrics"].items()}
    assert alone_bound < 0.41
    assert max(accuracy[v] for v in (6, 7, 8)) > alone_bound + 0.1, (alone_bound, accuracy)


def test_a_site_whose_loss_stays_nan_stops_naming_the_step_and_sends_nothing(
    procs: Procs, tmp_path: Path, user_jobs: Path
) -> None:
    cfg = write_coordinator_config(tmp_path, min_sites=1, num_inner_steps=16, max_rounds=2)
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    table = _site(tmp_path, user_jobs, "eu", options={"bad": "nan_after_5"})
    table["job"]["max_nonfinite_steps"] = 3
    code = procs.start("site-eu", "agent", "--config", str(_write(tmp_path, table))).wait(120)
    log = procs.log("site-eu")
    assert code == 3, log
    assert "3 inner steps in a row, the last at inner step 8" in log, log
    assert "update accepted" not in procs.log("coordinator")
