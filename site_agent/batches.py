"""A job's batches as a site consumes them: drawn again and again (``JobBatches``), moved to the
training device (``to_device``), weighed (``first_dimension``), and state copied back to the CPU
for a checkpoint (``to_cpu``). Shared by the trainer of one process and a pipelined site's ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from site_agent.jobs.contract import Job, JobError


def to_cpu(value: Any) -> Any:
    """A snapshot of ``value`` with every tensor copied to the CPU (containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [to_cpu(item) for item in value]
    if isinstance(value, tuple):
        return tuple(to_cpu(item) for item in value)
    return value


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested in tuples, lists and dicts) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, list):
        return [to_device(value, device) for value in batch]
    if isinstance(batch, tuple):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if hasattr(batch, "to") and hasattr(batch, "keys"):  # e.g. transformers' BatchEncoding
        return batch.to(device)
    return batch


def first_dimension(batch: Any) -> int:
    """The default weight of a batch: the first dimension of the first tensor in it."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, list | tuple) or isinstance(batch, Mapping):
        for value in values:
            size = first_dimension(value)
            if size:
                return size
    return 0


class JobBatches:
    """A job's ``batches()``, begun again whenever exhausted (the contract's promise); a
    ``JobError`` if a fresh pass yields nothing."""

    def __init__(self, job: Job, where: str) -> None:
        self.job, self.where = job, where
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> JobBatches:
        return self

    def __next__(self) -> Any:
        for _ in range(2):  # the current pass, then a fresh one
            if self._it is None:
                self._it = iter(self.job.batches())
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
        raise JobError(f"{self.where}: batches() yielded no batch")
