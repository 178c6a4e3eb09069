"""Cutting any job's model into pipeline stages by module name, without rewriting the model.

This module owns the candidate units (runs of the ``state_dict`` starting at a cut point), a
stage (the model with other stages' modules replaced by a :class:`PassThrough`), the stage as
``PipelineStage`` takes it (:class:`StageForward`) and the per-unit profile (docs/pipelines.md).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from site_agent.jobs.contract import first_tensor

log = logging.getLogger(__name__)


class PassThrough(nn.Module):
    """Stands in for a module held by another stage: returns its first input unchanged."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


class StageForward(nn.Module):
    """One stage for ``PipelineStage``: the (cut) model's own forward on the received inputs,
    reduced to one tensor by :func:`first_tensor`. A stage before the last (``last=False``)
    hands on after it the inputs beyond the first (attention masks, position ids: integer or
    bool tensors, as ``make_stage_plan`` requires), so that every stage's forward gets them."""

    def __init__(self, model: nn.Module, *, last: bool = True) -> None:
        super().__init__()
        self.model = model
        self.last = last

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        first, *rest = inputs
        if first.is_leaf and first.requires_grad:
            # A received activation (torch's stage makes it a leaf): a copy, so that the
            # model may change it in place (an nn.ReLU(inplace=True) that begins the stage).
            first = first.clone()
        out = first_tensor(self.model(first, *rest))
        # The zero-bubble schedules detach a stage's output in place, which a view does not
        # allow (a Hugging Face causal LM's logits slice the hidden states a cut head passes).
        out = out.clone() if out._is_view() else out
        return out if self.last or not rest else (out, *rest)


@dataclass(frozen=True)
class Units:
    """The candidate units of a model, in ``state_dict`` order."""

    names: tuple[str, ...]
    """A name per unit: the cut point it starts at (``"<prefix>"`` for what precedes the first)."""
    tensors: tuple[tuple[str, ...], ...]
    """The ``state_dict`` names each unit holds."""
    companions: Mapping[str, str] = field(default_factory=dict)
    """Modules without tensors that the forward applies along the chain, by name, each with a
    tensor of the unit whose stage runs it (``chain.chain_companions``)."""

    def __len__(self) -> int:
        return len(self.names)

    def owned(self, unit_indices: Sequence[int]) -> set[str]:
        return {name for i in unit_indices for name in self.tensors[i]}

    def placed(self) -> dict[str, str]:
        """Each companion's name with its unit's."""
        unit = {t: self.names[i] for i, names in enumerate(self.tensors) for t in names}
        return {module: unit[tensor] for module, tensor in self.companions.items()}


def _tensor_names(model: nn.Module) -> list[str]:
    """``state_dict`` names, a tensor held under two names (tied) counted under its first."""
    first: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        first.setdefault(id(tensor), name)
    return list(first.values())


def _under(name: str, module_name: str) -> bool:
    return not module_name or name == module_name or name.startswith(module_name + ".")


def default_cut_points(model: nn.Module) -> list[str]:
    """The entries of the model's longest ``nn.ModuleList`` (ties: the first in module order;
    without one, its longest ``nn.Sequential``, the model itself included) that hold tensors,
    and the first module after it that holds tensors (its suffix, e.g. final norm and head)."""

    def of(kind: type[nn.Module]) -> list[tuple[str, nn.Module]]:
        return [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, kind) and any(_tensor_names(block) for block in m.children())
        ]

    lists = of(nn.ModuleList) or of(nn.Sequential)
    if not lists:
        raise ValueError(
            "the model has no nn.ModuleList or nn.Sequential of blocks to cut: give the job "
            "cut_points"
        )
    list_name, blocks = max(lists, key=lambda item: len(item[1]._modules))
    prefix = f"{list_name}." if list_name else ""
    points = [f"{prefix}{n}" for n, block in blocks.named_children() if _tensor_names(block)]
    names = _tensor_names(model)
    following = names[max(i for i, n in enumerate(names) if _under(n, list_name)) + 1 :]
    if following:  # the module holding the first tensor after the list, e.g. model.norm
        points.append(following[0].rsplit(".", 1)[0])
    return points


