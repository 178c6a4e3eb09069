"""Where each stage's section of the model's forward begins, traced on one micro-batch; a stage
cut from the model; and the check that a cut's stages compose to the model (docs/pipelines.md).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from site_agent.jobs.contract import first_tensor
from site_agent.pipeline.cut import StageForward, Units, strip_to_stage, unit_modules

Entries = tuple[str | None, ...]
"""Per stage, the module its section begins at (``None`` for the first: the model's inputs)."""


@dataclass(frozen=True)
class Cut:
    """How a model is cut into stages: its units, those each stage holds, where each stage's
    section of the forward begins, and whether the model's first input travels with the
    activations (an integer or bool tensor: ``cut.StageForward``)."""

    units: Units
    stages: tuple[tuple[int, ...], ...]
    entries: Entries
    hand_first: bool

    @classmethod
    def traced(
        cls,
        model: nn.Module,
        units: Units,
        stages: Sequence[Sequence[int]],
        inputs: tuple[torch.Tensor, ...],
    ) -> Cut:
        """``units`` cut into ``stages``, the entries traced on ``inputs`` (``stage_entries``);
        the first input travels with the activations unless it is floating point."""
        groups = tuple(tuple(s) for s in stages)
        first = inputs[0]
        hand_first = not (first.is_floating_point() or first.is_complex())
        return cls(units, groups, stage_entries(model, units, groups, inputs), hand_first)


_HOW = (
    "stage k runs the model's forward on the activation it receives, which is put in at the "
    "first of its modules the forward calls; before that, the earlier stages' modules return "
    "zeros shaped as their outputs (or, where that cannot be found on the meta device, their "
    "first input) and the code between them runs on those, so that code must not fail on them "
    "nor hand the stage a value it needs from them (a tensor another stage's module computes "
    "beside its output)"
)


def _cuda_devices(model: nn.Module) -> list[torch.device]:
    return sorted({p.device for p in model.parameters() if p.is_cuda}, key=str)


def stage_entries(
    model: nn.Module,
    units: Units,
    stages: Sequence[Sequence[int]],
    inputs: tuple[torch.Tensor, ...],
) -> Entries:
    """For each stage after the first, the first module of its units (``cut.unit_modules``) that
    the forward calls, traced on one forward of ``inputs`` (a training-mode forward moves
    statistics, BatchNorm's: callers put the model's state back). ``ValueError`` if the forward
    calls none of a stage's modules, or one of an earlier stage's after a later stage's entry."""
    groups = unit_modules(model, units)
    called: dict[str, int] = {}

    def note(path: str) -> Callable[[nn.Module, Any], None]:
        def hook(_m: nn.Module, _args: Any) -> None:
            called.setdefault(path, len(called))

        return hook

    hooked = [(path, m) for group in groups for path, m in group.items()]
    handles = [m.register_forward_pre_hook(note(path)) for path, m in hooked]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(model)):
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    entries: list[str | None] = [None]
    for k, stage_units in enumerate(stages[1:], 1):
        paths = [path for u in stage_units for path in groups[u] if path in called]
        if not paths:
            names = [units.names[u] for u in stage_units]
            raise ValueError(f"the forward calls no module of stage {k}'s units {names}")
        entry = min(paths, key=called.__getitem__)
        earlier = [path for u in range(min(stage_units)) for path in groups[u] if path in called]
        late = [path for path in earlier if called[path] > called[entry]]
        if late:
            raise ValueError(
                f"module {late[0]!r} runs after {entry!r}, which begins a later stage: units "
                "follow the model's state_dict order, and its forward calls them in another "
                "(register the modules in the order the forward calls them)"
            )
        entries.append(entry)
    return tuple(entries)


def cut_stage(model: nn.Module, cut: Cut, index: int) -> StageForward:
    """``model`` cut, in place, to stage ``index``, as ``PipelineStage`` runs it: from its
    entry to the next stage's."""
    leave = cut.entries[index + 1] if index + 1 < len(cut.stages) else None
    stripped = strip_to_stage(model, cut.units, cut.stages[index])
    return StageForward(stripped, entry=cut.entries[index], exit=leave, hand_first=cut.hand_first)


