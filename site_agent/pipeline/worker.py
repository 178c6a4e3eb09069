"""The control channel of a pipelined site and the loop every rank but the leader runs.

This module owns the commands: for each call on its ``PipelineTrainer`` the leader (rank 0)
broadcasts a small command tuple (``("train", n)``, ``("evaluate", shapes)``, ``("params",)``,
``("load_params",)``, ``("state",)``, ``("load_state",)``, ``("traces",)``, ``("probe", rounds)``
or ``("stop",)``) on the gloo control group, and all ranks carry it out together through their
``Rank``. A worker does nothing between commands; ``worker_loop`` returns on ``stop``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from site_agent.data import ByteCorpus
from site_agent.pipeline.job import PipelineJob
from site_agent.pipeline.setup import setup_rank


def worker_loop(
    job: PipelineJob, corpus: ByteCorpus, *, device: str | torch.device | None = None
) -> None:
    """Run on every rank but 0: set up this rank's stage, then carry out the leader's commands
    until it closes its ``PipelineTrainer``."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        raise ValueError("worker_loop runs on ranks other than 0; rank 0 uses PipelineTrainer")
    r = setup_rank(job, corpus, None if device is None else torch.device(device))
    while True:
        command = receive_command(r.control)
        name = command[0]
        if name == "stop":
            return
        if name == "train":
            r.train(command[1])
        elif name == "evaluate":
            r.evaluate(command[1])
        elif name == "params":
            r.gather_parameters()
        elif name == "load_params":
            r.scatter_parameters()
        elif name == "state":
            r.gather_state()
        elif name == "load_state":
            r.scatter_state()
        elif name == "traces":
            r.gather_traces()
        elif name == "probe":
            r.probe_transfer(command[1])
        else:
            raise AssertionError(f"unknown command {name!r}")


def broadcast_command(command: tuple[Any, ...], control: dist.ProcessGroup) -> None:
    dist.broadcast_object_list([command], src=0, group=control)


def receive_command(control: dist.ProcessGroup) -> tuple[Any, ...]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    command: tuple[Any, ...] = box[0]
    return command
