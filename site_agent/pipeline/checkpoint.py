"""A pipelined site's checkpoint format: the whole model's state, and each rank's share of it.

This module owns the translation between ``LocalTrainer``'s ``state_dict`` format (full-model
parameter names, the optimizer state indexed as a single-process AdamW would index it) and what
each rank holds (its stage's parameters and optimizer state, its replica's sampler). A site's
``state_dict`` is that format plus every replica's sampler (``replica_samplers``), so a checkpoint
restores under any stage count, and a one-replica checkpoint moves between the two trainers.

``merge_state`` assembles the whole from the ranks' gathered shares; ``split_state`` validates a
checkpoint and cuts it into one share per rank, before anything is sent; ``check_params`` checks
a parameter dict against the model's names and shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from site_agent.pipeline.stage import PipelineLayout, StageSpec

ParamSpec = Sequence[tuple[str, tuple[int, ...]]]


def check_params(params: Mapping[str, Any], spec: ParamSpec) -> None:
    """``LocalTrainer.load_parameters``'s checks: exactly the model's names and shapes."""
    names = [name for name, _ in spec]
    for name in names:
        if name not in params:
            raise ValueError(f"parameter {name!r} is missing")
    known = set(names)
    for name in params:
        if name not in known:
            raise ValueError(f"unexpected parameter {name!r}")
    for name, expected in spec:
        shape = tuple(np.shape(params[name]))
        if shape != tuple(expected):
            raise ValueError(f"parameter {name!r} has shape {shape}, expected {tuple(expected)}")


def _index_ranges(shapes: Sequence[tuple[int, ...]], num_params: int) -> list[range]:
    """The optimizer's two parameter groups as index ranges: weight-decayed (ndim >= 2) first."""
    num_decay = sum(1 for shape in shapes if len(shape) >= 2)
    return [range(num_decay), range(num_decay, num_params)]


def merge_state(
    gathered: Sequence[Any],
    *,
    layout: PipelineLayout,
    full_spec: ParamSpec,
    full_optim_names: Sequence[str],
    step: int,
) -> dict[str, Any]:
    """The site's ``state_dict`` from every rank's share (index = rank): model and optimizer
    state from replica 0's stages, the sampler of stage 0 of every replica."""
    model: dict[str, Any] = {}
    by_name: dict[str, Any] = {}
    for s in range(layout.num_stages):
        part = gathered[layout.rank(stage=s, replica=0)]
        model.update(part["model"])
        by_name.update(part["optimizer"]["state"])
    assert list(model) == [name for name, _ in full_spec]
    hparams = gathered[0]["optimizer"]["hparams"]
    index_ranges = _index_ranges([shape for _, shape in full_spec], len(full_optim_names))
    samplers = [
        gathered[layout.rank(stage=0, replica=r)]["sampler"] for r in range(layout.num_replicas)
    ]
    return {
        "model": model,
        "optimizer": {
            "state": {
                idx: by_name[name] for idx, name in enumerate(full_optim_names) if name in by_name
            },
            "param_groups": [
                {**hp, "params": list(ix)} for hp, ix in zip(hparams, index_ranges, strict=True)
            ],
        },
        "sampler": samplers[0],
        "replica_samplers": samplers,
        "step": step,
    }


def split_state(
    state: Mapping[str, Any],
    *,
    layout: PipelineLayout,
    full_spec: ParamSpec,
    full_optim_names: Sequence[str],
    stage_specs: Sequence[StageSpec],
    expected_sampler: Mapping[str, int],
) -> list[dict[str, Any]]:
    """Validate a checkpoint and cut it into one payload per rank (index = rank).

    ``expected_sampler`` holds what every replica's sampler state must say (``batch_size``,
    ``context_len``). Raises ``ValueError`` for a checkpoint of another model or site shape.
    """
    job_state = state.get("job")
    if "sampler" not in state and isinstance(job_state, Mapping) and "sampler" in job_state:
        state = {**state, "sampler": job_state["sampler"]}  # the byte GPT job's trainer format
    for key in ("model", "optimizer", "sampler", "step"):
        if key not in state:
            raise ValueError(f"state has no {key!r} entry")
    model = state["model"]
    check_params(model, full_spec)
    by_name, hparams = _optimizer_by_name(state["optimizer"], full_spec, full_optim_names)
    samplers = _replica_samplers(state, layout.num_replicas, expected_sampler)
    step = int(state["step"])
    payloads = []
    for rank in range(layout.world_size):
        stage, replica = layout.stage_of(rank), layout.replica_of(rank)
        spec = stage_specs[stage]
        local_ranges = _index_ranges(spec.shapes, len(spec.optim_names))
        payloads.append(
            {
                "model": {name: model[name] for name in spec.names},
                "optimizer": {
                    "state": {
                        idx: by_name[name]
                        for idx, name in enumerate(spec.optim_names)
                        if name in by_name
                    },
                    "param_groups": [
                        {**hp, "params": list(ix)}
                        for hp, ix in zip(hparams, local_ranges, strict=True)
                    ],
                },
                "sampler": samplers[replica] if stage in (0, layout.num_stages - 1) else None,
                "step": step,
            }
        )
    return payloads


def _optimizer_by_name(
    optimizer: Any, full_spec: ParamSpec, full_optim_names: Sequence[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A single-process AdamW state as (per-parameter state by name, each group's
    hyper-parameters); ``ValueError`` unless its groups are this model's."""
    groups = optimizer.get("param_groups") if isinstance(optimizer, Mapping) else None
    expected = [
        list(ix) for ix in _index_ranges([shape for _, shape in full_spec], len(full_optim_names))
    ]
    if not groups or [list(g["params"]) for g in groups] != expected:
        raise ValueError("optimizer state does not match this model's parameter groups")
    by_name = {full_optim_names[int(idx)]: value for idx, value in optimizer["state"].items()}
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return by_name, hparams


def _replica_samplers(
    state: Mapping[str, Any], num_replicas: int, expected_sampler: Mapping[str, int]
) -> list[Any]:
    """Every replica's sampler state (a one-replica site may restore ``LocalTrainer``'s single
    ``sampler``); ``ValueError`` for another replica count or sampler shape."""
    samplers = state.get("replica_samplers")
    if samplers is None:
        if num_replicas != 1:
            raise ValueError(f"state holds one sampler but the site has {num_replicas} replicas")
        samplers = [state["sampler"]]
    if len(samplers) != num_replicas:
        raise ValueError(
            f"state holds {len(samplers)} replica samplers, the site has {num_replicas} replicas"
        )
    for sampler_state in samplers:
        for key, value in expected_sampler.items():
            if sampler_state[key] != value:
                raise ValueError(
                    f"sampler state has {key}={sampler_state[key]}, this site's replicas "
                    f"sample {key}={value}"
                )
    return list(samplers)
