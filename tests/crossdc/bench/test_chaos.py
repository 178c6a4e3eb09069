"""``crossdc bench chaos``: fault draws are seeded, and a short soak keeps the federation safe.

The soak runs real processes (a coordinator and three sites behind WAN emulators) for about
two minutes of faults (eleven) and asserts only structural and safety figures: no closed round lost,
no round id reused, every site ending on the coordinator's version and state hash, a finite
validation loss. Timings (stalls, recovery seconds) are the bench's figures, not the test's.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from crossdc.bench import chaos
from crossdc.bench.chaos_faults import KINDS, draw_fault
from crossdc.bench.chaos_fed import free_port


@pytest.mark.timeout(10)
def test_fault_draws_depend_only_on_the_seed() -> None:
    sites = ["eu", "us", "ap"]

    def draws(seed: int) -> list[tuple[str, str, float]]:
        rng = random.Random(seed)
        return [
            (f.kind, f.target, f.duration_s)
            for f in (draw_fault(rng, i, sites, 10.0) for i in range(40))
        ]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert {kind for kind, _, _ in draws(7)} == set(KINDS)
    for kind, target, duration in draws(7):
        assert (target == "coordinator") == kind.endswith("coordinator")
        if kind == "partition_site":
            assert duration > 10.0  # longer than the coordinator's site timeout


@pytest.mark.timeout(10)
def test_free_port_is_bindable() -> None:
    assert 0 < free_port() < 65536


@pytest.mark.timeout(10)
def test_bad_arguments_exit_1_and_start_nothing(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    assert chaos.main(["--sites", "1", "--workdir", str(workdir)]) == 1
    assert not workdir.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--job", "no_such_module:make_job"], "cannot import 'no_such_module'"),
        (["--job", "site_agent.jobs.digits:missing"], "has no 'missing'"),
        (["--job-option", "skew=1.0"], "--job-option need --job"),
        (["--job", "site_agent.jobs.digits:make_job", "--job-option", "skew"], "not KEY=VALUE"),
    ],
)
def test_a_bad_job_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    workdir = tmp_path / "run"
    assert chaos.main(["--workdir", str(workdir), *extra]) == 1
    assert named in capsys.readouterr().err
    assert not workdir.exists()


@pytest.mark.timeout(30)
def test_a_job_reaches_every_site_as_the_demo_writes_it(tmp_path: Path) -> None:
    from crossdc.bench.chaos_fed import FedSpec, demo_args
    from crossdc.demo_roles import write_coordinator_config, write_site_configs

    args = chaos.parse_args(
        ["--job", "site_agent.jobs.digits:make_job", "--job-option", "site_index={site_index}"]
    )
    args = demo_args(FedSpec(sites=3, job=chaos.job_argv(args)))
    coord = write_coordinator_config(args, tmp_path).read_text()
    assert "initial_model" not in coord  # θ0 comes from the first site
    endpoints = {s: "tcp://127.0.0.1:1" for s in ("eu", "us", "ap")}
    for index, (_, path) in enumerate(write_site_configs(args, tmp_path, endpoints)):
        text = path.read_text()
        assert 'factory = "site_agent.jobs.digits:make_job"' in text
        assert f"site_index = {index}" in text


@pytest.mark.timeout(120)
def test_the_soaks_validation_scores_any_job_as_its_sites_do(tmp_path: Path) -> None:
    """The final and initial losses a soak reports come from the job's own ``evaluate``: for a
    job that is not the byte GPT too (its parameters are not the byte GPT's)."""
    from crossdc.bench import chaos_analysis as an
    from crossdc.bench.chaos_fed import FedSpec, demo_args
    from crossdc.demo_roles import write_site_configs
    from site_agent.config import load_site_config
    from site_agent.launch import build_job_trainer

    job = ["--job", "site_agent.jobs.digits:make_job", "--job-option", "site_index={site_index}"]
    args = demo_args(FedSpec(sites=2, job=chaos.job_argv(chaos.parse_args(job))))
    endpoints = {s: "tcp://127.0.0.1:1" for s in ("eu", "us")}
    path = write_site_configs(args, tmp_path, endpoints)[0][1]
    trainer = build_job_trainer(load_site_config(path))
    initial = trainer.parameters_numpy()
    assert an.evaluate(path, None) == trainer.validate()["loss"]
    trainer.train_steps(30)
    trained = trainer.parameters_numpy()
    assert an.evaluate(path, trained) == trainer.validate()["loss"]
    assert an.evaluate(path, trained) < an.evaluate(path, initial)


@pytest.mark.timeout(1200)
def test_short_soak_loses_nothing_and_ends_in_agreement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--json", "--minutes", "1.75", "--period", "9", "--seed", "1"]  # 11 faults
    rc = chaos.main([*argv, "--skip-fault-free", "--workdir", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert report["faults"] >= 8
    assert sum(report["fault_kinds"].values()) == report["faults"]
    assert report["rounds_completed"] > 0
    assert report["rounds_lost"] == 0, report["rounds_lost_list"]
    assert report["round_ids_reused"] == 0, report["round_ids_reused_list"]
    assert report["sites_final_hash_agree"] is True, report["final_versions"]
    assert math.isfinite(report["val_loss_final"])
    assert (tmp_path / "report.json").exists()
