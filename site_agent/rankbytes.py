"""Encoded tensors between the ranks of a site, as raw bytes.

The ranks of a sharded site (``site_agent.shardsync``) pass each other encoded tensors: every
rank's slices of an update go to the leader, the leader's result goes to every rank. What crosses
is the encodings' buffers as ``uint8`` tensors of ``torch.distributed`` (``send``/``recv`` and
``broadcast``), each received into a tensor of its exact size that the encoding then reads in
place; only the headers (name, shape, codec, ``meta`` and each buffer's dtype and shape: a few
hundred bytes a tensor) go through an object collective, first, so that the receiver knows the
sizes. An object collective would pickle the buffers too and copy them several times over.

A process group on NCCL moves tensors on the rank's current CUDA device only: the bytes go
through it there (a host copy each way, one buffer at a time); on gloo they stay on the host.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from comm.codecs.base import EncodedTensor


@dataclass(frozen=True)
class _Header:
    """An encoded tensor without its buffers, and how to read each buffer's bytes back."""

    enc: EncodedTensor  # buffers ()
    buffers: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) of each

    @classmethod
    def of(cls, enc: EncodedTensor) -> _Header:
        layouts = tuple((_array(b).dtype.str, tuple(_array(b).shape)) for b in enc.buffers)
        return cls(replace(enc, buffers=()), layouts)

    def nbytes(self) -> list[int]:
        return [np.dtype(d).itemsize * math.prod(shape) for d, shape in self.buffers]

    def with_buffers(self, raw: Sequence[torch.Tensor]) -> EncodedTensor:
        """The encoded tensor over the bytes received (no copy on the host)."""
        arrays = tuple(
            _host_bytes(t).view(np.dtype(d)).reshape(shape)
            for t, (d, shape) in zip(raw, self.buffers, strict=True)
        )
        return replace(self.enc, buffers=arrays)


def _array(buf: Any) -> np.ndarray:
    """A buffer as a numpy array (a received frame's bytes as uint8)."""
    return buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where ``group`` moves tensors: the current CUDA device on NCCL, else the host."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _outgoing(buf: Any, device: torch.device) -> torch.Tensor:
    """A buffer's bytes as a flat uint8 tensor on ``device`` (on the host: the buffer itself,
    read-only ones too: it is only sent)."""
    arr = np.ascontiguousarray(_array(buf)).reshape(-1).view(np.uint8)
    if arr.flags.writeable:
        t = torch.from_numpy(arr)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "not writable": nothing writes it
            t = torch.frombuffer(arr, dtype=torch.uint8)
    return t if device.type == "cpu" else t.to(device)


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    return np.asarray((t if t.device.type == "cpu" else t.cpu()).numpy())


def send_encoded(
    encs: Sequence[EncodedTensor], *, group: dist.ProcessGroup | None = None, dst: int = 0
) -> None:
    """Send ``encs`` to rank ``dst`` of ``group``, which calls :func:`recv_encoded`."""
    device = _device(group)
    dist.send_object_list([[_Header.of(e) for e in encs]], group=group, group_dst=dst)
    for enc in encs:
        for buf in enc.buffers:
            if _array(buf).nbytes:
                dist.send(_outgoing(buf, device), group=group, group_dst=dst)


def recv_encoded(*, group: dist.ProcessGroup | None = None, src: int) -> list[EncodedTensor]:
    """What rank ``src`` of ``group`` sent with :func:`send_encoded`."""
    device = _device(group)
    box: list[Any] = [None]
    dist.recv_object_list(box, group=group, group_src=src)
    out = []
    for header in box[0]:
        raw = []
        for n in header.nbytes():
            t = torch.empty(n, dtype=torch.uint8, device=device)
            if n:
                dist.recv(t, group=group, group_src=src)
            raw.append(t)
        out.append(header.with_buffers(raw))
    return out


def gather_encoded(
    mine: Sequence[EncodedTensor], *, group: dist.ProcessGroup | None = None, dst: int = 0
) -> list[EncodedTensor] | None:
    """Every rank's ``mine`` on rank ``dst`` of ``group``, in rank order (its own not copied);
    None on the others."""
    rank = dist.get_rank(group)
    if rank != dst:
        send_encoded(mine, group=group, dst=dst)
        return None
    out: list[EncodedTensor] = []
    for r in range(dist.get_world_size(group)):
        out.extend(mine if r == dst else recv_encoded(group=group, src=r))
    return out


def broadcast_encoded(
    enc: EncodedTensor | None, *, group: dist.ProcessGroup | None = None, src: int = 0
) -> EncodedTensor:
    """Rank ``src``'s ``enc`` on every rank of ``group`` (``src`` gets its own back, not a
    copy; the others pass None)."""
    device = _device(group)
    mine = dist.get_rank(group) == src
    box: list[Any] = [_Header.of(enc) if mine and enc is not None else None]
    dist.broadcast_object_list(box, group=group, group_src=src)
    header: _Header = box[0]
    raw = []
    for i, n in enumerate(header.nbytes()):
        if mine:
            assert enc is not None
            t = _outgoing(enc.buffers[i], device)
        else:
            t = torch.empty(n, dtype=torch.uint8, device=device)
        if n:
            dist.broadcast(t, group=group, group_src=src)
        raw.append(t)
    if mine:
        assert enc is not None
        return enc
    return header.with_buffers(raw)
