"""The job contract: what a user's job gives crossdc, what crossdc gives the job's factory, and how
a factory named in ``[site.job]`` is found, called and checked.

A job is the user's model, data, loss and inner optimizer. crossdc calls its factory once per
process with a :class:`JobContext` and drives what it returns (a :class:`Job`): it does the inner
steps (zero_grad, backward, clipping, the optimizer and scheduler steps), the syncs, checkpoints
and metrics. What it federates is the model's parameters and floating-point buffers by name
(:func:`federated_state`); integer buffers stay local. docs/jobs.md is the user's guide.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from comm.ops.configio import ConfigError, build

BYTEGPT_FACTORY = "site_agent.jobs.bytegpt:make_job"
"""The embedded default job: the byte-level GPT on the Python standard library."""

REQUIRED_MEMBERS = ("model", "optimizer", "batches", "loss", "evaluate")
"""What every job object must have; ``scheduler``, ``weight``, ``state_dict`` and
``load_state_dict`` are optional."""

PIPELINE_MEMBERS = ("split", "output_loss")
"""What a job that may be pipelined (``site.stages > 1``) gives besides: ``split(batch) ->
(inputs, target)`` (``inputs`` a tensor or a tuple of the model's positional arguments) and
``output_loss(output, target) -> Tensor`` (the loss from the model's output, reduced to its
first tensor, e.g. a Hugging Face model's logits). ``cut_points`` (module names a stage may
start at, in order) is optional."""


class JobError(ValueError):
    """A job that cannot be used: its factory does not import, is not callable, rejects its
    options, or returns an object that breaks the contract. The message names what is wrong."""


@dataclass(frozen=True, kw_only=True)
class JobContext:
    """What crossdc tells a job's factory about the process it runs in."""

    site_id: str
    """This data center's name (``site.site_id``)."""
    seed: int
    """The federation's seed: every site must build the same initial model from it."""
    device: torch.device
    """Where the model and its batches live (``site.device`` resolved: CUDA if present)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """``[site.job.options]``, as the TOML has it: the job's own settings (its data share, say)."""
    rank: int = 0
    """This process's rank in the site (0 for a site of one process)."""
    world_size: int = 1
    """Processes in the site."""
    state_dir: Path = Path(".")
    """The site's own directory for files that must survive a restart (crossdc checkpoints
    there too, under names of its own)."""


@runtime_checkable
class Job(Protocol):
    """A user's job. crossdc reads these members and never changes what they mean.

    Optional members: ``scheduler`` (an LR scheduler stepped after every optimizer step),
    ``architecture`` (a mapping of the settings beside the state's shapes that every site must
    share, such as a number of attention heads; part of the fingerprint),
    ``weight(batch) -> int`` (what a batch counts for in the sites' weighted mean; its first
    dimension by default), ``state_dict()`` / ``load_state_dict(state)`` (the job's own resumable
    state, such as a data cursor, checkpointed with the site; values must be tensors, numbers,
    strings, lists or dicts).
    """

    @property
    def model(self) -> nn.Module:
        """The model; its parameters and floating-point buffers are what the federation trains."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer over the model's parameters; its state survives every sync."""
        ...

    def batches(self) -> Iterable[Any]:
        """The site's training batches; iterated again from the start when exhausted."""
        ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar loss of ``model`` on ``batch`` (crossdc moves the batch's tensors to the
        device first)."""
        ...

    def evaluate(self, model: nn.Module) -> Mapping[str, float]:
        """Validation metrics of ``model``; must hold ``"loss"``. Every other key (``"accuracy"``,
        say) is reported beside it."""
        ...


JobFactory = Callable[[JobContext], Job]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

OPTIONS_TABLE = "site.job.options"
"""Where a site's config holds its job's options."""


def parse_options(cls: type[T], options: Mapping[str, Any], where: str = OPTIONS_TABLE) -> T:
    """A job's options table read into its frozen dataclass ``cls`` (nested tables into nested
    dataclasses); an unknown key or a bad value is a ``ValueError`` naming it as a key of
    ``where``, the table the options were written in."""
    try:
        return build(cls, options, prefix=where)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True, kw_only=True)
class CheckedOptions:
    """What a job's options check (:func:`checks_options`) learns from the options alone."""

    layers: int | None = None
    """How many layers the model's chain has, where a pipeline may cut it (a stage holds at least
    one): ``site.stages`` may not exceed it. None: not known before the model is built."""
    unchanged: bool = False
    """The options set nothing the job would not have without them (every value its default)."""


OptionsCheck = Callable[[Mapping[str, Any], str], CheckedOptions]
"""``check(options, where)``: a job's options read as its factory reads them, without building
anything; a bad one is a ``ValueError`` naming it as a key of ``where`` (the table they were
written in, ``site.job.options``)."""

