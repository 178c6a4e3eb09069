"""A pipelined site (2 stages under torchrun) learns like a single-process one, leaves the
federation on SIGTERM, and exits with its leader's status."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

from comm.ops.configio import dump_toml
from comm.wire.tensors import state_hash
from coordinator.file_store import FileStateStore
from site_agent.exits import EXIT_CANNOT_START, EXIT_FATAL
from tests.conftest import (
    ROOT,
    TINY_MODEL,
    Procs,
    read_status,
    wait_for,
    write_coordinator_config,
    write_site_config,
)

pytestmark = pytest.mark.timeout(300)


def _federation(procs: Procs, root: Path, stages: int) -> dict[int, float]:
    root.mkdir()
    procs.workdir = root
    # Blocking sync: with overlap the step at which a result is merged depends on timing.
    cfg = write_coordinator_config(
        root, max_rounds=2, uplink_codec="fp32", downlink_codec="fp32", overlap=False
    )
    procs.start(f"coordinator-{stages}", "coordinator", "--config", str(cfg))
    for i, site in enumerate(["eu", "us"]):
        path = write_site_config(root, site, i, 2, stages=stages, microbatches=2)
        procs.start(f"site-{site}-{stages}", "agent", "--config", str(path))
    assert procs.procs[f"coordinator-{stages}"].wait(timeout=240) == 0, procs.log(
        f"coordinator-{stages}"
    )
    for site in ("eu", "us"):
        assert procs.procs[f"site-{site}-{stages}"].wait(timeout=60) == 0, procs.log(
            f"site-{site}-{stages}"
        )
    status = read_status(root)
    assert status is not None and status["rounds_completed"] == 2
    return {int(k): v for k, v in status["val_losses"].items()}


def test_two_stage_sites_learn_like_single_process_sites(procs: Procs, tmp_path: Path) -> None:
    single = _federation(procs, tmp_path / "single", stages=1)
    piped = _federation(procs, tmp_path / "piped", stages=2)
    assert "pipeline plan: stages=2" in procs.log("site-eu-2")
    assert piped[0] == pytest.approx(single[0], rel=1e-6)  # same initial model
    assert piped[2] < 0.9 * piped[0]
    # Same samples, same math up to micro-batch summation order.
    assert piped[2] == pytest.approx(single[2], rel=2e-3)


def test_a_pipelined_site_leaves_on_sigterm_to_its_main_process(
    procs: Procs, tmp_path: Path
) -> None:
    cfg = write_coordinator_config(tmp_path, min_sites=1, max_rounds=0, num_inner_steps=4)
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    site = write_site_config(tmp_path, "eu", 0, 1, stages=2, microbatches=2)
    main = procs.start("site-eu", "agent", "--config", str(site))
    wait_for(
        lambda: (read_status(tmp_path) or {}).get("rounds_completed", 0) >= 1,
        timeout_s=200,
        what="a round",
        procs=procs,
    )
    # As systemd does with KillMode=mixed: SIGTERM to the main process alone.
    main.send_signal(signal.SIGTERM)
    assert main.wait(timeout=90) == 0, procs.log("site-eu")
    assert "stopping: stopped by signal" in procs.log("site-eu")
    wait_for(
        lambda: "left: stopped by signal" in procs.log("coordinator"),
        timeout_s=30,
        what="the coordinator to see the LEAVE",
    )


def test_a_pipelined_site_exits_with_its_leaders_status(procs: Procs, tmp_path: Path) -> None:
    # The coordinator builds θ0 of another model: the site's is refused (status 3), and
    # torchrun's own "a worker failed" must not replace that status.
    other = {**TINY_MODEL, "num_layers": TINY_MODEL["num_layers"] + 1}
    cfg = write_coordinator_config(
        tmp_path, min_sites=1, initial_model={"seed": 1234, "model": other}
    )
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    site = write_site_config(tmp_path, "eu", 0, 1, stages=2, microbatches=2)
    main = procs.start("site-eu", "agent", "--config", str(site))
    assert main.wait(timeout=200) == EXIT_FATAL, procs.log("site-eu")


def _job_site_config(
    root: Path, site: str, index: int, num_sites: int, job: dict[str, Any], **layout: Any
) -> Path:
    """A site of ``job``, without the byte GPT's own sections, which mean nothing to it."""
    path = write_site_config(root, site, index, num_sites, job=job, **layout)
    table = tomllib.loads(path.read_text())["site"]
    for key in ("model", "data", "optim", "eval_batches", "eval_batch_size"):
        table.pop(key, None)
    path.write_text(dump_toml({"site": table}))
    return path


SIDE_VALUE_JOB = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        # Every later block adds the first block's output: a later stage cannot have it.
        x = side = self.blocks[0](x)
        for block in self.blocks[1:]:
            x = block(x) + side
        return x


