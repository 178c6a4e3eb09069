"""``crossdc coordinator`` restarted on its state with ``[coordinator.initial_model]``: it listens
again without loading torch or building θ0 (one process and each of two shards), torch comes
only on the thread that loads the encoders' library once it serves; a changed ``initial_model``
is still checked against the state, and a state directory without the records a start keeps
(``initial_model.json``, a shard's ``model.json``) is checked in full and gets them."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from comm.ops.configio import dump_toml

MODEL = {"num_layers": 1, "d_model": 16, "num_heads": 2, "context_len": 16}

BLOCK_TORCH = """\
import runpy, sys, threading

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print(f"torch wanted on {threading.current_thread().name}", file=sys.stderr)
            raise ImportError("torch blocked")
        return None

sys.meta_path.insert(0, BlockTorch())
sys.argv = ["crossdc", *sys.argv[1:]]
runpy.run_module("crossdc", run_name="__main__")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(work: Path, *, shards: int = 1, model: dict[str, Any] | None = None) -> Path:
    coordinator: dict[str, Any] = {
        "bind": "tcp://127.0.0.1:0",
        "state_dir": str(work / "state"),
        "metrics_port": 0,
        "shards": shards,
        "security": {"insecure": True},
        "initial_model": {"seed": 7, "model": model or MODEL},
    }
    if shards > 1:
        coordinator["shard_control_bind"] = f"tcp://127.0.0.1:{_free_port()}"
    path = work / "coordinator.toml"
    path.write_text(dump_toml({"coordinator": coordinator}))
    return path


def _argv(config: Path, shard: int | None) -> list[str]:
    return [
        "coordinator",
        "--config",
        str(config),
        *([] if shard is None else ["--shard", str(shard)]),
    ]


def _serve_until_listening(config: Path, shards: int) -> None:
    """Start every shard, wait until each listens, stop them (SIGTERM) and wait for them."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "crossdc", *_argv(config, i if shards > 1 else None)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(shards)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            seen = []
            for line in proc.stdout:
                seen.append(line)
                if "listening on" in line:
                    break
            else:
                raise AssertionError("".join(seen))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.communicate(timeout=60)
    assert [p.returncode for p in procs] == [0] * shards


def _without_torch(tmp_path: Path, config: Path, shard: int | None) -> str:
    """A start with torch made unimportable: its whole log (it stops with an error once the
    library's loader failed, or at once where the start needs torch)."""
    script = tmp_path / "block_torch.py"
    script.write_text(BLOCK_TORCH)
    proc = subprocess.run(
        [sys.executable, str(script), *_argv(config, shard)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode != 0, "torch blocked: it must stop at its first step"
    return proc.stdout + proc.stderr


def _restarted_without_torch(log: str) -> None:
    assert "resumed global_version=0" in log and "listening on" in log, log
    wanted = [line for line in log.splitlines() if line.startswith("torch wanted on ")]
    assert wanted == ["torch wanted on load-encoders"], wanted  # only the library's loader
    assert "cannot load the encoders' library: torch blocked" in log, log


@pytest.mark.timeout(240)
def test_a_restart_on_its_state_loads_no_torch_and_builds_no_theta0(tmp_path: Path) -> None:
    config = _config(tmp_path)
    first = _without_torch(tmp_path, config, None)  # θ0 is built at a first start
    assert "listening on" not in first and "torch wanted on MainThread" in first, first
    _serve_until_listening(config, 1)
    assert (tmp_path / "state" / "initial_model.json").exists()
    _restarted_without_torch(_without_torch(tmp_path, config, None))


@pytest.mark.timeout(240)
def test_a_restarted_shard_loads_no_torch_and_knows_its_cut_from_its_records(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, shards=2)
    _serve_until_listening(config, 2)
    for i in range(2):
        held = tmp_path / "state" / f"shard-{i}"
        assert (held / "model.json").exists() and (held / "initial_model.json").exists()
        _restarted_without_torch(_without_torch(tmp_path, config, i))


@pytest.mark.timeout(240)
def test_a_state_without_the_records_is_checked_in_full_and_gets_them(tmp_path: Path) -> None:
    config = _config(tmp_path, shards=2)
    _serve_until_listening(config, 2)
    records = [
        tmp_path / "state" / f"shard-{i}" / name
        for i in range(2)
        for name in ("model.json", "initial_model.json")
    ]
    kept = [r.read_bytes() for r in records]
    for r in records:
        r.unlink()
    _serve_until_listening(config, 2)  # θ0 built: the cut and the model checked from it
    assert [r.read_bytes() for r in records] == kept


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shards", [1, 2])
def test_a_changed_initial_model_is_still_refused_against_the_state(
    tmp_path: Path, shards: int
) -> None:
    _serve_until_listening(_config(tmp_path, shards=shards), shards)
    changed = _config(tmp_path, shards=shards, model={**MODEL, "num_layers": 2})
    proc = subprocess.run(
        [sys.executable, "-m", "crossdc", *_argv(changed, 0 if shards > 1 else None)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 2, proc.stderr
    assert "coordinator.initial_model describes model" in proc.stderr
    assert "holds model" in proc.stderr.splitlines()[-1], proc.stderr


@pytest.mark.timeout(240)
def test_a_shard_that_lost_its_state_is_refused_another_theta0_than_its_record(
    tmp_path: Path,
) -> None:
    """A shard's state gone but its record of θ0's cut and hash kept: a start with another
    ``[coordinator.initial_model]`` would install a θ0 that is not the one the record, the
    other shards and the sites hold, so it is refused naming both hashes."""
    _serve_until_listening(_config(tmp_path, shards=2), 2)
    shard = tmp_path / "state" / "shard-1"
    assert (shard / "model.json").exists()
    for name in os.listdir(shard):
        if name != "model.json":
            target = shard / name
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()
    changed = _config(tmp_path, shards=2)
    text = changed.read_text().replace("seed = 7", "seed = 8")
    assert text != changed.read_text()
    changed.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "crossdc", *_argv(changed, 1)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 2, proc.stderr
    assert "model.json records a θ0 of state hash" in proc.stderr, proc.stderr
