"""Library mode: a team's own training script federated as it is, inside a ``with`` block.

``Federation(config, model, optimizer)`` runs the site agent on a thread beside the script's
loop. The agent sees the loop as its trainer (:class:`LoopTrainer`): when the agent asks for
``n`` inner steps, the loop runs until its optimizer has stepped ``n`` times (counted by an
optimizer step hook), then it waits inside that hook while the agent does what it does between
steps (send the pseudo-gradient, merge a result that landed, checkpoint), and goes on when the
agent asks for more. So the model is only ever touched by one thread at a time, and everything
the agent has (overlap, fragments, codecs and error feedback, secure aggregation, checkpoints,
catch-up, metrics) works for the script unchanged.

Under torchrun only rank 0 runs the agent and talks to the coordinator; at every optimizer
step rank 0 tells the other ranks through torch.distributed what follows:

- a model every rank holds whole (plain or DDP): whether the federated state changed (rank 0 then
  broadcasts it) or the federation finished, so every rank holds the model rank 0 holds;
- a model whose parameters are sharded over the ranks (FSDP2's ``fully_shard``): the site syncs
  shard by shard (``site_agent.shardsync``). Each sync step of the agent is a call every rank
  makes: rank 0 names it to the others (a flag, then the call's name and arguments) and they
  make it with it. Every rank encodes its own rows' update and decodes its own rows of a
  result; what crosses the process group is encoded bytes, and no rank holds more of the model
  than its shards.

A rank that fails in a sync call does not leave the others waiting: every rank raises the same
``RankFailure`` at one collective (``site_agent.rankfailure``), rank 0's agent stops, and the
other ranks follow on until rank 0 says the federation is over for the site, with its exit
code; each rank then raises from its ``with`` block. The sync calls' collectives travel on a
group of their own whose timeout is ``site.rank_timeout_s``; the wait for rank 0 between two
steps, on the control group, is not bounded by it.
"""

from __future__ import annotations

import logging
import math
import pickle
import signal
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn

from site_agent.config import SiteConfig, load_site_config, site_config_from_table
from site_agent.exits import EXIT_CRASHED, EXIT_OK
from site_agent.jobs.contract import StateSpec, check_metrics, federated_state, job_fingerprint
from site_agent.jobs.contract import buffer_names as federated_buffer_names
from site_agent.jobs.contract import state_spec as model_state_spec
from site_agent.rankfailure import RankFailure, failed
from site_agent.shardsync import LeaderSync, RankSync, is_sharded
from site_agent.trainer import TrainStats

log = logging.getLogger("crossdc.site")

Evaluate = Callable[[nn.Module], Mapping[str, float]]


class _Stopped(Exception):
    """The script's loop left the ``with`` block: the agent stops asking for steps."""


