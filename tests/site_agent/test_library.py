"""Library mode as a team meets it: its own training script (docs/examples/train_loop.py), its
loop unchanged but for the ``with crossdc.Federation(...)`` block, federated beside two
``crossdc agent`` sites that run the same model as a job; all three end on the coordinator's
model."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from comm.ops.configio import dump_toml
from comm.wire.tensors import state_hash
from coordinator.file_store import FileStateStore
from tests.conftest import ROOT, Procs, read_status, wait_for, write_coordinator_config

pytestmark = pytest.mark.timeout(240)

EXAMPLES = ROOT / "docs" / "examples"


def _site(tmp_path: Path, jobs: Path, site_id: str, centre: float) -> Path:
    table: dict[str, Any] = {
        "site_id": site_id,
        "coordinator_endpoint_file": str(tmp_path / "coordinator" / "endpoint.json"),
        "state_dir": str(tmp_path / f"site-{site_id}"),
        "num_threads": 1,
        "device": "cpu",
        "security": {"insecure": True},
        "job": {
            "factory": "regression_job:make_job",
            "python_path": [str(jobs)],
            "options": {"centre": centre},
        },
    }
    path = tmp_path / f"site-{site_id}.toml"
    path.write_text(dump_toml({"site": table}))
    return path


def _hash_of_checkpoint(path: Path) -> tuple[int, str]:
    ckpt = torch.load(path, weights_only=True)
    params = {k: v.numpy() for k, v in ckpt["global_params"].items()}
    return int(ckpt["global_version"]), state_hash(params)


def test_a_plain_script_federates_beside_two_agents(procs: Procs, tmp_path: Path) -> None:
    jobs = tmp_path / "user"
    jobs.mkdir()
    for name in ("regression_job.py", "train_loop.py"):
        shutil.copy(EXAMPLES / name, jobs / name)
    script = (jobs / "train_loop.py").read_text()
    assert len(script.splitlines()) < 40
    cfg = write_coordinator_config(
        tmp_path, min_sites=3, num_inner_steps=16, max_rounds=3, eval_every_rounds=1
    )
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    procs.start("site-eu", "agent", "--config", str(_site(tmp_path, jobs, "eu", -1.0)))
    procs.start("site-us", "agent", "--config", str(_site(tmp_path, jobs, "us", 1.0)))
    log = (tmp_path / "script.log").open("wb")
    try:
        script_proc = subprocess.Popen(
            [sys.executable, "train_loop.py", str(_site(tmp_path, jobs, "lib", 0.0))],
            cwd=jobs,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            start_new_session=True,
        )
        try:
            assert script_proc.wait(timeout=200) == 0, (tmp_path / "script.log").read_text()
        finally:
            if script_proc.poll() is None:
                script_proc.send_signal(signal.SIGKILL)
                script_proc.wait()
    finally:
        log.close()
    assert procs.procs["coordinator"].wait(timeout=60) == 0, procs.log("coordinator")
    for name in ("site-eu", "site-us"):
        assert procs.procs[name].wait(timeout=60) == 0, procs.log(name)
    status = read_status(tmp_path)
    assert status is not None and status["rounds_completed"] == 3
    assert all(sorted(h["merged"]) == ["eu", "lib", "us"] for h in status["history"])
    vals = {int(k): v for k, v in status["val_losses"].items()}
    assert vals[3] < vals[0], vals
    state = FileStateStore(tmp_path / "coordinator").load()
    assert state is not None and state.global_version == 3
    final = state_hash(state.params)
    for site_id in ("eu", "us", "lib"):
        assert _hash_of_checkpoint(tmp_path / f"site-{site_id}" / "checkpoint.pt") == (3, final)
    assert "exit code 0" in (tmp_path / "script.log").read_text()


DDP_SCRIPT = """
import os
import sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import crossdc
from regression_job import make_data, make_model

