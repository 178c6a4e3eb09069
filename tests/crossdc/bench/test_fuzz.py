"""``crossdc bench fuzz``: a short run over every decoder finds nothing, with atheris where it
is installed and with the built-in engine without it; the oracle reports what it must (an
exception that is no refusal, a wrong result, a hang); the mutations keep to the input layouts.
Longer campaigns are run by hand (docs/security.md, "Fuzzing")."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from crossdc.bench import fuzz, fuzz_engines
from crossdc.bench.fuzz_engines import run_builtin
from crossdc.bench.fuzz_mutate import Mutator
from crossdc.bench.fuzz_seeds import pack_frames, tokens, unpack_frames
from crossdc.bench.fuzz_targets import (
    Target,
    all_targets,
    judge,
)
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)


def _report(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict[str, Any]]:
    rc = fuzz.main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.timeout(240)
def test_a_short_run_over_every_decoder_finds_nothing(tmp_path: Path) -> None:
    """What ``make test`` runs: the default engine (atheris when the fuzz extra is installed).
    Every group runs at least one libFuzzer child, which runs the group's seeds, and its time
    counts from when they are written, so a loaded machine still executes inputs."""
    proc = subprocess.run(
        [sys.executable, "-m", "crossdc", "bench", "fuzz", "--seconds", "10", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["findings"] == []
    assert report["executions"] > 0
    assert report["engine"] == ("atheris" if fuzz_engines.atheris_available() else "builtin")
    assert report["targets"] == len(all_targets())
    assert all(v > 0 for v in report["coverage"].values()), report["coverage"]


def test_without_atheris_the_builtin_engine_runs_every_target(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "atheris", None)  # any import of it fails
    assert not fuzz_engines.atheris_available()
    rc, report = _report(capsys, ["--seconds", "2"])
    assert rc == 0 and report["findings"] == []
    assert report["engine"] == "builtin"
    assert report["coverage"]["arcs"] > report["coverage"]["lines"] > 100
    per_target = report["executions_per_target"]
    assert set(per_target) == {t.name for t in all_targets()}
    assert all(n > 1 for n in per_target.values()), per_target
    assert report["executions"] == sum(per_target.values())


def test_asking_for_atheris_without_it_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "atheris", None)
    with pytest.raises(SystemExit) as exc:
        fuzz.main(["--engine", "atheris", "--seconds", "1"])
    assert exc.value.code == 2
    assert "pip install 'crossdc[fuzz]'" in capsys.readouterr().err


# ---- the oracle -----------------------------------------------------------------------------


def _broken(run: Any) -> list[Target]:
    return [Target("broken", run, (ValueError,), "raw", lambda: [b"seed"])]


@pytest.fixture
def only_broken(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def use(run: Any) -> None:
        monkeypatch.setattr(fuzz_engines, "all_targets", lambda: _broken(run))

    yield use


def test_an_exception_that_is_no_refusal_is_a_finding_and_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, only_broken: Any
) -> None:
    def run(data: bytes) -> None:
        if len(data) % 2:
            raise ValueError("a refusal")  # documented: not a finding
        {}["missing"]  # noqa: B018 (a KeyError is a finding)

    only_broken(run)
    monkeypatch.setitem(sys.modules, "atheris", None)
    rc, report = _report(capsys, ["--seconds", "0.5"])
    assert rc == 1
    [finding] = report["findings"]  # one per distinct place, however many inputs hit it
    assert finding["target"] == "broken" and finding["kind"] == "exception"
    assert finding["error"] == "KeyError" and finding["where"].startswith(
        "tests/crossdc/bench/test_fuzz.py:"
    )
    assert len(bytes.fromhex(finding["input_hex"])) % 2 == 0


def test_an_input_past_the_time_limit_is_a_hang(only_broken: Any) -> None:
    def run(data: bytes) -> None:
        while True:  # a decoder that never returns
            pass

    only_broken(run)
    result = run_builtin(0.2, per_input_s=0.05, seed=0, warm_up_s=0.05)
    assert result.executions >= 1
    assert {f["kind"] for f in result.findings} == {"hang"}


@pytest.mark.parametrize(
    ("out", "why"),
    [
        (np.zeros((2, 3), np.float64), "decode returned ndarray float64"),
        (np.zeros((3, 2), np.float32), "decoded shape"),
        (np.full((2, 3), np.nan, np.float32), "NaN or Inf"),
        (np.zeros((3, 2), np.float32).T, "C-contiguous"),
    ],
)
def test_a_decode_that_returns_a_wrong_array_is_a_contract_finding(
    out: np.ndarray, why: str
) -> None:
    from comm.codecs.base import EncodedTensor
    from crossdc.bench.fuzz_targets import _check_decoded

    enc = EncodedTensor(name="w", shape=(2, 3), codec="fp32")
    target = Target("c", lambda _d: _check_decoded(enc, out), (ValueError,), "raw", list)
    finding = judge(target, b"")
    assert finding is not None and finding.kind == "contract" and why in finding.message


# ---- inputs ---------------------------------------------------------------------------------


def test_every_seed_decodes_and_the_container_never_raises() -> None:
    for target in all_targets():
        for seed in target.seeds():
            assert judge(target, seed) is None, target.name
    frames = [b"", b"header", bytes(300)]
    assert unpack_frames(pack_frames(frames)) == frames
    for cut in range(12):
        unpack_frames(pack_frames(frames)[:cut])  # a count or length past the end: no raise


def test_mutations_are_deterministic_and_keep_the_layout() -> None:
    targets = all_targets()
    words = tokens(t.seeds() for t in targets)
    assert {"zbitmap", "fp32", "int8+zstd"} <= set(words)
    runs = []
    for _ in range(2):
        mutator = Mutator(random.Random(3), tokens=words)
        out, well_formed, containers = [], 0, 0
        for target in targets:
            seeds = target.seeds()
            for _ in range(20):
                data = mutator.mutate(seeds[0], target.shape, seeds[-1])
                assert len(data) <= mutator.max_size
                if target.shape != "raw":  # mostly edits inside the frames, rarely of the bytes
                    containers += 1
                    well_formed += pack_frames(unpack_frames(data)) == data
                out.append(data)
        assert well_formed > 0.8 * containers
        runs.append(out)
    assert runs[0] == runs[1]


# ---- a live coordinator ---------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_live_coordinator_keeps_closing_rounds_under_mutated_frames(tmp_path: Path) -> None:
    """A real coordinator process with a key kit; two simulated sites close rounds while a
    third certified site sends it mutated valid frames over CURVE."""
    from crossdc.bench.fuzz_live import run_live

    report = run_live(5.0, seed=1, workdir=tmp_path)
    assert report["findings"] == [], report["findings"]
    assert report["frames_sent"] > 500 and report["frames_mutated"] > 0
    assert report["rounds_closed_while_fuzzing"] > 0 and report["round_closed_after"]
    assert report["coordinator_alive"] and report["coordinator_exit_code"] == 0
    # The frames reached the coordinator's checks, not only the socket.
    assert sum(report["coordinator_rejected"].values()) > 0
    assert report["coordinator_replies"].get("unauthenticated", 0) > 0  # claims of "eu"