class LoopTrainer:
    """The script's loop as the agent's trainer (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        evaluate: Evaluate | None,
        weight_per_step: float,
        architecture: Mapping[str, Any] | None = None,
        on_params_loaded: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.architecture = architecture
        self.optimizer = optimizer
        self._evaluate = evaluate
        self.evaluates = evaluate is not None
        self.weight_per_step = weight_per_step
        self._on_loaded = on_params_loaded
        self._state = federated_state(model)
        self.sharded_sync: LeaderSync | None = None
        """Set for a model sharded over the ranks: the agent syncs through it."""
        self._cv = threading.Condition()
        self._granted = 0  # steps the loop may still take before handing back
        self._loop_has_turn = False
        self._loop_done = False
        self._agent_done = False
        self.steps = 0
        self._losses: list[float] = []

    # -- the loop's side (its thread) ---------------------------------------------------------

    def wait_for_turn(self) -> None:
        """Block the loop until the agent grants it steps (or the federation ends)."""
        with self._cv:
            self._cv.wait_for(lambda: self._loop_has_turn or self._agent_done)

    def after_step(self) -> None:
        """An optimizer step was taken: count it; hand back when the grant is used up."""
        with self._cv:
            if self._agent_done or not self._loop_has_turn:
                return
            self.steps += 1
            self._granted -= 1
            if self._granted > 0:
                return
            self._loop_has_turn = False
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._loop_has_turn or self._agent_done)

    def record_loss(self, loss: float) -> None:
        self._losses.append(loss)

    def loop_done(self) -> None:
        with self._cv:
            self._loop_done = True
            self._loop_has_turn = False
            self._cv.notify_all()

    def agent_done(self) -> None:
        with self._cv:
            self._agent_done = True
            self._cv.notify_all()

    # -- the agent's side (its thread) --------------------------------------------------------

    def train_steps(self, num_steps: int) -> TrainStats:
        start = time.perf_counter()
        with self._cv:
            if self._loop_done:
                raise _Stopped
            before = self.steps
            self._granted, self._loop_has_turn = num_steps, True
            self._losses.clear()
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._loop_has_turn)
            taken = self.steps - before
            losses = list(self._losses)
        if taken < num_steps:
            raise _Stopped
        # Without record_loss there is no loss to report: NaN, which the coordinator leaves out.
        loss = float(np.mean(losses)) if losses else math.nan
        return TrainStats(
            steps=taken,
            tokens=int(round(taken * self.weight_per_step)),
            loss_mean=loss,
            loss_last=losses[-1] if losses else loss,
            loss_reported=bool(losses),
            compute_seconds=time.perf_counter() - start,
        )

    def validate(self) -> dict[str, float] | None:
        if self._evaluate is None:
            return None
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                metrics = self._evaluate(self.model)
        finally:
            self.model.train(was_training)
        return check_metrics(metrics, "Federation's evaluate", finite_loss=False)

    def state_spec(self) -> StateSpec:
        return model_state_spec(self.model)

    def buffer_names(self) -> list[str]:
        return federated_buffer_names(self.model)

    def fingerprint(self, factory_path: str) -> str:
        return job_fingerprint(factory_path, self.state_spec(), self.architecture)

    def parameters_numpy(self) -> dict[str, np.ndarray]:
        return {
            name: t.detach().to("cpu", torch.float32, copy=True).numpy()
            for name, t in self._state.items()
        }

    def load_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        if set(params) != set(self._state):
            raise ValueError("parameter names differ from the model's federated state")
        with torch.no_grad():
            for name, tensor in self._state.items():
                tensor.copy_(torch.tensor(params[name]))
        if self._on_loaded is not None:
            self._on_loaded()

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "optimizer": _cpu(self.optimizer.state_dict()),
            "step": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu(v) for v in value)
    return value


def _site_config(config: SiteConfig | str | Path | Mapping[str, Any]) -> SiteConfig:
    if isinstance(config, SiteConfig):
        return config
    if isinstance(config, str | Path):
        return load_site_config(config)
    table = config.get("site", config)
    return site_config_from_table(table)


class Federation:
    """Federate an unchanged training loop: ``with Federation(config, model, optimizer) as fed:``.

    ``config``: a site's ``[site]`` configuration (a TOML path, a mapping, or a ``SiteConfig``).
    Its ``[site.job] factory`` is not called: it names the job whose model the script trains,
    so that the script's site and ``crossdc agent`` sites running that job show the same
    fingerprint (with ``architecture``, the job's own, when it has one). ``evaluate(model) -> {"loss": ..., ...}`` is optional: without
    it the site sends no validation metrics. ``weight_per_step``: what one optimizer step counts
    for in the sites' weighted mean (samples or tokens per step; 1 by default).

    Inside the block the loop trains as it would; ``fed.finished`` turns true when the
    coordinator ends the federation (the loop should then stop), and ``fed.record_loss(x)``
    optionally reports the training loss of a step. Leaving the block leaves the federation.
    """

    def __init__(
        self,
        config: SiteConfig | str | Path | Mapping[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        evaluate: Evaluate | None = None,
        weight_per_step: float = 1.0,
        architecture: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = _site_config(config)
        if not math.isfinite(weight_per_step) or weight_per_step <= 0:
            raise ValueError(f"weight_per_step must be > 0, got {weight_per_step}")
        self.model = model
        self.optimizer = optimizer
        self.rank = torch.distributed.get_rank() if _distributed() else 0
        self.world_size = torch.distributed.get_world_size() if _distributed() else 1
        self._changed = False
        self.sharded = is_sharded(model)
        if self.sharded and not _distributed():
            raise ValueError("a sharded model (fully_shard) needs torch.distributed initialized")
        self.trainer = LoopTrainer(
            model,
            optimizer,
            evaluate=evaluate,
            weight_per_step=weight_per_step * self.world_size,
            architecture=architecture,
            on_params_loaded=self._mark_changed,
        )
        self._agent: Any = None
        self._sigterm_before: Any = None
        self._thread: threading.Thread | None = None
        self._hook: Any = None
        self.exit_code: int | None = None
        self._finished = False
        self._finish_announced = False
        self._failure: RankFailure | None = None  # a sync call's on this rank (not rank 0)
        # Rank 0's flags and sync calls travel on a gloo group of every rank: CPU objects,
        # whatever backend the script's own group has (NCCL for CUDA tensors). The sync calls'
        # own collectives on another, whose timeout bounds a wait for a rank that failed.
        self._control: Any = None
        sync_group: Any = None
        if _distributed() and self.world_size > 1:
            self._control = torch.distributed.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
            if self.sharded:
                sync_group = torch.distributed.new_group(
                    backend="gloo", timeout=timedelta(seconds=self.config.rank_timeout_s)
                )
        self._ranks: RankSync | None = None
        if self.sharded:
            self._ranks = RankSync(
                model,
                group=sync_group,
                decay=self.config.error_feedback_decay,
                evaluate=evaluate,
                optimizer=optimizer,
            )
            if self.rank == 0:
                self.trainer.sharded_sync = LeaderSync(self._ranks, self._announce)

    def _mark_changed(self) -> None:
        self._changed = True

    @property
    def finished(self) -> bool:
        """True once the federation is over for this site (the coordinator finished it)."""
        return self._finished

    def record_loss(self, loss: float | torch.Tensor) -> None:
        """Report a step's training loss (shown as the site's train loss; optional)."""
        self.trainer.record_loss(float(loss))

    def __enter__(self) -> Federation:
        self._hook = self.optimizer.register_step_post_hook(lambda *_: self._after_step())
        self._catch_sigterm()
        if self.rank != 0:
            self._follow()  # the initial model rank 0 holds
            return self
        from site_agent.agent import SiteAgent

        self._agent = SiteAgent(self.config, trainer=self.trainer)
        self._agent.start()
        self._thread = threading.Thread(target=self._run_agent, name="crossdc-agent", daemon=True)
        self._thread.start()
        self.trainer.wait_for_turn()
        if self._finished and self.exit_code:
            self.__exit__(None, None, None)  # raises: the site stopped before training
        self._broadcast_flag()
        return self

    def _catch_sigterm(self) -> None:
        """SIGTERM (a scheduler stopping the job; torchrun passes it to every rank) drains the
        site instead of killing it: rank 0's agent leaves at its next point between steps
        (LEAVE, a checkpoint), the federation is then finished for this site, and every rank's
        loop sees ``fed.finished``. Only where the script has no SIGTERM handler of its own, and
        only from the main thread (where Python runs handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return
        self._sigterm_before = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._agent is not None:
            self._agent.request_stop("SIGTERM")
        # The other ranks follow rank 0 out: its agent's last calls, then the finish.

    def _run_agent(self) -> None:
        assert self._agent is not None
        try:
            try:
                self.exit_code = self._agent.run()
            except _Stopped:
                log.info("[site=%s] the training loop ended: leaving", self.config.site_id)
                self._agent.leave("the training loop ended")
                self._agent.save_checkpoint()  # may fail too: then the site crashed
                self.exit_code = EXIT_OK
        except BaseException:
            log.exception("[site=%s] the agent failed", self.config.site_id)
            self.exit_code = EXIT_CRASHED
        finally:
            self._finished = True
            self.trainer.agent_done()

    def _after_step(self) -> None:
        if self.rank == 0:
            self.trainer.after_step()
            self._broadcast_flag()
        else:
            self._follow()

    # -- torchrun: rank 0 leads, the others follow ------------------------------------------

    def _broadcast_flag(self) -> None:
        if self.world_size == 1 or self._finish_announced:
            self._changed = False
            return
        self._finish_announced = self._finished
        changed = self._changed and not self.sharded
        bits = changed * _STATE | self._finished * _FINISHED
        if self._finished:
            bits |= (self.exit_code or 0) << _CODE_SHIFT  # the agent's exit status, with it
        flag = torch.tensor([bits], dtype=torch.int64)
        torch.distributed.broadcast(flag, src=0, group=self._control)
        if changed:
            self._broadcast_state()
        self._changed = False

    def _announce(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Rank 0's agent makes sync call ``method``: the other ranks, waiting between two
        steps (``_follow``), are told to make it too."""
        if self.world_size == 1:
            return
        pickle.dumps((method, args, kwargs))  # what cannot be sent fails before the flag goes
        call = torch.tensor([_CALL], dtype=torch.int64)
        torch.distributed.broadcast(call, src=0, group=self._control)
        torch.distributed.broadcast_object_list(
            [(method, args, kwargs)], src=0, group=self._control
        )

    def _follow(self) -> None:
        """A rank other than 0, between two steps: make the sync calls rank 0 names, until it
        says the loop goes on (or the federation finished)."""
        while not self._finished:
            flag = torch.zeros(1, dtype=torch.int64)
            torch.distributed.broadcast(flag, src=0, group=self._control)
            if int(flag) & _CALL:
                box: list[Any] = [None]
                torch.distributed.broadcast_object_list(box, src=0, group=self._control)
                method, args, kwargs = box[0]
                assert self._ranks is not None, "sync calls are for a sharded model"
                try:
                    getattr(self._ranks, method)(*args, **kwargs)
                except Exception as exc:
                    # Raised on every rank at one collective (RankFailure: rank 0's agent stops
                    # on it), or rank 0 learns of it at its next one, the sync group's timeout
                    # at the latest: follow on until rank 0 says what follows.
                    log.error(
                        "[site=%s rank=%d] sync call %s failed: %s",
                        self.config.site_id,
                        self.rank,
                        method,
                        exc,
                    )
                    if self._failure is None:
                        self._failure = _as_rank_failure(exc, self.rank, method)
                continue
            if int(flag) & _STATE:
                self._broadcast_state()
            if int(flag) & _FINISHED:
                self._finished = True
                self.exit_code = int(flag) >> _CODE_SHIFT
            return

    def _broadcast_state(self) -> None:
        with torch.no_grad():
            for tensor in federated_state(self.model).values():
                torch.distributed.broadcast(tensor.data, src=0)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._sigterm_before is not None:
            signal.signal(signal.SIGTERM, self._sigterm_before)
            self._sigterm_before = None
        if self.rank != 0:
            # Rank 0's agent may still sync (a checkpoint as it leaves): make its calls until
            # it says the federation is over for this site.
            self._follow()
            if exc_type is None and self._failure is not None:
                raise self._failure
            if exc_type is None and self.exit_code:
                raise RuntimeError(
                    f"[site={self.config.site_id}] the site agent on rank 0 stopped with exit "
                    f"code {self.exit_code}; its log says why"
                )
            return
        if self._agent is None:
            return
        if not self._finished:
            # The agent leaves at its next point between steps, or when it next asks for steps.
            self._agent.request_stop("the training loop ended")
        self.trainer.loop_done()
        assert self._thread is not None
        self._thread.join()
        self._agent.close()
        self._agent = None
        self._broadcast_flag()  # the other ranks leave the block too
        if exc_type is None and self.exit_code:
            raise RuntimeError(
                f"[site={self.config.site_id}] the site agent stopped with exit code "
                f"{self.exit_code}; its log says why"
            )


# What rank 0 tells the other ranks at a step (bits of a flag): the federated state follows
# (a model every rank holds whole), the federation finished (its agent's exit status in the bits
# from _CODE_SHIFT), a sync call follows.
_STATE, _FINISHED, _CALL = 1, 2, 4
_CODE_SHIFT = 8

CONTROL_TIMEOUT = timedelta(days=7)
"""How long the other ranks wait for rank 0's word between two steps: as long as its agent
spends between them (waiting for a round, a result, the other sites)."""


def _as_rank_failure(exc: Exception, rank: int, method: str) -> RankFailure:
    """``exc``, raised on ``rank`` in sync call ``method``, as a RankFailure naming them (a
    RankFailure as it is: it names the rank that failed)."""
    if isinstance(exc, RankFailure):
        return exc
    failure = RankFailure(failed(exc, rank, f"making sync call {method!r}"))
    failure.__cause__ = exc
    return failure


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