class Job:
    def __init__(self, seed):
        torch.manual_seed(seed)
        self.model = Model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def batches(self):
        g = torch.Generator().manual_seed(0)
        while True:
            x = torch.randn(8, 8, generator=g)
            yield x, x

    def split(self, batch):
        return batch

    def output_loss(self, out, y):
        return ((out - y) ** 2).mean()

    def loss(self, model, batch):
        return self.output_loss(model(batch[0]), batch[1])

    def evaluate(self, model):
        return {"loss": 1.0}


def make_job(ctx):
    if ctx.rank in ctx.options.get("fail_on", []):
        raise ValueError("this job refuses to be built")
    return Job(ctx.seed)
"""


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({}, "the stages of this cut do not compute the model's output"),
        ({"fail_on": [0, 1]}, "this job refuses to be built"),
        ({"fail_on": [1]}, "rank 1: site.job.factory"),
    ],
)
def test_a_pipelined_site_that_cannot_start_exits_with_the_bad_config_status(
    procs: Procs, tmp_path: Path, options: dict[str, Any], reason: str
) -> None:
    """A job the leader cannot build, or whose cut it refuses: one line naming why, and the
    status a supervisor does not restart (not torchrun's "a worker failed")."""
    (tmp_path / "shared_job.py").write_text(SIDE_VALUE_JOB)
    job = {"factory": "shared_job:make_job", "python_path": [str(tmp_path)], "options": options}
    site = _job_site_config(tmp_path, "eu", 0, 1, job, stages=2, microbatches=2)
    main = procs.start("site-eu", "agent", "--config", str(site))
    assert main.wait(timeout=200) == EXIT_CANNOT_START, procs.log("site-eu")
    lines = procs.log("site-eu").splitlines()
    assert any("crossdc agent: cannot start: " in line and reason in line for line in lines)
    assert "]: Traceback" not in procs.log("site-eu")  # no rank's; torchrun reports a failed rank


HF_OPTIONS = {
    "config": {"num_hidden_layers": 2, "max_position_embeddings": 32},
    "data": {"num_shards": 3, "max_bytes": 200_000},
    "context_len": 16,
    "batch_size": 8,
    "eval_batches": 2,
    "eval_batch_size": 8,
    "warmup_steps": 2,
}


LIBRARY_FSDP_HF = """
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import crossdc
from site_agent.config import load_site_config
from site_agent.jobs.contract import JobContext, build_job

dist.init_process_group("gloo")
cfg = load_site_config(sys.argv[1])
context = JobContext(
    site_id=cfg.site_id,
    seed=cfg.seed,
    device=torch.device("cpu"),
    options=cfg.job.options,
    state_dir=cfg.state_path,
)
job = build_job(cfg.job.factory, context, cfg.job.python_path)
model = job.model
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
fed = crossdc.Federation(cfg, model, optimizer, evaluate=job.evaluate, architecture=job.architecture)
with fed:
    while not fed.finished:
        for batch in job.batches():
            if fed.finished:
                break
            loss = job.loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
print(f"rank {dist.get_rank()}: exit code {fed.exit_code}", flush=True)
dist.destroy_process_group()
os._exit(0)
"""


def test_four_layouts_of_one_hugging_face_job_federate(procs: Procs, tmp_path: Path) -> None:
    """One process, 2 stages (1F1B), 2 stages x 2 FSDP replicas (GPipe), and the job's model
    under FSDP2 over 2 ranks in library mode under torchrun (a script of the team's, syncing
    shard by shard): the same job, one federation of 5 rounds, every site ends on the
    coordinator's model."""
    cfg = write_coordinator_config(
        tmp_path,
        min_sites=4,
        max_rounds=5,
        num_inner_steps=4,
        uplink_codec="fp32",
        downlink_codec="fp32",
        overlap=False,
    )
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    layouts = {
        "one": {},
        "two": {"stages": 2, "microbatches": 2, "schedule": "1f1b"},
        "four": {
            "stages": 2,
            "replicas": 2,
            "microbatches": 2,
            "schedule": "gpipe",
            "data_parallel": "fsdp",
        },
    }
    for i, (site, layout) in enumerate([*layouts.items(), ("lib", {})]):
        options = {**HF_OPTIONS, "data": {**HF_OPTIONS["data"], "shard_index": i % 3}}
        job = {"factory": "site_agent.jobs.hf:make_job", "options": options}
        path = _job_site_config(tmp_path, site, i, 4, job, **layout)
        if site != "lib":
            procs.start(f"site-{site}", "agent", "--config", str(path))
    (tmp_path / "train_fsdp_hf.py").write_text(LIBRARY_FSDP_HF)
    with (tmp_path / "site-lib.log").open("wb") as log:
        lib = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            + [str(tmp_path / "train_fsdp_hf.py"), str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            cwd=tmp_path,
            start_new_session=True,
        )
        try:
            assert procs.procs["coordinator"].wait(timeout=500) == 0, procs.log("coordinator")
            for site in layouts:
                assert procs.procs[f"site-{site}"].wait(timeout=60) == 0, procs.log(f"site-{site}")
            assert lib.wait(timeout=60) == 0, procs.log("site-lib")
        finally:
            # torchrun starts each worker in a session of its own: kill them by id too.
            for pid in [*_descendants(lib.pid), lib.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            lib.wait()
    assert "rank 0: exit code 0" in procs.log("site-lib"), procs.log("site-lib")
    assert "pipeline plan: stages=2 replicas=2 schedule=gpipe" in procs.log("site-four")
    assert "microbatches=2 data_parallel=fsdp" in procs.log("site-four")
    status = read_status(tmp_path)
    assert status is not None and status["rounds_completed"] == 5
    assert all(sorted(h["merged"]) == ["four", "lib", "one", "two"] for h in status["history"])
    vals = {int(k): v for k, v in status["val_losses"].items()}
    assert vals[5] < vals[0], vals
    state = FileStateStore(tmp_path / "coordinator").load()
    assert state is not None and state.global_version == 5
    final = state_hash(state.params)
    ckpt = torch.load(tmp_path / "site-one" / "checkpoint.pt", weights_only=True)
    params = {k: v.numpy() for k, v in ckpt["global_params"].items()}
    assert (int(ckpt["global_version"]), state_hash(params)) == (5, final)
    # The pipelined sites sync stage by stage, as the library-mode FSDP site shard by shard:
    # none holds the model; each checks the hash of the ranks' rows of a result before taking
    # it, and checkpoints its ranks' rows.
    for site in ("two", "four", "lib"):
        sharded = json.loads((tmp_path / f"site-{site}" / "status.json").read_text())
        assert (sharded["global_version"], sharded["state_hash"]) == (5, final), site
        meta = json.loads((tmp_path / f"site-{site}" / "checkpoint.json").read_text())
        assert meta["global_version"] == 5, site


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from /proc."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out += [child, *_descendants(child)]
    return out


def test_a_killed_pipelined_site_resumes_from_its_checkpoint(procs: Procs, tmp_path: Path) -> None:
    cfg = write_coordinator_config(tmp_path, min_sites=1, max_rounds=8, num_inner_steps=4)
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    # Half a second a step: the federation is still running when the site is killed.
    site = write_site_config(tmp_path, "eu", 0, 1, stages=2, microbatches=2, fault_slow_step_s=0.5)
    first = procs.start("site-eu-1", "agent", "--config", str(site))
    checkpoint = tmp_path / "site-eu" / "checkpoint.json"  # names the ranks' checkpoint
    wait_for(
        lambda: (
            checkpoint.exists() and (read_status(tmp_path) or {}).get("rounds_completed", 0) >= 1
        ),
        timeout_s=200,
        what="a round and a checkpoint",
        procs=procs,
    )
    # The agent, torchrun (in a session of its own) and every rank at once, as a lost host would.
    for pid in [first.pid, *_descendants(first.pid)]:
        os.kill(pid, signal.SIGKILL)
    first.wait(timeout=30)
    version = int(json.loads(checkpoint.read_text())["global_version"])
    assert version >= 1
    second = procs.start("site-eu-2", "agent", "--config", str(site))
    assert second.wait(timeout=240) == 0, procs.log("site-eu-2")
    log = procs.log("site-eu-2")
    assert f"resumed from checkpoint at v{version}" in log
    # The restart cut the job as the first start did, so every rank took its optimizer state.
    assert "cutting as the last start did" in log and "starts afresh" not in log, log
    assert procs.procs["coordinator"].wait(timeout=60) == 0, procs.log("coordinator")
    status = read_status(tmp_path)
    assert status is not None and status["rounds_completed"] == 8


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def test_a_site_agent_killed_outright_takes_torchrun_and_its_ranks_with_it(
    procs: Procs, tmp_path: Path
) -> None:
    cfg = write_coordinator_config(tmp_path, min_sites=1, max_rounds=50, num_inner_steps=4)
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    site = write_site_config(tmp_path, "eu", 0, 1, stages=2, microbatches=2, fault_slow_step_s=0.5)
    agent = procs.start("site-eu", "agent", "--config", str(site))
    # torchrun and its two ranks (each rank may have helper children of its own).
    wait_for(
        lambda: len(_descendants(agent.pid)) >= 3,
        timeout_s=120,
        what="torchrun and both ranks",
        procs=procs,
    )
    below = _descendants(agent.pid)
    os.kill(agent.pid, signal.SIGKILL)  # the agent alone, as the OOM killer would
    agent.wait(timeout=30)
    try:
        wait_for(
            lambda: not any(map(_running, below)),
            timeout_s=90,
            what="torchrun and its ranks to exit after their agent was killed",
        )
    finally:
        for pid in filter(_running, below):
            os.kill(pid, signal.SIGKILL)
