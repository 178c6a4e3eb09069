"""The baseline coordinator's rules: its configuration, what it admits, and its pure decision.

This module owns everything the coordinator decides without touching a socket: ``DDPConfig``
(the ``[ddp]`` table), the checks a ``Join`` and a ``StepGrad`` must pass (``admit_join``,
``admit_grad``: they raise ``Refused`` with the error to answer), ``decide``, the next action
as a pure function of a ``Snapshot``, ``segment_starts``, the messages that open a segment, and
the step's reduction (``mean_gradient``, ``weighted_loss``).
``crossdc.ddp.coordinator`` carries the decisions out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from comm.ops.configio import load_section
from comm.transport.profile import ChannelConfig
from comm.wire.schema import ErrorCode, Join, RoundStart, StepGrad
from coordinator.strategies.base import Arrays, weighted_mean


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """The data-parallel baseline's coordinator; every field can be set in ``[ddp]``."""

    bind: str = "tcp://0.0.0.0:7711"
    """ZeroMQ endpoint the ROUTER binds; port 0 picks a free port (written to endpoint.json)."""
    state_dir: str = "./ddp-state"
    """Where ``endpoint.json`` and ``status.json`` go; empty writes neither."""
    min_sites: int = 2
    """The run starts when this many sites have joined; they are its participants."""
    max_steps: int = 100
    """Inner steps (one gradient all-reduce each) before the run ends."""
    eval_every: int = 10
    """The first participant reports the validation loss every this many steps (and at the
    start and the end); 0 turns evaluation off."""
    site_timeout_s: float = 60.0
    """A participant not heard from this long ends the run (aborted); also the longest wait
    for the final validation loss."""
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    """WAN socket profile."""

    def __post_init__(self) -> None:
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"ddp.bind must be a ZeroMQ endpoint, got {self.bind!r}")
        if self.min_sites < 1:
            raise ValueError(f"ddp.min_sites must be >= 1, got {self.min_sites}")
        if self.max_steps < 1:
            raise ValueError(f"ddp.max_steps must be >= 1, got {self.max_steps}")
        if self.eval_every < 0:
            raise ValueError(f"ddp.eval_every must be >= 0, got {self.eval_every}")
        if not self.site_timeout_s > 0:
            raise ValueError(f"ddp.site_timeout_s must be > 0, got {self.site_timeout_s}")

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)

    @property
    def segment_steps(self) -> int:
        """Steps between two RoundStarts (between two evaluations)."""
        return self.eval_every or self.max_steps


def load_ddp_config(path: str | Path, **explicit: object) -> DDPConfig:
    return load_section(DDPConfig, path, "ddp", **explicit)


# ---- the decision -------------------------------------------------------------------------------


class Action(enum.Enum):
    WAIT = "wait"
    START = "start"
    REDUCE = "reduce"
    FINISH = "finish"
    ABORT = "abort"


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """What :func:`decide` looks at."""

    joined: tuple[str, ...]
    """Sites joined and alive, in id order."""
    participants: tuple[str, ...]
    """The run's sites, empty before it starts."""
    step: int
    """Steps completed (the step whose gradients are being gathered, 0-based)."""
    received: frozenset[str]
    """Participants whose gradient of ``step`` was accepted."""
    final_eval_asked_at: float | None
    """When the final validation loss was requested (None: not yet or evaluation off)."""
    have_final_eval: bool


def decide(now: float, snap: Snapshot, cfg: DDPConfig) -> tuple[Action, str]:
    """The next action of the coordinator and why; a pure function."""
    if not snap.participants:
        if len(snap.joined) >= cfg.min_sites:
            return Action.START, f"{len(snap.joined)} sites joined (min_sites={cfg.min_sites})"
        return Action.WAIT, f"{len(snap.joined)} of min_sites={cfg.min_sites} joined"
    gone = sorted(set(snap.participants) - set(snap.joined))
    if gone:
        return Action.ABORT, f"participant(s) {gone} left or went silent at step {snap.step}"
    if snap.step < cfg.max_steps:
        if snap.received >= set(snap.participants):
            return Action.REDUCE, f"all {len(snap.participants)} gradients of step {snap.step} in"
        missing = sorted(set(snap.participants) - snap.received)
        return Action.WAIT, f"step {snap.step} waits for {missing}"
    if cfg.eval_every == 0 or snap.have_final_eval:
        return Action.FINISH, f"completed {snap.step} steps"
    if snap.final_eval_asked_at is not None and now - snap.final_eval_asked_at > cfg.site_timeout_s:
        return Action.FINISH, f"completed {snap.step} steps; the final val loss never came"
    return Action.WAIT, "waiting for the final validation loss"


