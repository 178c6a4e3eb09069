"""The synchronous data-parallel baseline: exact DDP semantics, bit-identical sites, bad input.

The federation runs in-process (coordinator and sites on threads, real sockets over tcp loopback,
port 0); one test runs the ``python -m`` entry points as processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from comm.codecs.base import EncodedTensor
from comm.ops.configio import dump_toml
from comm.security.rolekits import SecurityConfig
from comm.transport.profile import ChannelConfig
from comm.wire.schema import Message, StepGrad
from comm.wire.tensors import state_hash
from coordinator.strategies.base import weighted_mean
from crossdc.bench.local_trainer import LocalTrainer
from crossdc.ddp.coordinator import DDPCoordinator
from crossdc.ddp.decision import Action, DDPConfig, Snapshot, decide
from crossdc.ddp.site import RESULT_FILE, DDPSite
from crossdc.ddp.trainer import DDPTrainer
from site_agent.config import JobConfig, SiteConfig
from site_agent.jobs.bytegpt.data import BatchSampler, ByteCorpus
from site_agent.jobs.bytegpt.model import ModelConfig, build_model
from site_agent.jobs.bytegpt.optim import InnerOptimConfig
from tests.conftest import ROOT, TINY_MODEL

MODEL = ModelConfig(**TINY_MODEL)
OPTIM = InnerOptimConfig(batch_size=4, warmup_steps=2)
SEED = 7
CHANNEL = ChannelConfig(linger_s=0.5)
TEXT = b"".join(
    f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n".encode() for i in range(400)
)
CORPUS = ByteCorpus(np.frombuffer(TEXT, dtype=np.uint8).copy(), source="test")


def _sampler(seed: int, batch_size: int = OPTIM.batch_size) -> BatchSampler:
    return BatchSampler(CORPUS, batch_size=batch_size, context_len=MODEL.context_len, seed=seed)


def _trainer(sampler_seed: int) -> DDPTrainer:
    return DDPTrainer(
        LocalTrainer(
            model=build_model(MODEL, SEED), sampler=_sampler(sampler_seed), optim_cfg=OPTIM
        )
    )


class ListSampler(BatchSampler):
    """Hands out the batches appended to ``batches``, in order."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(CORPUS, batch_size=batch_size, context_len=MODEL.context_len, seed=0)
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches.pop(0)


class Federation:
    """A DDP coordinator and sites on threads; ``close`` stops and joins everything."""

    def __init__(self, tmp: Path, **cfg: Any) -> None:
        self.tmp = tmp
        self.coord = DDPCoordinator(
            DDPConfig(bind="tcp://127.0.0.1:0", state_dir=str(tmp / "ddp"), channel=CHANNEL, **cfg)
        )
        self.endpoint = self.coord.start()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.sites: dict[str, DDPSite] = {}
        self.exit_codes: dict[str, int] = {}
        self.coord_thread = threading.Thread(target=self.coord.run, args=(self.stop,), daemon=True)
        self.coord_thread.start()

    def site_config(self, site_id: str) -> SiteConfig:
        return SiteConfig(
            site_id=site_id,
            coordinator=self.endpoint,
            state_dir=str(self.tmp / f"site-{site_id}"),
            device="cpu",
            job=JobConfig(options={"model": asdict(MODEL), "optim": asdict(OPTIM)}),
            channel=CHANNEL,
            security=SecurityConfig(insecure=True),
        )

    def add(self, site: DDPSite) -> None:
        self.sites[site.site_id] = site
        site.start()

        def run() -> None:
            self.exit_codes[site.site_id] = site.run()

        t = threading.Thread(target=run, name=f"ddp-{site.site_id}", daemon=True)
        self.threads.append(t)
        t.start()

    def wait(self, timeout_s: float) -> None:
        for t in [*self.threads, self.coord_thread]:
            t.join(timeout_s)
            assert not t.is_alive(), f"{t.name} still running"

    def close(self) -> None:
        for site in self.sites.values():
            site.stop_requested.set()
        for t in self.threads:
            t.join(10)
        for site in self.sites.values():
            site.close()
        self.stop.set()
        self.coord_thread.join(10)
        self.coord.close()


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[Any]:
    made: list[Federation] = []

    def make(**cfg: Any) -> Federation:
        fed = Federation(tmp_path, **cfg)
        made.append(fed)
        return fed

    try:
        yield make
    finally:
        for fed in made:
            fed.close()


def _global_rel_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    num = sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in b)
    den = sum(float(np.sum(b[k].astype(np.float64) ** 2)) for k in b)
    return float(np.sqrt(num / den))


# ---- the decision, without sockets ----------------------------------------------------------


