"""The control channel of a pipelined site: the leader's commands to every rank.

For each call on its trainer the leader (rank 0) broadcasts a small command tuple on the gloo
control group, and every rank receives it and carries it out together with the leader.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def broadcast_command(command: tuple[Any, ...], control: dist.ProcessGroup) -> None:
    dist.broadcast_object_list([command], src=0, group=control)


def receive_command(control: dist.ProcessGroup) -> tuple[Any, ...]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    command: tuple[Any, ...] = box[0]
    return command