def segment_starts(
    cfg: DDPConfig, *, segment: int, step: int, participants: tuple[str, ...], evaluated: bool
) -> dict[str, RoundStart]:
    """The ``RoundStart`` of segment number ``segment``, opening at ``step``, for each site it
    goes to, in ``participants`` order; at the end of the run a zero-step segment asks the first
    participant for the final validation loss; empty when nothing is left to run or to evaluate
    (``evaluated``: the validation loss at ``step`` is in)."""
    num_steps = min(cfg.segment_steps, cfg.max_steps - step)
    evaluate = cfg.eval_every > 0 and not evaluated
    if num_steps == 0 and not evaluate:
        return {}
    evaluator = participants[0]
    reason = (
        f"ddp segment of {num_steps} steps from step {step}"
        if num_steps
        else f"final evaluation after {step} steps"
    )
    return {
        site_id: RoundStart(
            round_id=segment,
            global_version=step,
            fragment_base_version=step,
            fragment=-1,
            num_fragments=1,
            num_inner_steps=num_steps,
            overlap=False,
            codec="fp32",
            deadline_s=cfg.site_timeout_s,
            participants=participants,
            evaluate=evaluate and site_id == evaluator,
            reason=reason,
        )
        for site_id in (participants if num_steps else (evaluator,))
    }


# ---- admission ----------------------------------------------------------------------------------

Spec = dict[str, tuple[int, ...]]


class Refused(Exception):
    """A message the coordinator answers with ``Error(code, detail)`` and otherwise ignores."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class FirstJoin:
    """What the first joiner declared; every later joiner must declare the same."""

    fingerprint: str
    state_hash: str
    spec: Spec


def parse_spec(raw: Any) -> Spec:
    """``capabilities["param_spec"]`` (``[[name, [dims...]], ...]``) as a spec, or ValueError."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("capabilities.param_spec must be a non-empty list of [name, shape]")
    spec: Spec = {}
    for item in raw:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], list | tuple)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in item[1])
        ):
            raise ValueError(f"capabilities.param_spec entry {item!r} is not [name, shape]")
        if item[0] in spec:
            raise ValueError(f"capabilities.param_spec names {item[0]!r} twice")
        spec[item[0]] = tuple(item[1])
    return spec


def admit_join(msg: Join, *, participants: tuple[str, ...], first: FirstJoin | None) -> Spec:
    """The joiner's parameter spec; ``Refused`` once the run started, for a malformed spec, or
    for a model other than the first joiner's."""
    if participants:
        raise Refused(ErrorCode.UNEXPECTED, f"the run started at {participants}")
    try:
        spec = parse_spec(msg.capabilities.get("param_spec"))
    except ValueError as exc:
        raise Refused(ErrorCode.MALFORMED, str(exc)) from None
    if first is not None and (
        msg.model_fingerprint != first.fingerprint
        or msg.state_hash != first.state_hash
        or spec != first.spec
    ):
        raise Refused(
            ErrorCode.MODEL_MISMATCH,
            f"site model {msg.model_fingerprint}/{msg.state_hash} != run's "
            f"{first.fingerprint}/{first.state_hash}: all sites must start from the same "
            "parameters (same model config and seed)",
        )
    return spec


def admit_grad(
    msg: StepGrad,
    *,
    participants: tuple[str, ...],
    open_step: int,
    max_steps: int,
    received: frozenset[str],
) -> None:
    """``Refused`` unless ``msg`` is a participant's first gradient of the open step, with a
    finite positive weight and a finite loss (its payload is decoded by the caller)."""
    if msg.site_id not in participants:
        raise Refused(ErrorCode.UNEXPECTED, "not a participant of the run")
    if msg.step != open_step or open_step >= max_steps:
        raise Refused(
            ErrorCode.STALE_ROUND, f"gradient of step {msg.step}, the open step is {open_step}"
        )
    if msg.site_id in received:
        raise Refused(ErrorCode.DUPLICATE, f"step {msg.step}")
    if not (np.isfinite(msg.weight) and msg.weight > 0 and np.isfinite(msg.loss)):
        raise Refused(ErrorCode.NON_FINITE, f"weight {msg.weight} loss {msg.loss}")


# ---- the reduction ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grad:
    """A participant's admitted gradient of the open step."""

    weight: float
    loss: float
    grad: Arrays


def mean_gradient(grads: Mapping[str, Grad]) -> Arrays:
    """The token-weighted mean gradient; sites in id order, which fixes the float summation
    order, so the mean is a pure function of the inputs."""
    return weighted_mean([(g.weight, g.grad) for _, g in sorted(grads.items())])


def weighted_loss(grads: Mapping[str, Grad]) -> tuple[float, float]:
    """The step's total weight (tokens) and its token-weighted train loss."""
    ordered = [g for _, g in sorted(grads.items())]
    total_weight = sum(g.weight for g in ordered)
    return total_weight, sum(g.weight * g.loss for g in ordered) / total_weight