def units_of(model: nn.Module, cut_points: Sequence[str] | None = None) -> Units:
    """Split the model's tensors into units at ``cut_points`` (default: :func:`default_cut_points`).

    A cut point must name a module that holds tensors, and cut points must follow the model's
    ``state_dict`` order; ``ValueError`` otherwise.
    """
    points = list(cut_points) if cut_points else default_cut_points(model)
    modules = dict(model.named_modules())
    names = _tensor_names(model)
    starts: list[int] = []
    for point in points:
        if point not in modules:
            raise ValueError(f"cut point {point!r} is not a module of the model")
        first = next((i for i, n in enumerate(names) if _under(n, point)), None)
        if first is None:
            raise ValueError(f"cut point {point!r} holds no parameters or buffers")
        if starts and first <= starts[-1]:
            raise ValueError(f"cut point {point!r} comes before the one it follows")
        starts.append(first)
    unit_names = list(points)
    if starts[0] > 0:
        starts.insert(0, 0)
        unit_names.insert(0, "<prefix>")
    ends = [*starts[1:], len(names)]
    tensors = tuple(tuple(names[a:b]) for a, b in zip(starts, ends, strict=True))
    return Units(names=tuple(unit_names), tensors=tensors)


def _module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.state_dict(keep_vars=True).items())


def strip_to_stage(
    model: nn.Module, owned: set[str], companions: Mapping[str, str] | None = None
) -> nn.Module:
    """Replace, in place, every module holding only tensors not in ``owned`` by a
    :class:`PassThrough`; returns ``model``. Containers (``ModuleList``, ``ModuleDict``) are
    entered, never replaced, because the forward indexes or iterates them. A module without
    tensors stays on every stage, unless ``companions`` (``Units.companions``) names the tensor
    it goes with: then it stays where that tensor does. A module whose own tensors are split
    between stages, or a tensor tied across stages, is a ``ValueError``."""
    companions = companions or {}
    owned_ids = {id(t) for n, t in _module_tensors(model) if n in owned}
    foreign_ids = {id(t) for n, t in _module_tensors(model) if n not in owned}
    tied = [n for n, t in _module_tensors(model) if id(t) in owned_ids & foreign_ids]
    if tied:
        raise ValueError(
            f"a tensor tied under the names {tied} is cut across stages: untie it (a Hugging "
            "Face config's tie_word_embeddings = false) or keep its modules on one stage"
        )

    def visit(module: nn.Module, where: str) -> None:
        for child_name, child in list(module.named_children()):
            path = f"{where}.{child_name}" if where else child_name
            ids = {id(t) for _, t in _module_tensors(child)}
            if not ids:
                if path in companions and companions[path] not in owned:
                    setattr(module, child_name, PassThrough())
                continue
            if ids <= owned_ids:
                continue
            if ids <= foreign_ids and not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                setattr(module, child_name, PassThrough())
                continue
            own = {id(t) for t in [*child.parameters(recurse=False), *child.buffers(recurse=False)]}
            if own & owned_ids and own & foreign_ids:
                raise ValueError(f"module {path!r} is split between stages: cut at modules")
            visit(child, path)

    visit(model, "")
    return model


def unit_modules(
    model: nn.Module, units: Units, free: dict[str, nn.Module] | None = None
) -> list[list[nn.Module]]:
    """Per unit, the largest modules whose tensors all belong to it (what its time is); in
    ``free``, if given, the largest modules without tensors outside those, by name."""
    owner = {n: i for i, names in enumerate(units.tensors) for n in names}
    by_id: dict[int, int] = {}
    for name, tensor in _module_tensors(model):
        if name in owner:
            by_id.setdefault(id(tensor), owner[name])
    out: list[list[nn.Module]] = [[] for _ in range(len(units))]

    def visit(module: nn.Module, where: str) -> None:
        for name, child in module.named_children():
            path = f"{where}.{name}" if where else name
            unit_ids = {by_id[id(t)] for _, t in _module_tensors(child) if id(t) in by_id}
            if not unit_ids:
                if free is not None and not _module_tensors(child):
                    free[path] = child
            elif len(unit_ids) == 1 and not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                out[unit_ids.pop()].append(child)
            else:
                visit(child, path)

    visit(model, "")
    return out


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
    groups = unit_modules(model, units)
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
