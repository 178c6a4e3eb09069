"""Joining the process group torchrun starts a pipelined site's ranks in."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the site's process group."""

    rank: int
    world_size: int
    device: torch.device
    """``cuda:LOCAL_RANK`` under NCCL, else the CPU."""


def init_from_torchrun_env(*, timeout: timedelta = timedelta(minutes=30)) -> DistEnv:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``): NCCL on ``cuda:LOCAL_RANK`` when CUDA is available, else
    gloo on the CPU. ``timeout`` bounds the training collectives, not the wait for commands.
    Uses ``env://``, so the ranks join torchrun's own store rather than start a second one.
    """
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in names if k not in os.environ]
    if missing:
        raise ValueError(f"not started by torchrun: {', '.join(missing)} unset")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if cuda else None,
    )
    return DistEnv(rank, world_size, device)
