"""A sharded coordinator's processes: which shard each is (from --shard, CROSSDC_SHARD,
torchrun's RANK, a StatefulSet pod's ordinal) and the config each shard runs with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from comm.security.rolekits import SecurityConfig
from coordinator.config import CoordinatorConfig
from coordinator.sharding import (
    ShardIdentity,
    bind_port,
    control_endpoint,
    own_part,
    resolve,
    shard_config,
)
from crossdc.cli_common import EXIT_BAD_CONFIG
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(60)

_INSECURE = SecurityConfig(insecure=True)


def _cfg(**kw: object) -> CoordinatorConfig:
    return CoordinatorConfig(security=_INSECURE, **kw)  # type: ignore[arg-type]


def test_one_shard_is_shard_zero_and_runs_its_config_unchanged() -> None:
    identity = resolve(1, None, {})
    assert identity == ShardIdentity(0, 1, "single")
    assert identity.leader
    cfg = _cfg()
    assert shard_config(cfg, identity) is cfg


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        ("2", {}, ShardIdentity(2, 4, "--shard")),
        ("ordinal", {}, ShardIdentity(3, 4, "--shard ordinal")),
        (None, {"CROSSDC_SHARD": "1"}, ShardIdentity(1, 4, "CROSSDC_SHARD")),
        (None, {"CROSSDC_SHARD": "ordinal"}, ShardIdentity(3, 4, "CROSSDC_SHARD ordinal")),
        (None, {"RANK": "3", "WORLD_SIZE": "4"}, ShardIdentity(3, 4, "torchrun RANK")),
        ("0", {"RANK": "3", "WORLD_SIZE": "4"}, ShardIdentity(0, 4, "--shard")),
    ],
)
def test_a_shard_is_read_from_the_flag_the_environment_or_torchrun(
    flag: str | None, env: dict[str, str], expected: ShardIdentity
) -> None:
    assert resolve(4, flag, env, hostname=lambda: "crossdc-coordinator-3") == expected


@pytest.mark.parametrize(
    ("shards", "flag", "env", "message"),
    [
        (2, None, {}, "say which shard this process is"),
        (2, "2", {}, r"--shard = 2 is not a shard of coordinator.shards = 2 \(0 to 1\)"),
        (2, "-1", {}, "is not a shard"),
        (2, "x", {}, "--shard must be a shard number or 'ordinal', got 'x'"),
        (2, "ordinal", {}, "does not end in -N"),
        (2, None, {"RANK": "0", "WORLD_SIZE": "3"}, r"torchrun started 3 processes"),
        (1, None, {"RANK": "0", "WORLD_SIZE": "2"}, r"torchrun started 2 processes"),
        (2, None, {"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE must be an integer"),
    ],
)
def test_a_shard_that_does_not_fit_is_refused_in_words(
    shards: int, flag: str | None, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(shards, flag, env, hostname=lambda: "coordinator")


def test_shards_on_one_host_get_their_own_state_endpoint_and_http_port() -> None:
    cfg = _cfg(
        shards=3, bind="tcp://0.0.0.0:7710", metrics_port=9710, state_dir="/var/lib/c/coord/"
    )
    got = [shard_config(cfg, ShardIdentity(i, 3, "--shard")) for i in range(3)]
    assert [c.bind for c in got] == [f"tcp://0.0.0.0:{7710 + i}" for i in range(3)]
    assert [c.metrics_port for c in got] == [9710, 9711, 9712]
    assert [c.state_dir for c in got] == [f"/var/lib/c/coord/shard-{i}" for i in range(3)]
    assert [bind_port(c.bind) for c in got] == [7710, 7711, 7712]


def test_shards_on_their_own_hosts_keep_the_ports() -> None:
    cfg = _cfg(shards=2, shard_ports="same", metrics_port=9710, state_dir="/data")
    one = shard_config(cfg, ShardIdentity(1, 2, "--shard ordinal"))
    assert (one.bind, one.metrics_port, one.state_dir) == (cfg.bind, 9710, "/data/shard-1")


def test_free_ports_ipc_names_and_no_http_stay_distinct_per_shard() -> None:
    cfg = _cfg(shards=2, bind="tcp://127.0.0.1:0", metrics_port=0)
    one = shard_config(cfg, ShardIdentity(1, 2, "--shard"))
    assert (one.bind, one.metrics_port) == ("tcp://127.0.0.1:0", 0)
    ipc = shard_config(_cfg(shards=2, bind="ipc:///run/c.sock"), ShardIdentity(1, 2, "--shard"))
    assert ipc.bind == "ipc:///run/c.sock-shard1"
    assert bind_port(ipc.bind) is None


def test_a_shard_of_another_count_is_refused() -> None:
    with pytest.raises(ValueError, match="shard 0 of 2, but coordinator.shards = 3"):
        shard_config(_cfg(shards=3), ShardIdentity(0, 2, "--shard"))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"shards": 0}, "coordinator.shards must be an integer >= 1, got 0"),
        ({"shards": True}, "coordinator.shards must be an integer >= 1, got True"),
        ({"shards": 2, "shard_ports": "next"}, "shard_ports must be 'offset' or 'same'"),
        ({"shards": 8, "bind": "tcp://0.0.0.0:65530"}, "coordinator.bind: 8 shards from port"),
        ({"shards": 8, "metrics_port": 65535}, "coordinator.metrics_port: 8 shards"),
        ({"shards": 2, "shard_control_bind": "tcp://0.0.0.0:0"}, "shard_control_bind must be tcp"),
        ({"shards": 2, "shard_control": "ipc:///x"}, "coordinator.shard_control must be tcp"),
        (
            {"shards": 2, "shard_control_bind": "tcp://0.0.0.0:7720"},
            r"shard_control_bind = 'tcp://0.0.0.0:7720' listens beyond this host with "
            r"security.insecure = true",
        ),
        (
            {"shards": 2, "shard_control_bind": "tcp://10.0.0.5:7720"},
            "give the shards a kit",
        ),
        (
            {"shards": 2, "outer_strategy": "sparseloco", "broadcast": "sparse"},
            r"needs coordinator.broadcast at its default \('dense'\)",
        ),
        ({"shards": 2, "keep_checkpoints": 1}, "needs coordinator.keep_checkpoints >= 2"),
        (
            {"shards": 2, "num_fragments": 2},
            r"coordinator.shards = 2 needs coordinator.num_fragments at its default \(1\)",
        ),
    ],
)
def test_the_shard_keys_are_checked(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(**kw)


def test_ports_need_no_room_when_every_shard_has_its_own_host() -> None:
    cfg = _cfg(shards=8, shard_ports="same", bind="tcp://0.0.0.0:65535")
    assert cfg.shards == 8


def _coordinator(tmp_path: Path, toml: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "crossdc",
            "coordinator",
            "--config",
            str(path),
            "--insecure",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=45,
        env={"PATH": "/usr/bin:/bin"},
    )


def test_the_command_refuses_a_shard_it_cannot_place_with_a_bad_config_status(
    tmp_path: Path,
) -> None:
    proc = _coordinator(tmp_path, "[coordinator]\nshards = 2\n")
    assert proc.returncode == EXIT_BAD_CONFIG, proc.stderr
    assert "say which shard this process is" in proc.stderr
    proc = _coordinator(tmp_path, "[coordinator]\nshards = 2\n", "--shard", "5")
    assert proc.returncode == EXIT_BAD_CONFIG, proc.stderr
    assert "--shard = 5 is not a shard" in proc.stderr


def test_the_other_shards_find_shard_zero_where_it_listens() -> None:
    cfg = _cfg(shards=2, shard_control_bind="tcp://127.0.0.1:7730")
    assert control_endpoint(cfg, {}) == "tcp://127.0.0.1:7730"
    assert control_endpoint(cfg, {"MASTER_ADDR": "node-a", "RANK": "1"}) == "tcp://node-a:7730"
    named = _cfg(shards=2, shard_control="tcp://coordinator-0.shards:7730")
    assert control_endpoint(named, {"MASTER_ADDR": "node-a"}) == "tcp://coordinator-0.shards:7730"
    assert _cfg(shard_control_bind="not checked with one shard").shards == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun_coordinator(tmp_path: Path, procs: int) -> list[str]:
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed")
    path = tmp_path / "c.toml"
    path.write_text(
        '[coordinator]\nshards = 2\nbind = "tcp://127.0.0.1:0"\nmetrics_port = 0\n'
        f'state_dir = "{tmp_path / "state"}"\n'
    )
    return [
        str(torchrun),
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(procs),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        # torchrun stops every rank once one has failed: look only after all have run (a
        # rank refuses about a second after it starts, before it imports torch).
        "--monitor-interval",
        "5",
        "-m",
        "crossdc",
        "coordinator",
        "--config",
        str(path),
        "--insecure",
    ]


@pytest.mark.timeout(240)
def test_torchrun_starts_one_process_per_shard(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m crossdc coordinator`` on a config of 2 shards: each
    process reads its shard from torchrun's rank, keeps its state in its own directory and
    listens (waiting for a site to upload θ0); SIGTERM to torchrun stops both."""
    args = _torchrun_coordinator(tmp_path, 2)
    log = tmp_path / "torchrun.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        dirs = [tmp_path / "state" / f"shard-{i}" for i in range(2)]

        def both_listen() -> bool:
            if proc.poll() is not None:
                raise AssertionError(log.read_text()[-3000:])
            return all(d.is_dir() for d in dirs) and log.read_text().count("listening on") >= 2

        wait_for(both_listen, timeout_s=180, what="both shards listening")
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.timeout(240)
def test_torchrun_with_more_processes_than_shards_is_refused(tmp_path: Path) -> None:
    """With 3 processes for 2 shards, each process says the counts differ and torchrun fails."""
    proc = subprocess.run(
        _torchrun_coordinator(tmp_path, 3), capture_output=True, text=True, timeout=200
    )
    assert proc.returncode != 0
    said = "torchrun started 3 processes (WORLD_SIZE) but coordinator.shards = 2"
    assert said in proc.stderr, proc.stderr[-3000:]


def test_each_shard_keeps_its_part_of_the_model() -> None:
    import numpy as np

    params = {f"t{i}": np.zeros((i + 1, 3), np.float32) for i in range(5)}
    shapes = {n: tuple(a.shape) for n, a in params.items()}
    parts = [own_part(params, shapes, ShardIdentity(i, 2, "--shard")) for i in range(2)]
    assert not set(parts[0]) & set(parts[1]) and set(parts[0]) | set(parts[1]) == set(params)
    assert all(parts[i][n] is params[n] for i in range(2) for n in parts[i])
    assert own_part(params, shapes, ShardIdentity(0, 1, "single")) == params
