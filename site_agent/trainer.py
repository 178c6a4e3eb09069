"""The inner loop of a site: a job's optimizer steps on the local replica between outer syncs.

``JobTrainer`` drives any job (``site_agent.jobs.contract``) in one process: it draws the job's
batches, takes the loss, and does zero_grad, backward, clipping and the optimizer and scheduler
steps. A pipeline trainer offers the same small surface (``train_steps``, ``validate``,
``parameters_numpy``, ``load_parameters``, ``state_spec``, ``state_dict``, ``load_state_dict``),
so the site agent drives either without knowing which one it holds (:class:`SiteTrainer`).

As in DiLoCo, the inner optimizer's state survives across rounds: ``load_parameters`` replaces the
model's values with the new global ones but leaves the optimizer's moments and the step counter
alone.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from site_agent.batches import JobBatches, first_dimension, to_cpu, to_device
from site_agent.jobs.contract import (
    Job,
    JobError,
    StateSpec,
    check_metrics,
    federated_state,
    job_fingerprint,
)
from site_agent.jobs.contract import buffer_names as federated_buffer_names
from site_agent.jobs.contract import state_spec as model_state_spec

if TYPE_CHECKING:
    from site_agent.shardsync import LeaderSync


@dataclass(frozen=True)
class TrainStats:
    """What one call of ``train_steps`` did."""

    steps: int
    tokens: int
    loss_mean: float
    loss_last: float
    compute_seconds: float
    loss_reported: bool = True
    """False when the trainer has no loss to report (a training loop that records none): the
    losses are NaN then, and not a sign of divergence."""


class SiteTrainer(Protocol):
    """What the site agent needs from whatever trains inside the site: :class:`JobTrainer`, the
    pipelined site's leader, or a script's own loop in library mode."""

    evaluates: bool
    """Whether ``validate`` gives metrics (the site says so at its join, so that one that
    cannot is never asked to validate)."""

    sharded_sync: LeaderSync | None
    """How the agent syncs a model held in shards over the site's ranks (its replica then holds
    the version, never the values: ``site_agent.shardreplica``); None: the trainer's process
    holds the whole model and the agent syncs ``parameters_numpy``."""

    def train_steps(self, num_steps: int) -> TrainStats: ...

    def validate(self) -> dict[str, float] | None: ...

    def state_spec(self) -> StateSpec: ...

    def fingerprint(self, factory_path: str) -> str: ...

    def buffer_names(self) -> list[str]: ...

    def parameters_numpy(self) -> dict[str, np.ndarray]: ...

    def load_parameters(self, params: Mapping[str, np.ndarray]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class NonFiniteLossError(RuntimeError):
    """A run of inner steps whose loss was NaN or infinite: the site stops, sending nothing."""

    def __init__(self, step: int, run: int) -> None:
        super().__init__(
            f"the loss was not finite at {run} inner steps in a row, the last at inner step "
            f"{step}: stopping (nothing of this training was sent)"
        )
        self.step = step
        self.run = run


def check_parameters(params: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """``ValueError`` unless ``params`` holds exactly the names of ``shapes``, each that shape."""
    for name in shapes:
        if name not in params:
            raise ValueError(f"parameter {name!r} is missing")
    for name in params:
        if name not in shapes:
            raise ValueError(f"unexpected parameter {name!r}")
    for name, expected in shapes.items():
        shape = tuple(np.shape(params[name]))
        if shape != tuple(expected):
            raise ValueError(f"parameter {name!r} has shape {shape}, expected {tuple(expected)}")


class JobTrainer:
    """Inner training of one job's model in this process.

    ``grad_clip``: the largest global gradient L2 norm (0 disables clipping).
    ``max_nonfinite_steps``: a non-finite loss skips its step (counted by ``on_skipped``); this
    many in a row raise :class:`NonFiniteLossError`.
    """

    evaluates = True  # every job has evaluate
    sharded_sync: LeaderSync | None = None  # the model is held whole in this process

    def __init__(
        self,
        job: Job,
        *,
        grad_clip: float = 1.0,
        device: str | torch.device | None = None,
        max_nonfinite_steps: int = 8,
        on_skipped: Callable[[int], None] | None = None,
        where: str = "the job",
    ) -> None:
        self.job = job
        self.model = job.model
        if device is None:
            first = next(iter(self.model.parameters()), None)
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        self.model.to(self.device)
        self.optimizer = job.optimizer
        self.scheduler = getattr(job, "scheduler", None)
        self.grad_clip = grad_clip
        self.max_nonfinite_steps = max_nonfinite_steps
        self.on_skipped = on_skipped
        self.where = where
        self.step = 0  # inner steps taken over the trainer's whole life
        self.skipped_steps = 0
        self._nonfinite_run = 0
        self._batches: Iterator[Any] = JobBatches(job, where)
        self._state = federated_state(self.model)
        self._weight: Callable[[Any], int] = getattr(job, "weight", first_dimension)

    def _next_batch(self) -> Any:
        return next(self._batches)

    def loss(self, batch: Any) -> torch.Tensor:
        """The job's loss on one batch (already on the device), checked to be a scalar."""
        loss = self.job.loss(self.model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise JobError(f"{self.where}: loss must return a scalar tensor, got {got}")
        return loss.reshape(())

    def train_steps(self, num_steps: int) -> TrainStats:
        """Take ``num_steps`` inner steps on the job's next batches."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.model.train()
        losses: list[torch.Tensor] = []
        tokens = 0
        start = time.perf_counter()
        for _ in range(num_steps):
            batch = to_device(self._next_batch(), self.device)
            loss = self.loss(batch)
            self.step += 1
            # One host sync per step: a non-finite loss must not reach the optimizer.
            if not bool(torch.isfinite(loss)):
                self._skip()
                continue
            self._nonfinite_run = 0
            self.optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            if self.grad_clip > 0:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            tokens += int(self._weight(batch))
            losses.append(loss.detach())
        if losses:
            loss_values = torch.stack(losses).double().cpu()
            loss_mean, loss_last = float(loss_values.mean()), float(loss_values[-1])
        else:
            loss_mean = loss_last = float("nan")
        return TrainStats(
            steps=num_steps,
            tokens=tokens,
            loss_mean=loss_mean,
            loss_last=loss_last,
            compute_seconds=time.perf_counter() - start,
        )

    def _skip(self) -> None:
        self.skipped_steps += 1
        self._nonfinite_run += 1
        if self.on_skipped is not None:
            self.on_skipped(self.step)
        if self._nonfinite_run >= self.max_nonfinite_steps:
            raise NonFiniteLossError(self.step, self._nonfinite_run)

    def preflight(self) -> dict[str, float]:
        """Check the job before it joins: ``loss`` on one batch is a finite-or-not scalar and
        ``evaluate`` of the initial model holds a finite ``"loss"``. The job's own state (its
        data cursor) is put back, so training draws the same batches as without the check."""
        saved = copy.deepcopy(self.job.state_dict()) if hasattr(self.job, "state_dict") else None
        # The forward pass in train mode moves BatchNorm statistics and draws dropout masks:
        # the model and the RNG are put back too, so every site still holds the seed's θ0.
        model_state = copy.deepcopy(self.model.state_dict())
        try:
            batch = next(iter(self.job.batches()))
        except StopIteration:
            raise JobError(f"{self.where}: batches() yielded no batch") from None
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            self.loss(to_device(batch, self.device))
        self.model.load_state_dict(model_state)
        if saved is not None:
            self.job.load_state_dict(saved)  # type: ignore[attr-defined]
        return check_metrics(self.validate(), self.where)

    def validate(self) -> dict[str, float]:
        """The job's validation metrics of the model as it is now (eval mode, no gradients)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                metrics = self.job.evaluate(self.model)
        finally:
            self.model.train(was_training)
        return check_metrics(metrics, self.where, finite_loss=False)

    def state_spec(self) -> StateSpec:
        return model_state_spec(self.model)

    def buffer_names(self) -> list[str]:
        return federated_buffer_names(self.model)

    def fingerprint(self, factory_path: str) -> str:
        """The job's fingerprint (``job_fingerprint``) under ``factory_path``."""
        return job_fingerprint(
            factory_path, self.state_spec(), getattr(self.job, "architecture", None)
        )

    def parameters_numpy(self) -> dict[str, np.ndarray]:
        """float32 CPU copies of the federated state, in ``state_dict`` order."""
        return {
            name: tensor.detach().to("cpu", torch.float32, copy=True).numpy()
            for name, tensor in self._state.items()
        }

    def load_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Copy ``params`` into the model in place; the optimizer state is kept.

        Names and shapes must match the federated state exactly; nothing is copied otherwise.
        """
        state = self._state
        check_parameters(params, {name: tuple(tensor.shape) for name, tensor in state.items()})
        with torch.no_grad():
            for name, tensor in state.items():
                # torch.tensor copies, so read-only arrays (e.g. decoded from the wire) are fine.
                tensor.copy_(torch.tensor(params[name]))

    def state_dict(self) -> dict[str, Any]:
        """A CPU snapshot of model, optimizer, scheduler, the job's own state and the step;
        safe for ``weights_only`` loads."""
        state: dict[str, Any] = {
            "model": to_cpu(self.model.state_dict()),
            "optimizer": to_cpu(self.optimizer.state_dict()),
            "step": self.step,
        }
        if self.scheduler is not None:
            state["scheduler"] = to_cpu(self.scheduler.state_dict())
        if hasattr(self.job, "state_dict"):
            state["job"] = to_cpu(self.job.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        elif self.scheduler is not None:
            # A state without one (a pipelined byte GPT site's, or from before schedulers): the
            # byte GPT's schedule is a function of the step, so it is taken at the saved step.
            self.scheduler.last_epoch = int(state["step"]) - 1
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.scheduler.step()
        job_state = state.get("job")
        if job_state is None and "sampler" in state:  # a byte GPT checkpoint of before jobs
            job_state = {"sampler": state["sampler"]}
        if job_state is not None and hasattr(self.job, "load_state_dict"):
            self.job.load_state_dict(job_state)
        self.step = int(state["step"])
        self._batches = JobBatches(self.job, self.where)  # the job's restored state says where
        # its batches go on