@pytest.mark.timeout(10)
def test_decide_golden_cases() -> None:
    cfg = DDPConfig(min_sites=2, max_steps=3, eval_every=2)
    snap = Snapshot(
        joined=("a",),
        participants=(),
        step=0,
        received=frozenset(),
        final_eval_asked_at=None,
        have_final_eval=False,
    )
    assert decide(0.0, snap, cfg)[0] is Action.WAIT
    assert decide(0.0, replace(snap, joined=("a", "b")), cfg)[0] is Action.START
    running = replace(snap, joined=("a", "b"), participants=("a", "b"))
    assert decide(0.0, replace(running, received=frozenset({"a"})), cfg)[0] is Action.WAIT
    assert decide(0.0, replace(running, received=frozenset({"a", "b"})), cfg)[0] is Action.REDUCE
    action, why = decide(0.0, replace(running, joined=("b",)), cfg)
    assert action is Action.ABORT and "['a']" in why
    done = replace(running, step=3, final_eval_asked_at=10.0)
    assert decide(11.0, done, cfg)[0] is Action.WAIT
    assert decide(11.0, replace(done, have_final_eval=True), cfg)[0] is Action.FINISH
    assert decide(10.0 + cfg.site_timeout_s + 1, done, cfg)[0] is Action.FINISH
    assert decide(0.0, replace(done, final_eval_asked_at=None), replace(cfg, eval_every=0))[0] is (
        Action.FINISH
    )


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("field", "value"),
    [("min_sites", 0), ("max_steps", 0), ("eval_every", -1), ("site_timeout_s", 0.0)],
)
def test_config_validation_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"ddp.{field}"):
        DDPConfig(**{field: value})


# ---- the federation in-process --------------------------------------------------------------


@pytest.mark.timeout(60)
def test_matches_single_process_training_and_sites_end_bit_identical(
    federation: Any, tmp_path: Path
) -> None:
    steps = 6
    fed = federation(min_sites=2, max_steps=steps, eval_every=3)
    val = [_sampler(100).next_batch() for _ in range(2)]
    for site_id, seed in (("a", 1), ("b", 2)):
        fed.add(DDPSite(fed.site_config(site_id), trainer=_trainer(seed), val_batches=val))
    fed.wait(45)
    assert fed.exit_codes == {"a": 0, "b": 0}

    # Reference 1: one process, AdamW steps on the token-weighted mean gradient of (b1, b2).
    ref = _trainer(99)
    s1, s2 = _sampler(1), _sampler(2)
    # Reference 2: LocalTrainer itself, on the concatenated batches (b1 ++ b2).
    concat_sampler = ListSampler(2 * OPTIM.batch_size)
    concat = LocalTrainer(
        model=build_model(MODEL, SEED),
        sampler=concat_sampler,
        optim_cfg=replace(OPTIM, batch_size=2 * OPTIM.batch_size),
    )
    for _ in range(steps):
        b1, b2 = s1.next_batch(), s2.next_batch()
        assert b1[1].numel() == b2[1].numel()
        g1, g2 = ref.compute_gradient(b1), ref.compute_gradient(b2)
        ref.apply_gradient(weighted_mean([(g1.tokens, g1.grads), (g2.tokens, g2.grads)]))
        concat_sampler.batches.append((torch.cat([b1[0], b2[0]]), torch.cat([b1[1], b2[1]])))
        concat.train_steps(1)

    expected = ref.parameters_numpy()
    got = {s: site.trainer.parameters_numpy() for s, site in fed.sites.items()}
    for site_id, params in got.items():
        assert set(params) == set(expected)
        for name in expected:
            np.testing.assert_allclose(
                params[name], expected[name], rtol=1e-5, atol=0, err_msg=f"{site_id} {name}"
            )
        # The mean over equal-token batches is the gradient of the concatenated batch; AdamW
        # amplifies float rounding only in (near-)zero gradients, so compare globally.
        assert _global_rel_diff(params, concat.parameters_numpy()) < 1e-5

    # (2) bit-identical sites, checked by state hash, and reported in each site's result file.
    hashes = {s: state_hash(p) for s, p in got.items()}
    assert hashes["a"] == hashes["b"]
    for site_id in ("a", "b"):
        result = json.loads((tmp_path / f"site-{site_id}" / RESULT_FILE).read_text())
        assert result["state_hash"] == hashes["a"]
        assert result["steps"] == steps
        assert 0 < result["compute_utilization"] <= 1.0

    status = json.loads((tmp_path / "ddp" / "status.json").read_text())
    assert status["finished"] and not status["aborted"]
    assert status["steps_completed"] == steps
    assert [h["step"] for h in status["history"]] == list(range(steps))
    assert len(status["step_seconds"]) == steps
    assert set(status["val_losses"]) == {"0", "3", "6"}  # from site "a", the first by id
    assert fed.sites["a"].val_losses and not fed.sites["b"].val_losses
    assert status["wire_bytes_in"] > 0 and status["wire_bytes_out"] > 0
    assert status["rejected"] == {}


