"""The in-process equal-token study: its DiLoCo reduces to the baseline where the math says so,
and its byte count is the codecs' encoded sizes."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from comm.codecs.registry import get_codec
from crossdc import plot
from crossdc.bench import equal_tokens
from crossdc.demo_roles import DEMO_MODEL
from site_agent.jobs.bytegpt.model import ModelConfig, build_model


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Baselines cached per test, never in the user's cache."""
    monkeypatch.setenv("CROSSDC_CACHE_DIR", str(tmp_path / "cache"))
    yield


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache shared by the cases of one test whose baselines are the same run."""
    return tmp_path_factory.mktemp("cache")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert equal_tokens.main([*argv, "--json", "--batch-size", "2"]) == 0
    out: dict = json.loads(capsys.readouterr().out)  # type: ignore[type-arg]
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "outer",
    [
        ("--outer-lr", "1", "--outer-momentum", "0", "--outer-warmup-steps", "0"),
        ("--outer-warmup-steps", "3"),
    ],
    ids=["plain-outer-sgd", "outer-warmup"],
)
def test_one_site_one_step_rounds_plain_averaging_is_the_baseline(
    capsys: pytest.CaptureFixture[str],
    outer: tuple[str, ...],
    module_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One site, H = 1, fp32, a plain mean as the outer step (outer lr 1 and no momentum, or every
    # round within the outer warm-up): each round's global model is the site's model after one
    # AdamW step, which is what the baseline computes. The outer rule is no part of the
    # baseline's cache key: the first case computes it, the second reads the same curve.
    monkeypatch.setenv("CROSSDC_CACHE_DIR", str(module_cache))
    out = _run(
        capsys,
        *("--sites", "1", "--steps", "3", "--inner-steps", "1", "--eval-every", "1"),
        *outer,
        *("--codec", "fp32"),
    )
    ddp = out["ddp_val_loss_by_step"]
    diloco = out["diloco_val_loss_by_step"]
    assert list(ddp) == list(diloco) == ["1", "2", "3"]
    for step in ddp:
        assert diloco[step] == pytest.approx(ddp[step], rel=1e-5)
    assert ddp["3"] < ddp["1"]  # it trains
    assert out["val_loss_gap"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.timeout(240)
def test_overlapped_merge_keeps_the_progress_made_since_the_send(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One site, plain means: the global model is the site's model at the send, so the merge one
    # step into the next slot adds nothing and the site trains as the baseline does.
    argv = ("--steps", "4", "--inner-steps", "2", "--eval-every", "2", "--codec", "fp32")
    out = _run(capsys, "--sites", "1", *argv, "--outer-warmup-steps", "4", "--overlap-steps", "1")
    assert list(out["diloco_val_loss_by_step"]) == ["2", "4"]
    for step, loss in out["ddp_val_loss_by_step"].items():
        assert out["diloco_val_loss_by_step"][step] == pytest.approx(loss, rel=1e-5)
    # Two sites: merging one step late is not the blocking result.
    blocking = _run(capsys, "--sites", "2", *argv)
    overlapped = _run(capsys, "--sites", "2", *argv, "--overlap-steps", "1")
    assert blocking["diloco_val_loss_by_step"]["2"] == overlapped["diloco_val_loss_by_step"]["2"]
    assert blocking["diloco_val_loss_by_step"]["4"] != overlapped["diloco_val_loss_by_step"]["4"]


@pytest.mark.timeout(240)
def test_momentum_changes_the_outcome_and_bytes_are_the_encoded_sizes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _run(
        capsys,
        *("--sites", "2", "--steps", "4", "--inner-steps", "2", "--codec", "int8"),
        *("--outer-warmup-steps", "0"),
    )
    assert out["val_loss_gap"] != 0.0
    codec = get_codec("int8")
    sizes = sum(
        codec.encoded_size(t.numel())
        for t in build_model(ModelConfig(**DEMO_MODEL), 0).state_dict().values()
    )
    rounds, sites = 2, 2
    assert out["diloco_wire_bytes_per_inner_step"] == rounds * sites * 2 * sizes / 4


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert equal_tokens.main(["--sites", "0"]) == 2
    assert "--sites" in capsys.readouterr().err
    assert equal_tokens.main(["--outer-warmup-steps", "-1"]) == 2
    assert "--outer-warmup-steps and --overlap-steps must be >= 0" in capsys.readouterr().err

    assert equal_tokens.main(["--broadcast", "sparse"]) == 2
    assert "--broadcast sparse needs --strategy sparseloco" in capsys.readouterr().err


def test_every_argument_is_checked_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(*_: object, **__: object) -> None:
        raise AssertionError("training started before the arguments were checked")

    monkeypatch.setattr(equal_tokens, "run_ddp", no_work)
    monkeypatch.setattr(equal_tokens, "run_diloco", no_work)
    for argv, words in (
        (["--codec", "nope", "--steps", "2400"], "--codec: unknown codec 'nope'"),
        (["--uplink-codec", "chunktopk:bits=3"], "--uplink-codec: chunktopk: bits"),
        (["--ef-decay", "1.5"], "--ef-decay"),
        (["--sweep", "--sweep-k", "x"], "--sweep-k"),
        (["--sweep", "--sweep-bits", "3"], "bits must be 1 or 2"),
    ):
        assert equal_tokens.main(argv) == 2
        assert words in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_sparseloco_run_reuses_the_cached_baseline_and_reports_the_bytes_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = (
        *("--sites", "2", "--steps", "4", "--inner-steps", "2", "--eval-every", "2"),
        *("--strategy", "sparseloco", "--ef-decay", "0.95", "--outer-lr", "1"),
        *("--uplink-codec", "chunktopk", "--broadcast", "sparse"),
    )
    first = _run(capsys, *argv)
    second = _run(capsys, *argv, "--jobs", "1")
    assert not first["ddp_cached"] and second["ddp_cached"]
    assert first["ddp_val_loss_by_step"] == second["ddp_val_loss_by_step"]
    assert first["diloco_val_loss_by_step"] == second["diloco_val_loss_by_step"]
    numel = sum(t.numel() for t in build_model(ModelConfig(**DEMO_MODEL), 0).state_dict().values())
    assert first["ddp_wire_bytes_per_inner_step"] == 2 * 2 * 4 * numel
    assert first["bytes_ratio_vs_ddp"] == pytest.approx(
        first["ddp_wire_bytes_per_inner_step"] / first["diloco_wire_bytes_per_inner_step"]
    )
    # The sparse broadcast forwards the sites' updates: every site receives both of them, so
    # the bytes are the uplink's times (1 + sites), at about 0.16 bits a value per update.
    per_update = first["diloco_wire_bytes_per_inner_step"] * 4 / (2 * 2 * 3)
    assert 8 * per_update / numel < 0.3


@pytest.mark.timeout(600)
def test_sweep_writes_the_frontier_json_and_picture(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = _run(
        capsys,
        *("--sites", "2", "--steps", "2", "--eval-every", "2", "--seeds", "0"),
        *("--strategy", "sparseloco", "--outer-lr", "1", "--broadcast", "sparse"),
        *("--sweep", "--sweep-inner-steps", "1,2", "--sweep-k", "64", "--sweep-bits", "1,2"),
        *("--out", str(tmp_path / "sweep")),
    )
    points = json.loads((tmp_path / "sweep" / "frontier.json").read_text())["points"]
    assert len(points) == len(out["points"]) == 4
    assert {(p["inner_steps"], p["codec"]) for p in points} == {
        (1, "chunktopk:bits=1"),
        (1, "chunktopk"),
        (2, "chunktopk:bits=1"),
        (2, "chunktopk"),
    }
    assert (tmp_path / "sweep" / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    # A single run's report joins the sweep's points in one picture and table.
    argv = ("--sites", "2", "--steps", "2", "--inner-steps", "1", "--eval-every", "2")
    single = _run(capsys, *argv, "--codec", "int4")
    report = tmp_path / "int4.json"
    report.write_text(json.dumps(single))
    both = ("--frontier", str(tmp_path / "sweep" / "frontier.json"), str(report))
    assert plot.main([*both, "--table", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    rows = [line for line in printed if line.startswith("| H=")]
    assert len(rows) == 5
    assert any(r.startswith("| H=1 int4, down int4, diloco lr 0.7 | 0 |") for r in rows)
    assert sum(" *" in r for r in rows) == len(
        plot.frontier_points([*points, plot.frontier_point(single)])
    )
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "bad.json").write_text(json.dumps({"config": {}}))
    assert plot.main(["--frontier", str(tmp_path / "bad.json")]) == 1
    assert "neither a sweep's frontier.json" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_sweep_without_matplotlib_reports_its_frontier_without_the_picture(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the 'plot' extra were absent
    argv = [
        *("--sites", "2", "--steps", "2", "--eval-every", "2", "--seeds", "0", "--jobs", "1"),
        *("--strategy", "sparseloco", "--outer-lr", "1", "--broadcast", "sparse"),
        *("--sweep", "--sweep-inner-steps", "1", "--sweep-k", "64", "--sweep-bits", "1"),
        *("--out", str(tmp_path / "sweep"), "--json", "--batch-size", "2"),
    ]
    assert equal_tokens.main(argv) == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    assert len(out["points"]) == 1 and out["png"] is None
    assert len(json.loads((tmp_path / "sweep" / "frontier.json").read_text())["points"]) == 1
    assert not (tmp_path / "sweep" / "frontier.png").exists()
    assert "no figure: figures need matplotlib" in printed.err


@pytest.mark.timeout(300)
def test_selsync_sends_markers_for_insignificant_updates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("--sites", "2", "--steps", "2", "--inner-steps", "1", "--eval-every", "1")
    sparse = ("--strategy", "sparseloco", "--outer-lr", "1", "--uplink-codec", "chunktopk")
    out = _run(capsys, *argv, *sparse, "--broadcast", "sparse", "--selsync-threshold", "1e9")
    # Every update skipped: 2 markers up, each site receiving both, every round.
    assert out["diloco_wire_bytes_per_inner_step"] == 16 * (2 + 2 * 2)
    losses = list(out["diloco_val_loss_by_step"].values())
    assert losses[0] == losses[1]  # nothing merged: the global model did not move
