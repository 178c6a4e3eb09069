"""Modules without tensors along a pipeline's chain: on which stage each runs, traced on one
micro-batch, and the check that a cut's stages compose to the model (docs/pipelines.md).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from site_agent.jobs.contract import first_tensor
from site_agent.pipeline.cut import (
    PassThrough,
    StageForward,
    Units,
    _module_tensors,
    _under,
    strip_to_stage,
    unit_modules,
)

_HOW = (
    "a later stage runs the model's forward on that one tensor, with the other stages' modules "
    "passed through (each returns its first input, which is not always the activation: GPT-2's "
    "position embedding takes position ids), and the inputs beyond the first after it"
)


def _storage(value: Any) -> int | None:
    """Where a tensor's data lives, so that a view of a module's output (a Hugging Face causal
    LM's head takes a slice of the final norm's) counts as that output."""
    if not isinstance(value, torch.Tensor) or value.numel() == 0:
        return None
    return int(value.untyped_storage().data_ptr())


def _cuda_devices(model: nn.Module) -> list[torch.device]:
    return sorted({p.device for p in model.parameters() if p.is_cuda}, key=str)


def chain_companions(model: nn.Module, units: Units, inputs: tuple[torch.Tensor, ...]) -> Units:
    """``units`` with their companions: each module without tensors (outside the units' own
    modules) that the forward calls once, on the chain of activations, goes with the unit that
    consumes its output (the first unit module, or companion, whose first input is that output
    or a view of it) or, when its output is the model's, with the last unit. Found by tracing
    one forward of ``inputs`` (module hooks, tensor storage). Others, such as a rotary embedding
    whose output every block takes beside its hidden states, stay on every stage. A training-mode
    forward moves statistics (BatchNorm's): callers put the model's state back."""
    free: dict[str, nn.Module] = {}
    groups = unit_modules(model, units, free)
    events: list[tuple[int | str, int | None, int | None]] = []  # (unit or name, in, out)
    alive: list[Any] = []  # every traced tensor, so that no storage is reused during the trace

    def note(key: int | str) -> Any:
        def hook(_m: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            handed = args[0] if args else next(iter(kwargs.values()), None)  # as PassThrough
            alive.extend((handed, out))
            events.append((key, _storage(handed), _storage(out)))

        return hook

    hooked = [(u, m) for u, ms in enumerate(groups) for m in ms] + [(n, m) for n, m in free.items()]
    handles = [m.register_forward_hook(note(key), with_kwargs=True) for key, m in hooked]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(model)):
            final = first_tensor(model(*inputs))
    finally:
        for h in handles:
            h.remove()
    calls = Counter(key for key, _, _ in events)
    unit_of: dict[str, int] = {}
    for i in reversed(range(len(events))):  # a consumer is resolved before what feeds it
        key, _, out = events[i]
        if not isinstance(key, str) or calls[key] != 1 or out is None:
            continue
        consumer = next((k for k, into, _ in events[i + 1 :] if into == out), None)
        if isinstance(consumer, int):
            unit_of[key] = consumer
        elif isinstance(consumer, str) and consumer in unit_of:
            unit_of[key] = unit_of[consumer]
        elif consumer is None and out == _storage(final):
            unit_of[key] = len(units) - 1
    companions = {name: units.tensors[u][0] for name, u in sorted(unit_of.items())}
    return dataclasses.replace(units, companions=companions)


def check_stages_compose(
    model: nn.Module,
    units: Units,
    stages: Sequence[Sequence[int]],
    inputs: tuple[torch.Tensor, ...],
) -> None:
    """Refuse a cut whose stages (``stages``: the units each holds), run one after the other on
    ``inputs``, do not compute the model's own output, as when a module without tensors that the
    forward calls at several places of the chain runs on every stage. Compared as
    ``torch.testing.assert_close`` does for the dtype (the same kernels run in both: a float-order
    tolerance). Runs on copies, from the same RNG state, each later stage's activation a leaf
    that needs a gradient (as torch's stage receives it), and back-propagates each stage (a
    failing forward or backward is refused by name too); ``model`` is left as it was, but for
    the statistics a training-mode forward updates (callers put its state back)."""
    cuda = _cuda_devices(model)
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):  # put back: the stages draw alike
        whole = first_tensor(StageForward(model)(*inputs))
    with torch.enable_grad(), torch.random.fork_rng(devices=cuda):
        out, kept = _run_stages(model, units, stages, inputs)
    try:
        torch.testing.assert_close(out[0].detach(), whole)
    except AssertionError as e:
        common = set.intersection(*kept)
        everywhere = sorted(n for n in common if not any(_under(n, k) for k in common - {n}))
        raise ValueError(
            "the stages of this cut do not compute the model's output "
            f"({str(e).splitlines()[-1].strip()}): {_HOW}; modules without tensors on every "
            f"stage: {everywhere} (one the forward calls at several places of the chain cannot "
            "be cut: give each place its own module), as is any code the forward runs between "
            "modules (a torch.tanh between two blocks: move it into a block)"
        ) from None


def _run_stages(
    model: nn.Module,
    units: Units,
    stages: Sequence[Sequence[int]],
    inputs: tuple[torch.Tensor, ...],
) -> tuple[tuple[torch.Tensor, ...], list[set[str]]]:
    """The stages' forwards one after the other, each back-propagated, each later stage's
    activation a leaf that needs a gradient, as torch's stage receives it (an in-place change
    of it fails here as in training); the output and, per stage, its modules without tensors."""
    out = inputs
    kept: list[set[str]] = []
    for stage_units in stages:
        if kept:
            out = (out[0].detach().requires_grad_(), *out[1:])
        stage = strip_to_stage(copy.deepcopy(model), units.owned(stage_units), units.companions)
        kept.append(
            {
                n
                for n, m in stage.named_modules()
                if n and not isinstance(m, PassThrough) and not _module_tensors(m)
            }
        )
        try:
            handed = StageForward(stage, last=len(kept) == len(stages))(*out)
            out = handed if isinstance(handed, tuple) else (handed,)
        except Exception as e:  # any error of the job's own forward, named
            raise ValueError(
                f"stage {len(kept) - 1} of this cut fails on the tensor the stage before "
                f"hands it ({type(e).__name__}: {e}): {_HOW}"
            ) from e
        try:  # and its backward, as the stage will run it
            if out[0].requires_grad:
                out[0].backward(torch.ones_like(out[0]))  # type: ignore[no-untyped-call]
        except RuntimeError as e:
            raise ValueError(
                f"stage {len(kept) - 1} of this cut fails in its backward ({e}): a module "
                "the forward calls at several places changes a tensor in place twice"
            ) from e
        del stage
    return out, kept
