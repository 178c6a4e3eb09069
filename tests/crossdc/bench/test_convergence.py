"""``crossdc bench convergence``: the demo it runs per codec and seed, and the means it reports."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from crossdc.bench import convergence

pytestmark = pytest.mark.timeout(60)

LOSS = {("fp32", 1): 2.0, ("fp32", 2): 2.2, ("int4", 1): 2.02, ("int4", 2): 2.2}
BYTES = {"fp32": 100_000, "int4": 12_500}


def test_costs_are_gaps_of_the_means_over_seeds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, int, int]] = []

    def fake_run(codec: str, seed: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
        calls.append((codec, seed, args.batch_size))
        return {
            "val_loss_final": LOSS[(codec, seed)],
            "val_loss_initial": 5.0,
            "wan_bytes_total": BYTES[codec],
            "wall_seconds": 1.0,
        }

    monkeypatch.setattr(convergence, "run_one", fake_run)
    argv = ["--codecs", "int4", "--seeds", "1,2", "--batch-size", "4", "--json"]
    assert convergence.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    # fp32 is always run, first; every codec with every seed.
    assert calls == [("fp32", 1, 4), ("fp32", 2, 4), ("int4", 1, 4), ("int4", 2, 4)]
    rows = {r["codec"]: r for r in out["codecs"]}
    assert rows["fp32"]["val_loss_gap"] == 0.0
    assert rows["int4"]["val_loss_final"] == pytest.approx(2.11)
    assert rows["int4"]["val_loss_gap"] == pytest.approx(2.11 / 2.1 - 1)
    assert rows["int4"]["val_loss_gap_by_seed"] == pytest.approx([0.01, 0.0])
    assert rows["int4"]["bytes_ratio_vs_fp32"] == 8.0
    assert out["seeds"] == [1, 2] and out["batch_size"] == 4
    assert out["overlap"] is False and out["wan_emulation"] is True


def test_the_demo_command_names_codec_seed_and_batch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[list[str]] = []

    class Done:
        returncode = 0
        stdout = json.dumps({"val_loss_final": 2.0})
        stderr = ""

    def fake_subprocess_run(argv: list[str], **_kw: Any) -> Done:
        seen.append(argv)
        return Done()

    monkeypatch.setattr(convergence.subprocess, "run", fake_subprocess_run)
    args = argparse.Namespace(
        sites=3, rounds=2, inner_steps=5, batch_size=16, timeout=10.0, overlap=False, no_wan=False
    )
    convergence.run_one("int3+zstd", 7, args, tmp_path)
    convergence.run_one(
        "int3+zstd", 7, argparse.Namespace(**{**vars(args), "overlap": True}), tmp_path
    )
    assert "--no-overlap" not in seen[1] and "--no-wan" not in seen[1]
    argv = seen[0]
    pairs = dict(zip(argv[4::1], argv[5::1], strict=False))
    assert pairs["--uplink-codec"] == pairs["--downlink-codec"] == "int3+zstd"
    assert pairs["--seed"] == "7" and pairs["--batch-size"] == "16"
    assert "--no-overlap" in argv and pairs["--workdir"].endswith("int3+zstd-7")
    assert "--no-align-arrivals" in argv  # equal tokens for every codec
    convergence.run_one("int3+zstd/int4+zstd", 7, args, tmp_path)
    pairs = dict(zip(seen[2][4::1], seen[2][5::1], strict=False))
    assert (pairs["--uplink-codec"], pairs["--downlink-codec"]) == ("int3+zstd", "int4+zstd")
    assert pairs["--workdir"].endswith("int3+zstd--int4+zstd-7")


@pytest.mark.parametrize("bad", ["int4/", "/int4", "int4/int3/int2", "int4/zip9"])
def test_a_bad_codec_pair_is_refused_before_anything_runs(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        convergence.main(["--codecs", f"fp32,{bad}"])
    assert exc.value.code == 2
    assert "--codecs" in capsys.readouterr().err
