"""The per-unit profile a pipeline's plan is cut from: each unit's forward + backward seconds
and output bytes on one micro-batch, measured by module hooks (docs/pipelines.md, "The plan").
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from site_agent.jobs.contract import first_tensor
from site_agent.pipeline.cut import Units, unit_modules

log = logging.getLogger(__name__)


class _UnitTimer:
    """Module hooks that add each unit's forward and backward seconds and note its output size."""

    def __init__(self, groups: list[list[nn.Module]], cuda: bool, backward: bool) -> None:
        self.seconds = [0.0] * len(groups)
        self.sizes = [0] * len(groups)
        self.cuda = cuda
        self._started: dict[int, float] = {}
        self._handles: list[Any] = []
        for u, modules in enumerate(groups):
            for m in modules:
                self._handles += [
                    m.register_forward_pre_hook(lambda m, _a: self._start(m)),
                    m.register_forward_hook(lambda m, _a, out, u=u: self._stop(m, u, out)),
                ]
                if backward:
                    self._handles += [
                        m.register_full_backward_pre_hook(lambda m, _g: self._start(m)),
                        m.register_full_backward_hook(functools.partial(self._backward_done, u)),
                    ]

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _start(self, module: nn.Module) -> None:
        self._started[id(module)] = self._now()

    def _stop(self, module: nn.Module, unit: int, out: Any = None) -> None:
        started = self._started.pop(id(module), None)
        if started is not None:
            self.seconds[unit] += self._now() - started
        if out is not None:
            try:
                t = first_tensor(out)
                self.sizes[unit] = t.numel() * t.element_size()
            except (ValueError, TypeError):
                pass

    def _backward_done(self, unit: int, module: nn.Module, _gi: Any, _go: Any) -> None:
        self._stop(module, unit)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def profile_units(
    model: nn.Module,
    units: Units,
    run: Callable[[], torch.Tensor],
    *,
    steps: int = 3,
) -> tuple[list[float], list[int]]:
    """Each unit's forward + backward seconds (median of ``steps`` passes after one warm-up) and
    its output's bytes, measured by module hooks while ``run()`` (a forward returning a scalar
    loss through the whole model) is back-propagated. Gradients are taken with
    ``torch.autograd.grad``, so ``.grad`` fields stay untouched."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    try:
        return _profile(model, units, run, steps, backward=True)
    except RuntimeError as exc:
        if "BackwardHookFunction" not in str(exc):
            raise
        why = str(exc).split(".")[0]
    # An in-place op on a timed module's output (an nn.ReLU(inplace=True) after a Linear)
    # refuses the backward hooks: the forward is timed, and the backward estimated as twice it.
    log.warning("per-unit profile: forward only, backward estimated as 2x forward (%s)", why)
    costs, sizes = _profile(model, units, run, steps, backward=False)
    return [3.0 * c for c in costs], sizes


def _profile(
    model: nn.Module, units: Units, run: Callable[[], torch.Tensor], steps: int, backward: bool
) -> tuple[list[float], list[int]]:
    groups = [list(group.values()) for group in unit_modules(model, units)]
    times: list[list[float]] = [[] for _ in groups]
    timer = _UnitTimer(groups, any(p.is_cuda for p in model.parameters()), backward)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        # A unit whose inputs need no gradient (the embedding) still times its backward.
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            for step in range(steps + 1):
                timer.seconds = [0.0] * len(groups)
                torch.autograd.grad(run(), params, allow_unused=True)
                if step > 0:
                    for u, seconds in enumerate(timer.seconds):
                        times[u].append(seconds)
    finally:
        timer.close()
    return [statistics.median(t) for t in times], timer.sizes