class CorruptingSite(DDPSite):
    """Sends a malformed copy of its gradient before the genuine one at chosen steps."""

    def __init__(self, *args: Any, corrupt_at: dict[int, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.corrupt_at = corrupt_at

    def _send(self, msg: Message) -> None:
        if isinstance(msg, StepGrad) and msg.step in self.corrupt_at:
            first = msg.payload[0]
            if self.corrupt_at[msg.step] == "shape":
                bad = EncodedTensor(
                    name=first.name,
                    shape=(1,),
                    codec=first.codec,
                    buffers=(np.zeros(1, np.float32),),
                )
            else:
                nan = np.full(first.numel, np.nan, np.float32)
                bad = replace(first, buffers=(nan,))
            super()._send(replace(msg, payload=(bad, *msg.payload[1:])))
        super()._send(msg)


@pytest.mark.timeout(60)
def test_malformed_gradients_are_rejected_without_breaking_the_run(federation: Any) -> None:
    steps = 4
    fed = federation(min_sites=2, max_steps=steps, eval_every=0)
    fed.add(DDPSite(fed.site_config("a"), trainer=_trainer(1), val_batches=[]))
    bad = CorruptingSite(
        fed.site_config("b"), trainer=_trainer(2), val_batches=[], corrupt_at={1: "shape", 2: "nan"}
    )
    fed.add(bad)
    fed.wait(45)
    assert fed.exit_codes == {"a": 0, "b": 0}
    status = fed.coord.status()
    assert status["finished"] and status["steps_completed"] == steps
    assert status["rejected"] == {"bad_payload": 1, "non_finite": 1}
    assert bad.errors == {"remote_bad_payload": 1, "remote_non_finite": 1}
    hashes = {s: state_hash(site.trainer.parameters_numpy()) for s, site in fed.sites.items()}
    assert hashes["a"] == hashes["b"]


@pytest.mark.timeout(60)
def test_a_site_with_other_initial_parameters_is_refused(federation: Any) -> None:
    fed = federation(min_sites=2, max_steps=2, eval_every=0)
    fed.add(DDPSite(fed.site_config("a"), trainer=_trainer(1), val_batches=[]))
    other = DDPTrainer(
        LocalTrainer(model=build_model(MODEL, SEED + 1), sampler=_sampler(2), optim_cfg=OPTIM)
    )
    fed.add(DDPSite(fed.site_config("b"), trainer=other, val_batches=[]))
    fed.threads[-1].join(30)
    assert fed.exit_codes.get("b") == 3
    assert fed.sites["b"].errors["remote_model_mismatch"] == 1
    assert fed.coord.status()["participants"] == []


# ---- the entry points as processes ----------------------------------------------------------


@pytest.mark.timeout(90)
def test_entry_points_run_a_federation_of_processes(tmp_path: Path) -> None:
    ddp_cfg = tmp_path / "ddp.toml"
    ddp_cfg.write_text(
        dump_toml(
            {
                "ddp": {
                    "bind": "tcp://127.0.0.1:0",
                    "state_dir": str(tmp_path / "ddp"),
                    "min_sites": 2,
                    "max_steps": 4,
                    "eval_every": 2,
                }
            }
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = []
    try:
        for name, argv in [("ddp", ["crossdc.ddp", "coordinator", "--config", str(ddp_cfg)])] + [
            (site, ["crossdc.ddp", "site", "--config", str(_site_toml(tmp_path, site, i))])
            for i, site in enumerate(("eu", "us"))
        ]:
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(log)
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        for name, proc in procs.items():
            assert proc.wait(timeout=75) == 0, (tmp_path / f"{name}.log").read_text()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    status = json.loads((tmp_path / "ddp" / "status.json").read_text())
    assert status["steps_completed"] == 4 and status["participants"] == ["eu", "us"]
    assert set(status["val_losses"]) == {"0", "2", "4"}
    results = [json.loads((tmp_path / f"site-{s}" / RESULT_FILE).read_text()) for s in ("eu", "us")]
    assert results[0]["state_hash"] == results[1]["state_hash"]


def _site_toml(tmp: Path, site_id: str, index: int) -> Path:
    path = tmp / f"site-{site_id}.toml"
    table = {
        "site_id": site_id,
        "coordinator_endpoint_file": str(tmp / "ddp" / "endpoint.json"),
        "state_dir": str(tmp / f"site-{site_id}"),
        "num_threads": 1,
        "device": "cpu",
        "eval_batches": 2,
        "eval_batch_size": 4,
        "data": {"source": "stdlib", "shard_index": index, "num_shards": 2, "max_bytes": 500_000},
        "model": TINY_MODEL,
        "optim": {"batch_size": 4, "warmup_steps": 2},
        "security": {"insecure": True},
    }
    path.write_text(dump_toml({"site": table}))
    return path


@pytest.mark.timeout(30)
def test_a_bad_log_level_is_refused_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    from crossdc.ddp.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["coordinator", "--config", "unused.toml", "--log-level", "loud"])
    assert exc.value.code == 2
    assert "log level must be one of debug, info" in capsys.readouterr().err
