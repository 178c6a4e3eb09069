"""Replicas of pipeline stages under torch's DDP and FSDP2 (``[site] data_parallel``).

Unit tests (one process): an unknown mode and DDP under a schedule with a split backward
(``interleaved_zb``, ``zbv``) are refused by name, in ``[site]`` and in the engine's
``PipelineConfig``. Distributed tests (four spawned CPU processes in a gloo group, the harness of
``test_pipeline_torch``): two stages x two replicas under ``ddp`` and ``fsdp`` end three steps
where one process on the same global batches ends, to float summation order, under the
schedules each runs; torch's stage holds the DDP wrapper or the FSDP module itself; DDP
all-reduces once per step (the first step did twice, and GPipe's second step failed DDP's
bucket-rebuild assertion, before the step ran with sync off); under FSDP the parameters and the
optimizer state are shards. A site of two stages x two replicas (the leader's trainer and the
workers' loop) trains, resumes from its checkpoint bit for bit, loads an older checkpoint and
loads and gathers its state by name, under both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from comm.security.rolekits import SecurityConfig
from site_agent.config import SiteConfig, load_site_config
from site_agent.pipeline.layout import check_data_parallel
from tests.site_agent.pipeline.test_torch import (
    _make_pipeline,
    _pipeline_config,
    _site_run,
    check_equals_one_process,
    check_site_run,
    make_job,
)
from tests.support.procgroup import LocalProcessGroup

pytestmark = pytest.mark.timeout(300)


# -- one process ---------------------------------------------------------------------------


def _site(**fields: Any) -> SiteConfig:
    return SiteConfig(
        site_id="eu",
        coordinator="tcp://127.0.0.1:1",
        device="cpu",
        security=SecurityConfig(insecure=True),
        **fields,
    )


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv"])
def test_ddp_under_a_split_backward_is_refused_by_name(schedule: str) -> None:
    wanted = (
        f"site.data_parallel = 'ddp' cannot run site.schedule = '{schedule}'.*"
        "use site.data_parallel = 'fsdp' or 'allreduce'"
    )
    with pytest.raises(ValueError, match=wanted):
        _site(stages=2, replicas=2, schedule=schedule)  # ddp is the default
    with pytest.raises(ValueError, match=wanted):
        _site(stages=2, replicas=2, schedule=schedule, data_parallel="ddp")
    with pytest.raises(  # the engine's config, before anything is built
        ValueError, match=f"data_parallel = 'ddp' cannot run schedule = '{schedule}'"
    ):
        _pipeline_config(schedule, 2, 2, microbatches=2, data_parallel="ddp")
    # What runs instead; with one replica there is nothing to combine.
    for data_parallel in ("fsdp", "allreduce"):
        _site(stages=2, replicas=2, schedule=schedule, data_parallel=data_parallel)
    _site(stages=2, replicas=1, schedule=schedule)


def test_an_unknown_mode_is_refused_and_a_toml_names_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="site.data_parallel must be one of allreduce, ddp, fsdp"):
        _site(data_parallel="zero3")
    with pytest.raises(ValueError, match="data_parallel must be one of"):
        check_data_parallel("DDP", "1f1b", 2)
    path = tmp_path / "site.toml"
    path.write_text(
        '[site]\nsite_id = "eu"\ncoordinator = "tcp://127.0.0.1:1"\nreplicas = 2\n'
        'schedule = "zbv"\ndata_parallel = "fsdp"\n[site.security]\ninsecure = true\n'
    )
    assert load_site_config(path).data_parallel == "fsdp"
    assert _site().data_parallel == "ddp"


# -- spawned processes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group() -> Iterator[LocalProcessGroup]:
    with LocalProcessGroup(4, timeout_s=280) as pool:
        yield pool


def _dp_rank_run(
    rank: int,
    world_size: int,
    kind: str,
    schedule: str,
    data_parallel: str,
    steps: int,
    count_reductions: bool = False,
) -> tuple[tuple[dict[str, Any], list[float | None]], dict[str, Any]]:
    torch.set_num_threads(1)
    job = make_job(kind)
    batches = [next(iter(job.batches())) for _ in range(steps)]
    pipeline = _make_pipeline(rank, world_size, job, batches[0], schedule, 2, data_parallel)
    wrappers = [stage.submod for stage in pipeline.stages]
    reductions: list[int] = []
    for wrapper in wrappers:
        # A comm hook that counts DDP's bucket all-reduces and runs the one DDP runs by default.
        if count_reductions and isinstance(wrapper, DistributedDataParallel):

            def count(state, bucket):  # unannotated: DDP checks annotations against its own
                reductions[-1] += 1
                return default_hooks.allreduce_hook(state, bucket)

            wrapper.register_comm_hook(pipeline.dp_group, count)
    replica, losses = pipeline.layout.replica_of(rank), []
    for x, y in batches:
        reductions.append(0)
        n = x.shape[0] // 2
        loss = pipeline.train_step(
            (x[replica * n : (replica + 1) * n], y[replica * n : (replica + 1) * n])
        )
        losses.append(None if loss is None else float(loss))
    params = [p for m in pipeline.modules for p in m.parameters()]
    moments = [v for st in pipeline.optimizer.state.values() for k, v in st.items() if k != "step"]
    facts = {
        "ddp": all(isinstance(w, DistributedDataParallel) for w in wrappers),
        "fsdp": all(isinstance(w, FSDPModule) for w in wrappers),
        "sharded": all(isinstance(t, DTensor) for t in params + moments) and bool(moments),
        "reductions": reductions,
    }
    whole = {k: v.detach().numpy().copy() for k, v in pipeline.full_state().items()}
    return (whole, losses), facts


@pytest.mark.parametrize(
    ("schedule", "data_parallel", "count_reductions"),
    [
        ("gpipe", "ddp", True),
        ("1f1b", "ddp", False),
        ("interleaved_1f1b", "ddp", True),
        ("gpipe", "fsdp", False),
        ("1f1b", "fsdp", False),
        ("zbv", "fsdp", False),
        ("zbv", "allreduce", False),
    ],
)
def test_two_stages_by_two_replicas_equal_one_process(
    group: LocalProcessGroup, schedule: str, data_parallel: str, count_reductions: bool
) -> None:
    steps = 3
    out = group.run(
        _dp_rank_run, "bytegpt", schedule, data_parallel, steps, count_reductions, world_size=4
    )
    check_equals_one_process([result for result, _ in out], "bytegpt", steps, num_replicas=2)
    for facts in (f for _, f in out):
        assert facts["ddp"] == (data_parallel == "ddp")
        assert facts["fsdp"] == facts["sharded"] == (data_parallel == "fsdp")
        # DDP: one bucketed all-reduce per stage and step (the model is under its first bucket's
        # 1 MiB), none from the shape inference of the first step.
        if count_reductions:
            stages_here = 2 if schedule == "interleaved_1f1b" else 1
            assert facts["reductions"] == [stages_here] * steps


def test_the_hugging_face_job_under_fsdp_equals_one_process(group: LocalProcessGroup) -> None:
    out = group.run(_dp_rank_run, "hf", "1f1b", "fsdp", 2, world_size=4)
    check_equals_one_process([result for result, _ in out], "hf", 2, num_replicas=2)


@pytest.mark.parametrize(("schedule", "data_parallel"), [("1f1b", "ddp"), ("gpipe", "fsdp")])
def test_a_site_of_replicas_trains_resumes_and_syncs_by_name(
    group: LocalProcessGroup, schedule: str, data_parallel: str
) -> None:
    out = group.run(_site_run, schedule, 2, data_parallel, world_size=4)[0]
    check_site_run(out, data_parallel)