_OPTIONS_CHECK = "check_options"


def checks_options(check: OptionsCheck) -> Callable[[F], F]:
    """Decorates a factory whose options can be checked before the job is made: the site then
    checks them, and its stage count against ``layers``, when its config is read, so that a bad
    option stops it before it starts anything (``site_agent.jobs.bytegpt:make_job`` does)."""

    def attach(factory: F) -> F:
        setattr(factory, _OPTIONS_CHECK, check)
        return factory

    return attach


def check_job_options(
    factory_path: str,
    options: Mapping[str, Any],
    python_path: Sequence[str] = (),
    where: str = OPTIONS_TABLE,
) -> CheckedOptions | None:
    """The check the factory offers (:func:`checks_options`) run on ``options``: None when the
    factory offers none, or does not resolve (building the job reports that). A bad option is a
    :class:`ConfigError` with the check's message."""
    try:
        factory = load_factory(factory_path, python_path)
    except JobError:
        return None
    check = getattr(factory, _OPTIONS_CHECK, None)
    if check is None:
        return None
    try:
        checked = check(options, where)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:  # the job's own code
        raise ConfigError(
            f"site.job.factory {factory_path!r}: checking its options raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(checked, CheckedOptions):
        raise ConfigError(
            f"site.job.factory {factory_path!r}: its options check must return CheckedOptions, "
            f"got {type(checked).__name__}"
        )
    return checked


def load_factory(path: str, python_path: Sequence[str] = ()) -> JobFactory:
    """The callable named ``"package.module:callable"``, after prepending ``python_path`` to
    ``sys.path``; :class:`JobError` says why when it cannot be had."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise JobError(f"site.job.factory must look like 'package.module:callable', got {path!r}")
    for entry in reversed(python_path):
        resolved = str(Path(entry).expanduser().resolve())
        if not Path(resolved).is_dir():
            raise JobError(f"site.job.python_path entry {entry!r} is not a directory")
        if resolved not in sys.path:
            sys.path.insert(0, resolved)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise JobError(f"site.job.factory {path!r}: cannot import {module_name!r}: {exc}") from exc
    except Exception as exc:  # the user's module failed while importing
        raise JobError(
            f"site.job.factory {path!r}: importing {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise JobError(f"site.job.factory {path!r}: {module_name!r} has no {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise JobError(f"site.job.factory {path!r} is not callable ({type(target).__name__})")
    factory: JobFactory = target
    return factory


def build_job(factory_path: str, context: JobContext, python_path: Sequence[str] = ()) -> Job:
    """Load the factory, call it with ``context`` and check what it returns."""
    factory = load_factory(factory_path, python_path)
    try:
        job = factory(context)
    except (ValueError, TypeError, KeyError) as exc:
        # The factory's own refusal of its options: its message goes through unchanged.
        raise JobError(f"site.job.factory {factory_path!r} refused its options: {exc}") from exc
    except Exception as exc:
        raise JobError(
            f"site.job.factory {factory_path!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    check_job(job, factory_path)
    return job


def check_job(job: object, factory_path: str) -> None:
    """Every required member is there with the right kind; :class:`JobError` names the first
    one that is not."""
    where = f"the job from {factory_path!r}"
    for name in REQUIRED_MEMBERS:
        if not hasattr(job, name):
            raise JobError(f"{where} has no {name!r} (a job needs {', '.join(REQUIRED_MEMBERS)})")
    model = getattr(job, "model")  # noqa: B009 (names checked above)
    if not isinstance(model, nn.Module):
        raise JobError(f"{where}: 'model' must be a torch.nn.Module, got {type(model).__name__}")
    optimizer = getattr(job, "optimizer")  # noqa: B009
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise JobError(
            f"{where}: 'optimizer' must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    for name in ("batches", "loss", "evaluate"):
        if not callable(getattr(job, name)):
            raise JobError(f"{where}: {name!r} must be callable")
    for name in ("weight", "state_dict", "load_state_dict", *PIPELINE_MEMBERS):
        if hasattr(job, name) and not callable(getattr(job, name)):
            raise JobError(f"{where}: {name!r} must be callable when present")
    cut_points = getattr(job, "cut_points", None)
    if cut_points is not None and (
        isinstance(cut_points, str)
        or not isinstance(cut_points, Sequence)
        or not all(isinstance(p, str) for p in cut_points)
    ):
        raise JobError(f"{where}: 'cut_points' must be a list of module names when present")
    architecture = getattr(job, "architecture", None)
    if architecture is not None and not isinstance(architecture, Mapping):
        raise JobError(f"{where}: 'architecture' must be a mapping when present")
    if len(inspect.signature(getattr(job, "loss")).parameters) != 2:  # noqa: B009
        raise JobError(f"{where}: 'loss' must take (model, batch)")
    owned = {id(p) for p in model.parameters()}
    stray = [
        i
        for i, group in enumerate(optimizer.param_groups)
        if any(id(p) not in owned for p in group["params"])
    ]
    if stray:
        raise JobError(
            f"{where}: the optimizer's param group {stray[0]} holds tensors that are not "
            "parameters of 'model'"
        )


def first_tensor(output: Any) -> torch.Tensor:
    """The tensor a stage hands on: ``output`` itself, or the first tensor of a tuple, list or
    mapping (a Hugging Face ``ModelOutput`` gives its logits)."""
    if isinstance(output, torch.Tensor):
        return output
    values = list(output.values()) if isinstance(output, Mapping) else list(output)
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise ValueError(f"the model's output holds no tensor ({type(output).__name__})")


def check_pipeline_job(job: Job, batch: Any, where: str = "the job") -> float:
    """A job may be pipelined: it has ``split`` and ``output_loss``, and on ``batch`` (already on
    the device) ``output_loss`` of the model's output equals ``loss``; returns the loss.
    :class:`JobError` otherwise. Runs without gradients; the RNG is put back."""
    missing = [name for name in PIPELINE_MEMBERS if not hasattr(job, name)]
    if missing:
        raise JobError(
            f"{where} cannot be pipelined: it has no {missing[0]!r} (a pipelined job gives "
            f"{', '.join(PIPELINE_MEMBERS)})"
        )
    model = job.model
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        state = torch.get_rng_state()
        whole = job.loss(model, batch)
        torch.set_rng_state(state)
        inputs, target = job.split(batch)  # type: ignore[attr-defined]
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        try:
            output = job.output_loss(first_tensor(model(*args)), target)  # type: ignore[attr-defined]
        except Exception as exc:  # the job's own code: named with the call that failed
            raise JobError(
                f"{where}: output_loss(model(*inputs), target), with (inputs, target) = "
                f"split(batch), fails: {type(exc).__name__}: {exc} (the model takes split's "
                "inputs as positional arguments, in their order)"
            ) from exc
    a, b = float(whole), float(output)
    if not math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6):
        raise JobError(
            f"{where}: output_loss(model(*split(batch).inputs), target) = {b} differs from "
            f"loss(model, batch) = {a}"
        )
    return a


def federated_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the federation trains, by ``state_dict`` name and in its order: parameters and
    floating-point buffers. A tensor the model holds under two names (tied weights) is federated
    once, under its first name; integer buffers (counters, indices) stay local."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    # keep_vars: the Parameter and buffer objects themselves, so a tied one is the same object.
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            continue
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out[name] = tensor
    return out


def buffer_names(model: nn.Module) -> list[str]:
    """The federated tensors that are buffers (statistics such as BatchNorm's running mean and
    variance): the coordinator averages them instead of stepping them like weights."""
    params = {id(p) for p in model.parameters()}
    return [name for name, t in federated_state(model).items() if id(t) not in params]


StateSpec = list[tuple[str, tuple[int, ...], str]]
"""Name, shape and dtype of each federated tensor, in ``state_dict`` order."""


def state_spec(model: nn.Module) -> StateSpec:
    return [
        (name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in federated_state(model).items()
    ]


def job_fingerprint(
    factory_path: str, spec: StateSpec, architecture: Mapping[str, Any] | None = None
) -> str:
    """A short digest of the factory path, the sorted names, shapes and dtypes of the federated
    state and the job's ``architecture`` (the settings beside the shapes that change what the
    model computes, such as its number of attention heads): two sites may federate only when
    theirs are equal."""
    payload = json.dumps(
        {
            "factory": factory_path,
            "state": sorted([name, list(shape), dtype] for name, shape, dtype in spec),
            **({"architecture": dict(architecture)} if architecture else {}),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.blake2b(payload.encode(), digest_size=8).hexdigest()


def check_metrics(metrics: object, where: str, *, finite_loss: bool = True) -> dict[str, float]:
    """``evaluate``'s result as ``{name: float}``, with ``"loss"`` (finite, unless not
    ``finite_loss``); :class:`JobError` otherwise."""
    if not isinstance(metrics, Mapping):
        raise JobError(f"{where}: evaluate must return a mapping, got {type(metrics).__name__}")
    if "loss" not in metrics:
        raise JobError(f"{where}: evaluate must return a 'loss' (got {sorted(metrics)})")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key.replace("_", "").isalnum():
            raise JobError(f"{where}: metric name {key!r} must be letters, digits and '_'")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise JobError(f"{where}: metric {key!r} is not a number ({value!r})") from None
        out[key] = number
    if finite_loss and not math.isfinite(out["loss"]):
        raise JobError(f"{where}: evaluate returned a non-finite loss ({out['loss']})")
    return out
