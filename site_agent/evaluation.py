"""Evaluating the global model: the job's validation metrics of the global model this site holds
(not of its local replica), reported to the coordinator and kept for the site's status."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from comm.wire.schema import Eval, Message
from site_agent.metrics import SiteMetrics
from site_agent.trainer import SiteTrainer

log = logging.getLogger("crossdc.site")


class Evaluator:
    """Scores a global model with the trainer's validation; owns the last scores and the time
    spent scoring."""

    def __init__(
        self,
        *,
        site_id: str,
        trainer: SiteTrainer,
        metrics: SiteMetrics,
        send: Callable[[Message], None],
        clock: Callable[[], float],
    ) -> None:
        self.site_id = site_id
        self._trainer = trainer
        self._metrics = metrics
        self._send = send
        self._clock = clock
        self.eval_s = 0.0
        self.last_loss: float | None = None
        self.last_metrics: dict[str, float] = {}

    def evaluate(self, global_params: dict[str, np.ndarray], version: int) -> None:
        """Score ``global_params`` (global version ``version``) and report the scores; the
        trainer's local replica is put back afterwards."""

        def score() -> dict[str, float] | None:
            local = self._trainer.parameters_numpy()
            self._trainer.load_parameters(global_params)
            metrics = self._trainer.validate()
            self._trainer.load_parameters(local)
            return metrics

        self.evaluate_with(score, version)

    def evaluate_with(self, score: Callable[[], dict[str, float] | None], version: int) -> None:
        """Report the scores ``score()`` gives of global version ``version`` (a sharded site's
        ranks score the θ they hold, see ``site_agent.shardsync``)."""
        t0 = self._clock()
        metrics = score()
        if metrics is None:
            return  # the trainer has no validation (a script that gave none)
        if not np.isfinite(metrics["loss"]):
            self._metrics.rejected("non_finite_eval")
            log.warning(
                "[site=%s] the validation loss of v%d is not finite (%s): not reported",
                self.site_id,
                version,
                metrics["loss"],
            )
            return
        self.eval_s += self._clock() - t0
        loss = metrics.pop("loss")
        self.last_loss, self.last_metrics = loss, metrics
        self._metrics.val_loss(loss)
        self._metrics.val_metrics(metrics)
        self._send(
            Eval(site_id=self.site_id, global_version=version, val_loss=loss, metrics=metrics)
        )
        shown = "".join(f" {k}={v:.4f}" for k, v in sorted(metrics.items()))
        log.info("[site=%s] val_loss=%.4f%s at v%d", self.site_id, loss, shown, version)

    def status(self) -> dict[str, Any]:
        return {
            "eval_seconds": self.eval_s,
            "val_loss": self.last_loss,
            "val_metrics": dict(self.last_metrics),
        }
