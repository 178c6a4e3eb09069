"""How pipeline stages exchange tensors within one step: the mailboxes.

This module owns the point-to-point traffic of one rank's step: op k's input (``receive(k)``)
and each op's output (``send``), in one of the ``P2P_MODES``.

Deadlock freedom. Receives block; sends never do. Each op's outgoing tensor is posted together with
the next op's receive in one ``batch_isend_irecv``: on NCCL, where the sends and receives between
two ranks are serialised on one stream, a stage sending an activation downstream while its neighbour
sends a gradient upstream would otherwise wait on each other (the 1F1B steady state does exactly
that); grouped, the two pairs match. Given that, a stage waits only for what the simulator's model
says it waits for, and a schedule the simulator runs to the end runs here too. On gloo (CPU), where
every send and receive is its own work and sends never wait on receives, the executor goes further:
once an op's input has arrived it posts the next op's receive before computing, and it posts each
output's send as soon as it is computed, so a transfer runs during the neighbour's compute instead
of after it (with few cores, the copy would otherwise show up as idle time at every hand-off).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

P2P_MODES = ("auto", "grouped", "preposted")
"""Ways stages exchange tensors; see ``make_mailbox`` and the module docstring."""


def make_mailbox(
    p2p: str,
    peers: Sequence[int | None],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> Mailbox:
    """The mailbox of one step in mode ``p2p`` (``auto``: preposted on gloo, grouped otherwise);
    ``peers[k]`` is the rank op k's input comes from (``None``: none)."""
    if p2p == "auto":
        p2p = "preposted" if dist.get_backend() == "gloo" else "grouped"
    if p2p == "preposted":
        return PrepostedMailbox(peers, shape, dtype, device)
    return GroupedMailbox(peers, shape, dtype, device)


class Mailbox:
    """The point-to-point traffic of one step: op k's input (``receive(k)``) and each op's output
    (``send``); ``flush`` waits until every send has left."""

    def __init__(
        self,
        peers: Sequence[int | None],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._peers = list(peers)
        self._shape = shape
        self._dtype = dtype
        self._device = device
        # Posted sends and the tensors they read: kept alive until the step's end.
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self._shape, dtype=self._dtype, device=self._device)

    def receive(self, k: int) -> torch.Tensor | None:
        raise NotImplementedError

    def prepost(self, k: int) -> None:
        """Op k's input may be received from now on (called once op k - 1's has arrived)."""

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()


class GroupedMailbox(Mailbox):
    """At most one outgoing tensor, posted with the next receive in one ``batch_isend_irecv``
    (see the module docstring): what NCCL needs to avoid serialised-stream deadlocks."""

    _next: tuple[torch.Tensor, int] | None = None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        assert self._next is None, "one op produces at most one outgoing tensor"
        self._next = (tensor, dst)

    def receive(self, k: int) -> torch.Tensor | None:
        peer = self._peers[k]
        if peer is None:
            self._post(None)
            return None
        buf = self._buffer()
        self._post((buf, peer))
        return buf

    def _post(self, recv: tuple[torch.Tensor, int] | None) -> None:
        p2p: list[dist.P2POp] = []
        send_tensor = None
        if self._next is not None:
            send_tensor, dst = self._next
            p2p.append(dist.P2POp(dist.isend, send_tensor, dst))
            self._next = None
        if recv is not None:
            p2p.append(dist.P2POp(dist.irecv, recv[0], recv[1]))
        if not p2p:
            return
        works = dist.batch_isend_irecv(p2p)
        if recv is not None and len(works) == len(p2p):
            # One work per op: wait for the receive, let the send run on.
            works[-1].wait()
            works = works[:-1]
        elif recv is not None:
            # Coalesced (NCCL): one work for the group; waiting orders the streams, not the host.
            for work in works:
                work.wait()
            works = []
        for work in works:
            assert send_tensor is not None
            self._in_flight.append((work, send_tensor))

    def flush(self) -> None:
        self._post(None)
        super().flush()


class PrepostedMailbox(Mailbox):
    """Receives posted one op ahead and sends posted at once (gloo, see the module docstring).

    Op k + 1's receive is posted only after op k's input arrived, so at most one receive is
    outstanding and receives from one peer are matched in schedule order.
    """

    def __init__(
        self,
        peers: Sequence[int | None],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(peers, shape, dtype, device)
        self._posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}

    def prepost(self, k: int) -> None:
        if k >= len(self._peers) or k in self._posted:
            return
        peer = self._peers[k]
        if peer is None:
            return
        buf = self._buffer()
        work = dist.irecv(buf, src=peer)
        assert work is not None
        self._posted[k] = (work, buf)

    def receive(self, k: int) -> torch.Tensor | None:
        self.prepost(k)
        entry = self._posted.pop(k, None)
        if entry is None:
            return None
        entry[0].wait()
        return entry[1]

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        work = dist.isend(tensor, dst=dst)
        assert work is not None
        self._in_flight.append((work, tensor))

    def flush(self) -> None:
        assert not self._posted, "every posted receive was consumed"
        super().flush()
