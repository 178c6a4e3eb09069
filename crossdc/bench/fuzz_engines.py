"""The two engines of ``crossdc bench fuzz``: atheris (libFuzzer) where it is installed, and a
built-in coverage-guided loop where it is not.

Both run every target of ``crossdc.bench.fuzz_targets`` from its seeds, mutate with
``crossdc.bench.fuzz_mutate`` (atheris adds libFuzzer's own mutations), keep an input that reached
code no earlier input did, and report an :class:`EngineResult`: executions, coverage, the corpus
and the findings, one per distinct (target, kind, error, place).

- ``builtin``: one process, this one. Coverage is the set of line-to-line arcs executed in
  ``comm/`` (``sys.settrace``); an input runs under a CPU-time limit (``ITIMER_VIRTUAL``), past
  which it is a hang.
- ``atheris``: ``crossdc.bench.fuzz_atheris`` in a child process (libFuzzer ends the process it
  runs in), the ``comm`` modules instrumented; coverage is libFuzzer's (``cov``: edges,
  ``ft``: features). Findings the child catches are written as files at once; an input past the
  per-input time limit, a crash or a memory blow-up ends the child (libFuzzer keeps the input as
  an artifact), is reported, and a new child goes on with the corpus for the time left.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import random
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from crossdc.bench.fuzz_mutate import Mutator
from crossdc.bench.fuzz_seeds import tokens
from crossdc.bench.fuzz_targets import (
    Finding,
    Target,
    all_targets,
    cpu_limit,
    judge,
    warm_up,
)

MAX_INPUT_BYTES = 1 << 16
MAX_CORPUS_PER_TARGET = 256
GROUPED_FROM_S = 60.0
"""atheris runs this long or longer fuzz the target families in turn (``target_groups``)."""
COMM = str(Path(__file__).resolve().parents[2] / "comm") + os.sep


def atheris_available() -> bool:
    try:
        return importlib.util.find_spec("atheris") is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return False


@dataclass
class EngineResult:
    engine: str
    executions: int = 0
    coverage: dict[str, int] = field(default_factory=dict)
    corpus: int = 0
    per_target: dict[str, int] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    """atheris: children started again after one ended on a finding."""


# --------------------------------------------------------------------------------------------
# The built-in engine


class ArcTracer:
    """Line-to-line arcs executed in ``comm/``, as ``(file, from line, to line)``."""

    def __init__(self, root: str = COMM) -> None:
        self.root = root
        self.arcs: set[tuple[int, int, int]] = set()
        self._files: dict[str, int] = {}

    @property
    def lines(self) -> int:
        return len({(f, b) for f, _a, b in self.arcs})

    def _global(self, frame: FrameType, event: str, arg: object) -> Any:
        filename = frame.f_code.co_filename
        if not filename.startswith(self.root):
            return None
        fid = self._files.setdefault(filename, len(self._files))
        last = -frame.f_code.co_firstlineno
        arcs = self.arcs

        def local(frame: FrameType, event: str, arg: object) -> Any:
            nonlocal last
            if event == "line":
                arcs.add((fid, last, frame.f_lineno))
                last = frame.f_lineno
            elif event == "return":
                arcs.add((fid, last, -frame.f_code.co_firstlineno))
            return local

        return local

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        previous = sys.gettrace()
        sys.settrace(self._global)
        try:
            yield
        finally:
            sys.settrace(previous)


def run_builtin(
    seconds: float, *, per_input_s: float, seed: int, warm_up_s: float = 20.0
) -> EngineResult:
    """Fuzz every target in turn for ``seconds`` of wall time in this process."""
    targets = all_targets()
    rng = random.Random(seed)
    mutator = Mutator(rng, max_size=MAX_INPUT_BYTES, tokens=tokens(t.seeds() for t in targets))
    corpus = {t.name: list(t.seeds()) for t in targets}
    tracer = ArcTracer()
    found: dict[tuple[str, str, str, str], Finding] = {}
    result = EngineResult("builtin", per_target=dict.fromkeys(corpus, 0))

    def run(target: Target, data: bytes) -> bool:
        """One execution; True when it reached an arc no input reached before."""
        before = len(tracer.arcs)
        with tracer.tracing(), cpu_limit(per_input_s):
            finding = judge(target, data)
        result.executions += 1
        result.per_target[target.name] += 1
        if finding is not None:
            found.setdefault(finding.signature, finding)
        return len(tracer.arcs) > before

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the parsers warn about malformed input
        warm_up(targets, warm_up_s)
        for target in targets:  # the seeds' own coverage first
            for data in corpus[target.name]:
                run(target, data)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for target in targets:
                inputs = corpus[target.name]
                data = mutator.mutate(rng.choice(inputs), target.shape, rng.choice(inputs))
                if run(target, data) and len(inputs) < MAX_CORPUS_PER_TARGET:
                    inputs.append(data)
    result.coverage = {"arcs": len(tracer.arcs), "lines": tracer.lines}
    result.corpus = sum(len(v) for v in corpus.values())
    result.findings = [f.report() for f in found.values()]
    return result


# --------------------------------------------------------------------------------------------
# The atheris engine: a child process per libFuzzer run

_STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/", re.M)
_DONE = re.compile(r"^Done (\d+) runs", re.M)
_ARTIFACT = {"crash": "crash", "timeout": "hang", "oom": "oom", "leak": "leak", "slow": "slow"}


def target_groups(seconds: float) -> list[list[int]]:
    """Indices into ``all_targets()`` fuzzed together by one child, in turn. libFuzzer spends
    its time on the inputs with the most rare features, so one child over every target starves
    some; a long run gives each family its own share of the time."""
    targets = all_targets()
    if seconds < GROUPED_FROM_S:
        return [list(range(len(targets)))]
    families: dict[str, list[int]] = {}
    for i, t in enumerate(targets):
        family = "codec+zstd" if t.name.endswith("+zstd") else t.name.partition(":")[0]
        family = {"header": "frames", "ack": "frames", "initial_model": "tensors"}.get(
            family, family
        )
        family = {"ca_certificate": "certificate", "crl": "certificate", "zap": "certificate"}.get(
            family, family
        )
        families.setdefault(family, []).append(i)
    return list(families.values())


def write_seeds(corpus_dir: Path, group: list[int]) -> None:
    """The group's targets' seeds, prefixed with the target's place in the group (what the
    child dispatches on)."""
    corpus_dir.mkdir(parents=True, exist_ok=True)
    targets = all_targets()
    for place, index in enumerate(group):
        for i, data in enumerate(targets[index].seeds()):
            (corpus_dir / f"seed-{place:02d}-{i:02d}").write_bytes(bytes([place]) + data)


def run_atheris(seconds: float, *, per_input_s: float, seed: int, workdir: Path) -> EngineResult:
    """libFuzzer over every target for ``seconds`` (in groups, each its share of the time,
    counted from when its seeds are written: a loaded machine may take a while to build them);
    a child ended by a finding is followed by another for the group's time left, and every
    group runs at least one child (which runs the group's seeds whatever the time)."""
    result = EngineResult("atheris")
    names = [t.name for t in all_targets()]
    groups = target_groups(seconds)
    for g, group in enumerate(groups):
        gdir = workdir / f"group-{g}"
        share = seconds / len(groups)
        _run_group(result, group, share, gdir, per_input_s=per_input_s, seed=seed)
        result.findings += _child_findings(gdir / "findings")
        result.findings += _artifact_findings(gdir / "artifacts", [names[i] for i in group])
        result.corpus += sum(1 for _ in (gdir / "corpus").iterdir())
    result.coverage["groups"] = len(groups)
    return result


def _run_group(
    result: EngineResult,
    group: list[int],
    share: float,
    gdir: Path,
    *,
    per_input_s: float,
    seed: int,
) -> None:
    corpus_dir, artifacts, findings_dir = (gdir / n for n in ("corpus", "artifacts", "findings"))
    for d in (artifacts, findings_dir):
        d.mkdir(parents=True, exist_ok=True)
    write_seeds(corpus_dir, group)
    end = time.monotonic() + share
    run = 0
    group_coverage: dict[str, int] = {}
    while ((left := end - time.monotonic()) >= 1.0 or run == 0) and run < 50:
        log_path = gdir / f"libfuzzer-{run}.log"
        stats = gdir / f"stats-{run}.json"
        argv = [
            sys.executable,
            "-m",
            "crossdc.bench.fuzz_atheris",
            "--targets",
            ",".join(map(str, group)),
            "--findings",
            str(findings_dir),
            "--stats",
            str(stats),
            "--",
            str(corpus_dir),
            f"-max_total_time={max(1, int(left))}",
            f"-timeout={max(1, math.ceil(per_input_s))}",
            f"-seed={seed + run + 1}",
            f"-max_len={MAX_INPUT_BYTES}",
            "-rss_limit_mb=2048",
            f"-artifact_prefix={artifacts}{os.sep}",
            "-print_final_stats=1",
        ]
        with log_path.open("wb") as log:
            try:
                # libFuzzer ends the child at max_total_time; the bound is for a child stuck
                # before libFuzzer starts (a seed that hangs its warm-up past its limit).
                proc = subprocess.run(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    check=False,
                    timeout=max(left, 1.0) + 120,
                )
            except subprocess.TimeoutExpired:
                proc = subprocess.CompletedProcess(argv, -9)
        text = log_path.read_text(errors="replace")
        _account(result, group_coverage, text, stats)
        run += 1
        if proc.returncode == 0 and _DONE.search(text):
            break
        result.restarts += 1  # ended on a finding (or died): go on with what is left
    for key, value in group_coverage.items():  # groups instrument the same code: add them up
        result.coverage[key] = result.coverage.get(key, 0) + value


def _account(result: EngineResult, coverage: dict[str, int], text: str, stats: Path) -> None:
    """One child's executions and coverage, from libFuzzer's output and the child's stats."""
    done = _DONE.findall(text)
    status = _STATUS.findall(text)
    if done:
        result.executions += int(done[-1])
    elif status:
        result.executions += int(status[-1][0])
    if status:
        _n, cov, ft, _corp = (int(v) for v in status[-1])
        coverage["edges"] = max(cov, coverage.get("edges", 0))
        coverage["features"] = max(ft, coverage.get("features", 0))
    with contextlib.suppress(OSError, ValueError):
        per_target = json.loads(stats.read_text())["per_target"]
        for name, n in per_target.items():
            result.per_target[name] = result.per_target.get(name, 0) + int(n)


def _child_findings(findings_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(findings_dir.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(path.read_text()))
    return out


def _artifact_findings(artifacts: Path, names: list[str]) -> list[dict[str, Any]]:
    """Inputs libFuzzer kept when it ended the child: a hang, a crash, a memory blow-up."""
    out = []
    for path in sorted(artifacts.iterdir()):
        kind = _ARTIFACT.get(path.name.split("-", 1)[0])
        if kind is None:
            continue
        data = path.read_bytes()
        target = names[data[0] % len(names)] if data else "?"
        out.append(
            {
                "target": target,
                "kind": kind,
                "error": kind,
                "where": "?",
                "message": f"libFuzzer kept the input as {path.name}",
                "input_hex": data[1:513].hex(),
                "input_bytes": max(0, len(data) - 1),
            }
        )
    return out
