"""The fold benchmark's report (rates are not asserted: CPU time varies; the memory a fold
allocates is, since it does not depend on the host)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(120)


def test_fold_benchmark_report(capsys: pytest.CaptureFixture[str]) -> None:
    from crossdc.bench.fold import main, run

    report = run(params=300_000, sites=2, repeats=1, tensor=1 << 17, codecs=("int4", "fp32"))
    assert [c["name"] for c in report["codecs"]] == ["int4", "fp32"]
    for c in report["codecs"]:
        assert set(c) == {
            "name",
            "encoded_bytes_per_param",
            "fold_rate",
            "check_rate",
            "add_rate",
            "fold_extra_bytes",
        }
        assert c["fold_rate"] is None or c["fold_rate"] > 0
        # The close's buffer of the largest tensor (512 KiB) and tiles, not a float copy of an
        # update (1.2 MB of float32 here).
        assert c["fold_extra_bytes"] < 4 * (1 << 17) + 500_000
    assert report["codecs"][0]["encoded_bytes_per_param"] == pytest.approx(0.53, abs=0.01)
    args = ["--params", "100000", "--sites", "1", "--repeats", "1", "--codecs", "int8"]
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["codecs"][0]["name"] == "int8"
    assert main(args) == 0
    assert "int8" in capsys.readouterr().out


def test_fold_benchmark_refuses_unknown_codecs(capsys: pytest.CaptureFixture[str]) -> None:
    from crossdc.bench.fold import main

    with pytest.raises(SystemExit):
        main(["--codecs", "int9"])
    assert "unknown codec 'int9'" in capsys.readouterr().err


def test_the_cli_runs_the_fold_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    from crossdc.cli import main

    rc = main(["bench", "fold", "--json", "--params", "50000", "--sites", "1", "--repeats", "1"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["params"] == 50000