def check_stages_compose(model: nn.Module, cut: Cut, inputs: tuple[torch.Tensor, ...]) -> None:
    """Refuse a cut whose stages, run one after the other on ``inputs`` and back-propagated from
    the last to the first as torch's schedules do, do not compute the model's own output and
    parameter gradients. The output is compared as ``torch.testing.assert_close`` does for the
    dtype, each gradient by its norm-wise relative error, at most the square root of the dtype's
    epsilon (the same kernels run in both, in another summation order: 5e-7 was seen for
    float32, against 3.5e-4 allowed; a lost gradient path is an error of order one). Runs on
    copies, from the same RNG state, each later stage's activation a leaf that needs a gradient
    (as torch's stage receives it); a failing forward or backward is refused by name too.
    ``model`` is left as it was, but for the statistics a training-mode forward updates (callers
    put its state back)."""
    cuda = _cuda_devices(model)
    whole_model = copy.deepcopy(model)
    with torch.enable_grad(), torch.random.fork_rng(devices=cuda):  # the stages draw alike
        whole = first_tensor(StageForward(whole_model)(*inputs))
        if whole.requires_grad:
            whole.backward(torch.ones_like(whole))  # type: ignore[no-untyped-call]
    with torch.enable_grad(), torch.random.fork_rng(devices=cuda):
        out, grads = _run_stages(model, cut, inputs)
    expected = _grads(whole_model)
    del whole_model
    try:
        torch.testing.assert_close(out.detach(), whole.detach())
    except AssertionError as e:
        raise ValueError(
            "the stages of this cut do not compute the model's output "
            f"({str(e).splitlines()[-1].strip()}): {_HOW}"
        ) from None
    for name in sorted(set(grads) | set(expected)):
        got, want = grads.get(name), expected.get(name)
        error = _relative_error(got, want)
        if error > torch.finfo(want.dtype if want is not None else torch.float32).eps ** 0.5:
            raise ValueError(
                f"the stages of this cut do not compute the model's gradient of {name!r} "
                f"(relative error {error:.3g}): a later stage takes the activation "
                "only where its first module does, so a forward that uses it elsewhere too (a "
                "residual h + layer(h) in the model's own loop rather than inside the block) "
                "loses the gradient through that use; keep such code inside the blocks"
            )


def _relative_error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """``|got - want| / |want|`` in Frobenius norms, a missing gradient counted as zeros
    (``inf`` where only ``want`` is zero)."""
    if got is None or want is None:
        present = got if want is None else want
        return 0.0 if present is None or not present.any() else math.inf
    diff, scale = float((got - want).norm()), float(want.norm())
    return diff / scale if scale else (math.inf if diff else 0.0)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _run_stages(
    model: nn.Module, cut: Cut, inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The stages' forwards one after the other, each later stage's activation a leaf that
    needs a gradient, as torch's stage receives it (an in-place change of it fails here as in
    training), then their backwards from the last to the first, each from the gradient of the
    activation the next one received; the last stage's output and every parameter's gradient."""
    out: tuple[torch.Tensor, ...] = inputs
    runs: list[tuple[StageForward, torch.Tensor, torch.Tensor]] = []
    for k in range(len(cut.stages)):
        stage = cut_stage(copy.deepcopy(model), cut, k)
        try:
            if k:
                out = (out[0].detach().requires_grad_(), *out[1:])
            handed = stage(*out)
        except Exception as e:  # any error of the job's own forward, named
            raise ValueError(
                f"stage {k} of this cut fails on the tensor the stage before hands it "
                f"({type(e).__name__}: {e}): {_HOW}"
            ) from e
        received, out = out[0], handed if isinstance(handed, tuple) else (handed,)
        runs.append((stage, received, out[0]))
    upstream: torch.Tensor | None = None
    for k in reversed(range(len(runs))):
        stage, received, produced = runs[k]
        try:
            if produced.requires_grad:
                produced.backward(  # type: ignore[no-untyped-call]
                    torch.ones_like(produced) if upstream is None else upstream
                )
        except Exception as e:
            raise ValueError(f"stage {k} of this cut fails in its backward ({e})") from e
        if k:
            upstream = received.grad
            if upstream is None:
                raise ValueError(f"stage {k} of this cut sends no gradient back to stage {k - 1}")
    grads = {n: g for stage, _, _ in runs for n, g in _grads(stage.model).items()}
    return runs[-1][2], grads
