"""A rank's failure in a collective call, made known to every rank of the site at one point.

The ranks of a sharded site make each sync call together (``site_agent.shardsync``): a rank that
raised between two collectives would leave the others waiting in the next one until the process
group's timeout. So a rank catches what its own work raises (:func:`failed`) and takes part in
the next collective all the same, carrying the failure in place of its data; every rank learns
of it there (:func:`agree`, :func:`raise_first`) and raises the same :class:`RankFailure`, which
names the rank and what it was doing. The ranks stay in step: the next call finds them all at
its first collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Failed:
    """What one rank's failure says to the others: which rank, doing what, and the error."""

    rank: int
    what: str
    error: str

    def describe(self) -> str:
        return f"rank {self.rank} of the site failed {self.what}: {self.error}"


class RankFailure(RuntimeError):
    """A rank of the site failed in a collective call; raised on every rank at the same point."""

    def __init__(self, failed: Failed) -> None:
        super().__init__(failed.describe())
        self.failed = failed

    def __reduce__(self) -> tuple[Any, ...]:
        return (RankFailure, (self.failed,))


def failed(exc: BaseException, rank: int, what: str) -> Failed:
    """``exc``, raised on ``rank`` while ``what``, as the others are told of it."""
    return Failed(rank, what, f"{type(exc).__name__}: {exc}")


def raise_first(
    failures: Iterable[Failed | None],
    mine: Failed | None = None,
    cause: BaseException | None = None,
) -> None:
    """RankFailure for the first failure of ``failures`` (the lowest rank's), if any; where it
    is this rank's own (``mine``), chained to what this rank raised (``cause``)."""
    first = next((f for f in failures if f is not None), None)
    if first is not None:
        raise RankFailure(first) from (cause if first == mine else None)


def agree(
    mine: Failed | None,
    group: dist.ProcessGroup | None,
    cause: BaseException | None = None,
) -> None:
    """Every rank's failure (or None) to every rank of ``group``; RankFailure on all of them
    when any failed (the lowest rank's failure)."""
    everyone: list[Failed | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    raise_first(everyone, mine, cause)