dist.init_process_group("gloo")
rank = dist.get_rank()
model = make_model(seed=1234)
ddp = DDP(model)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
x, y = make_data(seed=5 + rank, centre=0.5, n=512)
with crossdc.Federation(sys.argv[1], model, optimizer) as fed:
    for step in range(1_000_000):
        if fed.finished:
            break
        i = (step * 32) % len(x)
        loss = ((ddp(x[i : i + 32]).squeeze(-1) - y[i : i + 32]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
state = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = [torch.zeros_like(state) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, state)
# One file per rank: two ranks printing to one shared pipe can interleave their lines.
with open(f"result-{rank}.txt", "w") as out:
    out.write(f"rank {rank} steps {step} same {all(torch.equal(g, state) for g in gathered)}")
del ddp  # the DDP reducer goes while its process group is alive
dist.destroy_process_group()
# Skip interpreter finalization: gloo's worker threads can still hold tensors then, and torch
# 2.13 may abort a finished process there ("terminate called without an active exception").
os._exit(0)
"""


def test_under_torchrun_rank_0_talks_and_the_other_ranks_follow(
    procs: Procs, tmp_path: Path
) -> None:
    jobs = tmp_path / "user"
    jobs.mkdir()
    shutil.copy(EXAMPLES / "regression_job.py", jobs / "regression_job.py")
    (jobs / "train_ddp.py").write_text(DDP_SCRIPT)
    cfg = write_coordinator_config(tmp_path, min_sites=2, num_inner_steps=12, max_rounds=3)
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    procs.start("site-eu", "agent", "--config", str(_site(tmp_path, jobs, "eu", -1.0)))
    # Its own process group: on a timeout torchrun's workers go with it, not on as orphans.
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + ["train_ddp.py", str(_site(tmp_path, jobs, "lib", 0.0))],
        cwd=jobs,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    try:
        output, _ = torchrun.communicate(timeout=200)
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.communicate()
    assert torchrun.returncode == 0, output
    assert procs.procs["coordinator"].wait(timeout=60) == 0, procs.log("coordinator")
    lines = [(jobs / f"result-{rank}.txt").read_text() for rank in (0, 1)]
    assert len(lines) == 2 and all(line.endswith("same True") for line in lines), lines
    assert lines[0].split()[3] == lines[1].split()[3]  # both ranks stopped at the same step
    status = read_status(tmp_path)
    assert status is not None and status["rounds_completed"] == 3
    assert all(sorted(h["merged"]) == ["eu", "lib"] for h in status["history"])
    state = FileStateStore(tmp_path / "coordinator").load()
    assert state is not None
    assert _hash_of_checkpoint(tmp_path / "site-lib" / "checkpoint.pt") == (
        3,
        state_hash(state.params),
    )


def _start_torchrun(
    jobs: Path, script: str, site: Path, *args: str, ranks: int = 2, out: Any = subprocess.PIPE
) -> subprocess.Popen[Any]:
    """``script`` (in ``jobs``) started under torchrun on ``ranks`` CPU ranks, in a session of
    its own, its output to ``out`` (a pipe of text by default)."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        + [script, str(site), *args],
        cwd=jobs,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=out is subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )


def _torchrun(
    jobs: Path, script: str, site: Path, timeout_s: float, *args: str, ranks: int = 2
) -> tuple[int, str]:
    """``script`` under torchrun on ``ranks`` CPU ranks; its exit code and output."""
    proc = _start_torchrun(jobs, script, site, *args, ranks=ranks)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: kill them by id too.
        for pid in [*_descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return -1, output
    return proc.returncode, output


def _descendants(pid: int) -> list[int]:
    """The ids of ``pid``'s child processes and theirs (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def test_an_fsdp_loop_under_torchrun_syncs_shard_by_shard(procs: Procs, tmp_path: Path) -> None:
    """docs/examples/train_fsdp.py as it is (FSDP2 over 2 gloo ranks) beside a ``crossdc
    agent`` site: 3 rounds with int8 updates (error feedback on each rank's rows), every site ends on the coordinator's model, the
    sharded site's hash computed over its ranks' shards; its checkpoint is one
    torch.distributed.checkpoint directory of both ranks' shards."""
    jobs = tmp_path / "user"
    jobs.mkdir()
    for name in ("regression_job.py", "train_fsdp.py"):
        shutil.copy(EXAMPLES / name, jobs / name)
    cfg = write_coordinator_config(
        tmp_path,
        min_sites=2,
        num_inner_steps=12,
        max_rounds=3,
        eval_every_rounds=1,
        uplink_codec="int8",
    )
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    procs.start("site-eu", "agent", "--config", str(_site(tmp_path, jobs, "eu", -1.0)))
    code, output = _torchrun(jobs, "train_fsdp.py", _site(tmp_path, jobs, "lib", 0.0), 150)
    assert code == 0, output
    assert "rank 0: done" in output and "rank 1: done" in output, output
    assert procs.procs["coordinator"].wait(timeout=60) == 0, procs.log("coordinator")
    assert procs.procs["site-eu"].wait(timeout=60) == 0, procs.log("site-eu")
    status = read_status(tmp_path)
    assert status is not None and status["rounds_completed"] == 3
    assert all(sorted(h["merged"]) == ["eu", "lib"] for h in status["history"])
    state = FileStateStore(tmp_path / "coordinator").load()
    assert state is not None and state.global_version == 3
    final = state_hash(state.params)
    assert _hash_of_checkpoint(tmp_path / "site-eu" / "checkpoint.pt") == (3, final)
    lib = json.loads((tmp_path / "site-lib" / "status.json").read_text())
    assert (lib["global_version"], lib["state_hash"]) == (3, final)
    meta = json.loads((tmp_path / "site-lib" / "checkpoint.json").read_text())
    assert meta["global_version"] == 3
    written = sorted(p.name for p in (tmp_path / "site-lib" / meta["dir"]).iterdir())
    assert written == [".metadata", "__0_0.distcp", "__1_0.distcp"], written


FSDP_RESTART = """
import logging
import os
import sys
import torch
import torch.distributed as dist
from regression_job import make_data, make_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import crossdc

logging.basicConfig(level=logging.INFO)  # the agent's log, for a failure's message
dist.init_process_group("gloo")
rank = dist.get_rank()
model = make_model(seed=1234)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
fully_shard(model[0], mesh=mesh)
fully_shard(model[2], mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
x, y = make_data(seed=5 + rank, centre=0.5, n=512)
steps = int(sys.argv[2])  # the loop ends on its own after this many steps
fed = crossdc.Federation(sys.argv[1], model, optimizer)
with fed:
    for step in range(steps):
        if fed.finished:
            break
        i = (step * 32) % len(x)
        loss = ((model(x[i : i + 32]).squeeze(-1) - y[i : i + 32]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print(f"rank {rank}: left at step {step}, finished {fed.finished}", flush=True)
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.parametrize("ranks_after", [2, 1])
def test_a_sharded_site_that_left_resumes_from_its_shards(
    procs: Procs, tmp_path: Path, ranks_after: int
) -> None:
    """An FSDP loop over 2 ranks that ends on its own mid-federation leaves (LEAVE, a checkpoint
    of every rank's shards); started again, on 2 ranks or on 1 (another layout: the checkpoint
    reshards), it resumes from them (the version and hash it saved, the optimizer's moments
    too), joins at the version it saved and trains to the end on the coordinator's hash."""
    jobs = tmp_path / "user"
    jobs.mkdir()
    shutil.copy(EXAMPLES / "regression_job.py", jobs / "regression_job.py")
    (jobs / "train.py").write_text(FSDP_RESTART)
    cfg = write_coordinator_config(tmp_path, min_sites=2, num_inner_steps=12, max_rounds=4)
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    procs.start("site-eu", "agent", "--config", str(_site(tmp_path, jobs, "eu", -1.0)))
    site = _site(tmp_path, jobs, "lib", 0.0)
    code, output = _torchrun(jobs, "train.py", site, 150, "30")
    assert code == 0 and "the training loop ended: leaving" in output, output
    assert output.count("left at step 29") == 2, output
    meta = json.loads((tmp_path / "site-lib" / "checkpoint.json").read_text())
    saved = meta["global_version"]
    assert 1 <= saved <= 2, meta
    wait_for(
        lambda: "site=lib" in procs.log("coordinator") and "left" in procs.log("coordinator"),
        timeout_s=30,
        what="the coordinator to see lib leave",
    )
    code, output = _torchrun(jobs, "train.py", site, 150, "1000000", ranks=ranks_after)
    assert code == 0 and output.count("finished True") == ranks_after, output
    assert procs.procs["coordinator"].wait(timeout=60) == 0, procs.log("coordinator")
    coord = procs.log("coordinator")
    # The version it saved (a result that landed as the loop ended is caught up by the
    # coordinator's deltas).
    assert f"[coordinator site=lib] joined version={saved} " in coord, coord
    state = FileStateStore(tmp_path / "coordinator").load()
    assert state is not None and state.global_version > saved
    lib = json.loads((tmp_path / "site-lib" / "status.json").read_text())
    final = (state.global_version, state_hash(state.params))
    assert (lib["global_version"], lib["state_hash"]) == final


def test_sigterm_drains_a_sharded_site_and_sends_leave(procs: Procs, tmp_path: Path) -> None:
    """SIGTERM to torchrun (which passes it to every rank) while an FSDP loop federates: rank 0's
    agent leaves between two steps (LEAVE, a checkpoint of every rank's shards), every rank's
    loop ends on ``fed.finished`` and the script goes on after its ``with`` block."""
    jobs = tmp_path / "user"
    jobs.mkdir()
    shutil.copy(EXAMPLES / "regression_job.py", jobs / "regression_job.py")
    (jobs / "train.py").write_text(FSDP_RESTART)
    cfg = write_coordinator_config(tmp_path, min_sites=2, num_inner_steps=12, max_rounds=50)
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    procs.start("site-eu", "agent", "--config", str(_site(tmp_path, jobs, "eu", -1.0)))
    site = _site(tmp_path, jobs, "lib", 0.0)
    with (tmp_path / "lib.log").open("wb") as log:
        lib = _start_torchrun(jobs, "train.py", site, "1000000", out=log)
        try:
            # The site itself holds v1 (a round the coordinator closed may still be on its way
            # to it), so the checkpoint its drain writes must name v1 or later.
            wait_for(
                lambda: _site_version(tmp_path / "site-lib") >= 1,
                timeout_s=120,
                what="the site on v1",
                procs=procs,
            )
            lib.send_signal(signal.SIGTERM)
            lib.wait(timeout=60)
        finally:
            for pid in [*_descendants(lib.pid), lib.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            lib.wait()
    output = (tmp_path / "lib.log").read_text()
    assert "[site=lib] stopping: SIGTERM" in output, output
    assert output.count("finished True") == 2, output
    assert "[coordinator site=lib] left: SIGTERM" in procs.log("coordinator")
    meta = json.loads((tmp_path / "site-lib" / "checkpoint.json").read_text())
    assert meta["global_version"] >= 1


def _site_version(state_dir: Path) -> int:
    """The version a site's status names (-1: no status yet, or one being written)."""
    try:
        return int(json.loads((state_dir / "status.json").read_text())["global_version"])
    except (OSError, ValueError, KeyError):
        return -1


def _saved(state_dir: Path) -> int:
    """The version a sharded site's checkpoint record names (-1: none yet)."""
    try:
        return int(json.loads((state_dir / "checkpoint.json").read_text())["global_version"])
    except (OSError, ValueError, KeyError):
        return -1


def test_a_killed_sharded_site_resumes_from_its_shards(procs: Procs, tmp_path: Path) -> None:
    """SIGKILL to the ranks of an FSDP loop once its shards of a version are saved (no LEAVE,
    no drain): torchrun started again with the same layout resumes from them (the version it
    saved, not θ0), joins at that version and trains to the end on the coordinator's hash."""
    jobs = tmp_path / "user"
    jobs.mkdir()
    shutil.copy(EXAMPLES / "regression_job.py", jobs / "regression_job.py")
    (jobs / "train.py").write_text(FSDP_RESTART)
    cfg = write_coordinator_config(tmp_path, min_sites=2, num_inner_steps=12, max_rounds=4)
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    procs.start("site-eu", "agent", "--config", str(_site(tmp_path, jobs, "eu", -1.0)))
    site = _site(tmp_path, jobs, "lib", 0.0)
    state_dir = tmp_path / "site-lib"
    with (tmp_path / "lib-killed.log").open("wb") as log:
        lib = _start_torchrun(jobs, "train.py", site, "1000000", out=log)
        try:
            wait_for(
                lambda: _saved(state_dir) >= 1,
                timeout_s=120,
                what="lib's shards of v1 saved",
                procs=procs,
            )
            workers = _descendants(lib.pid)
            assert workers, "torchrun's workers"
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            lib.wait(timeout=60)  # torchrun sees its workers die and gives up
        finally:
            for pid in [*_descendants(lib.pid), lib.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            lib.wait()
    killed = (tmp_path / "lib-killed.log").read_text()
    assert "finished True" not in killed and "stopping" not in killed, killed
    saved = _saved(state_dir)  # read after the kill: a save under way then did not count
    assert saved >= 1
    assert "site=lib] left" not in procs.log("coordinator")
    code, output = _torchrun(jobs, "train.py", site, 180, "1000000")
    assert code == 0 and output.count("finished True") == 2, output
    assert f"[site=lib] resumed from checkpoint at v{saved}" in output, output
    assert procs.procs["coordinator"].wait(timeout=60) == 0, procs.log("coordinator")
    coord = procs.log("coordinator")
    assert f"[coordinator site=lib] joined version={saved} " in coord, coord
    state = FileStateStore(tmp_path / "coordinator").load()
    assert state is not None and state.global_version > saved
    lib_status = json.loads((state_dir / "status.json").read_text())
    final = (state.global_version, state_hash(state.params))
    assert (lib_status["global_version"], lib_status["state_hash"]) == final


@pytest.mark.timeout(60)
def test_a_script_whose_model_differs_is_told_why_instead_of_training(
    procs: Procs, tmp_path: Path
) -> None:
    import torch.nn as nn

    import crossdc

    jobs = tmp_path / "user"
    jobs.mkdir()
    shutil.copy(EXAMPLES / "regression_job.py", jobs / "regression_job.py")
    cfg = write_coordinator_config(tmp_path, min_sites=2, max_rounds=1)
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    procs.start("site-eu", "agent", "--config", str(_site(tmp_path, jobs, "eu", 0.0)))
    wait_for(lambda: "initial model" in procs.log("coordinator"), timeout_s=60, what="θ0")
    model = nn.Sequential(nn.Linear(8, 17), nn.Tanh(), nn.Linear(17, 1))  # not the job's shape
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="exit code 3"):  # noqa: SIM117
        with crossdc.Federation(_site(tmp_path, jobs, "lib", 0.0), model, optimizer):
            pytest.fail("a site the coordinator refused must not train")


@pytest.mark.parametrize("evaluates", [True, False])
def test_a_loop_says_at_its_join_whether_it_can_evaluate(tmp_path: Path, evaluates: bool) -> None:
    import crossdc
    from site_agent.session import SiteIdentity

    table = {
        "site_id": "a",
        "coordinator_endpoint_file": str(tmp_path / "endpoint.json"),
        "state_dir": str(tmp_path / "site-a"),
        "security": {"insecure": True},
        "job": {"factory": "regression_job:make_job", "python_path": [str(EXAMPLES)]},
    }
    model = torch.nn.Linear(2, 1)
    evaluate = (lambda m: {"loss": 0.0}) if evaluates else None
    fed = crossdc.Federation(table, model, torch.optim.SGD(model.parameters()), evaluate=evaluate)
    assert SiteIdentity.of(fed.config, fed.trainer).capabilities["evaluates"] is evaluates
