"""A real federation on a coordinator of two shards: ``torchrun --nproc-per-node 2 -m crossdc
coordinator`` (rank = shard) and three site agents of the byte GPT, each with one channel per
shard, in secure mode (a kit: CURVE on every channel, the shards' control channel included,
signed checkpoints and results). It trains to the end, and its final parameters (shard 0's and
shard 1's tensors together) are those of one coordinator process on the same job, bit for
bit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from comm.ops.configio import dump_toml
from crossdc.demo_roles import make_kits
from crossdc.progress_view import read_status

pytestmark = pytest.mark.timeout(400)

MODEL = {"context_len": 32, "num_layers": 1, "d_model": 32, "num_heads": 2}
SITES = ("eu", "us", "ap")
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _coordinator_config(work: Path, shards: int) -> Path:
    doc: dict[str, Any] = {
        "coordinator": {
            "bind": "tcp://127.0.0.1:0",
            "state_dir": str(work / "coord"),
            "metrics_port": 0,
            "min_sites": len(SITES),
            "num_inner_steps": 4,
            "max_rounds": 3,
            "uplink_codec": "int8",
            "downlink_codec": "int8",
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "outer_warmup_steps": 0,
            "overlap": False,
            "align_arrivals": False,
            "round_deadline_s": 120.0,
            "site_timeout_s": 60.0,
            "keep_checkpoints": 2,
            "shards": shards,
            "shard_control_bind": f"tcp://127.0.0.1:{_free_port()}",
            "initial_model": {"seed": 1234, "model": MODEL},
            "security": {"kit_dir": str(work / "kit")},
        }
    }
    path = work / "coordinator.toml"
    path.write_text(dump_toml(doc))
    return path


def _site_config(work: Path, index: int, endpoints: list[str]) -> Path:
    site_id = SITES[index]
    doc: dict[str, Any] = {
        "site": {
            "site_id": site_id,
            "coordinator": endpoints[0],
            "state_dir": str(work / f"site-{site_id}"),
            "seed": 1234,
            "num_threads": 1,
            "device": "cpu",
            "eval_batches": 2,
            "eval_batch_size": 8,
            "data": {"source": "stdlib", "shard_index": index, "num_shards": len(SITES)},
            "model": MODEL,
            "optim": {"batch_size": 4},
            "security": {"kit_dir": str(work / f"kit-{site_id}")},
        }
    }
    if len(endpoints) > 1:
        doc["site"]["coordinator_shards"] = endpoints
    path = work / f"site-{site_id}.toml"
    path.write_text(dump_toml(doc))
    return path


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _federation(work: Path, shards: int) -> dict[str, np.ndarray]:
    """Run the federation to its end; the final parameters, every shard's together."""
    work.mkdir(parents=True)
    make_kits(work, list(SITES))
    config = _coordinator_config(work, shards)
    argv = ["-m", "crossdc", "coordinator", "--config", str(config)]
    if shards > 1:
        argv = [
            str(TORCHRUN),
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(shards),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            *argv,
        ]
    else:
        argv = [sys.executable, *argv]
    dirs = [work / "coord"] if shards == 1 else [work / "coord" / f"shard-{i}" for i in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        log = open(work / "coordinator.log", "wb")  # noqa: SIM115
        logs.append(log)
        coord = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(coord)
        endpoints = []
        for d in dirs:
            deadline = time.monotonic() + 120
            while (status := read_status(d / "endpoint.json")) is None:
                assert coord.poll() is None, (work / "coordinator.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"no {d / 'endpoint.json'}"
                time.sleep(0.1)
            endpoints.append(str(status["endpoint"]))
        sites = []
        for i, site_id in enumerate(SITES):
            log = open(work / f"site-{site_id}.log", "wb")  # noqa: SIM115
            logs.append(log)
            path = _site_config(work, i, endpoints)
            sites.append(
                subprocess.Popen(
                    [sys.executable, "-m", "crossdc", "agent", "--config", str(path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            procs.append(sites[-1])
        assert coord.wait(timeout=300) == 0, (work / "coordinator.log").read_text()[-3000:]
        for site_id, site in zip(SITES, sites, strict=True):
            assert site.wait(timeout=60) == 0, (work / f"site-{site_id}.log").read_text()[-3000:]
    finally:
        for proc in procs:
            _stop(proc)
        for log in logs:
            log.close()
    params: dict[str, np.ndarray] = {}
    for d in dirs:
        meta = json.loads((d / "meta.json").read_text())
        assert meta["global_version"] == 3
        with np.load(d / meta["file"]) as npz:
            for key in npz.files:
                if key.startswith("p/"):
                    assert key[2:] not in params
                    params[key[2:]] = npz[key].copy()
    if shards > 1:
        for site_id in SITES:
            text = (work / f"site-{site_id}.log").read_text()
            assert "asking for the model" not in text  # every result came in order
            assert "not loaded" not in text  # every result's signature checked out
            assert "now at v3" in text
    return params


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
def test_two_shards_under_torchrun_train_to_one_coordinators_parameters(tmp_path: Path) -> None:
    single = _federation(tmp_path / "single", 1)
    sharded = _federation(tmp_path / "sharded", 2)
    assert sorted(sharded) == sorted(single)
    differ = [k for k in single if sharded[k].tobytes() != single[k].tobytes()]
    assert differ == []
    from site_agent.jobs.bytegpt.model import ModelConfig, initial_parameters

    theta0 = initial_parameters(ModelConfig(**MODEL), 1234)
    assert all(single[k].tobytes() != np.asarray(theta0[k]).tobytes() for k in theta0)
