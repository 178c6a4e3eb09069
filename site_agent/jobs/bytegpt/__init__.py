"""The embedded default job: a small byte-level GPT trained on byte corpora (by default the
Python standard library's own source), with AdamW and a linear warm-up.

It is one built-in job among others: the site's core knows it only through the job contract
(``site_agent.jobs.contract``), as ``BYTEGPT_FACTORY``, the default of ``site.job.factory``.

- ``model_config``: ``ModelConfig``, the model's shape (no torch: a coordinator checks its
  ``[coordinator.initial_model.model]`` with it and builds nothing);
- ``model``: the model (``ByteGPT``, a plain chain of layers a pipeline can cut), its loss and
  fingerprint;
- ``data``: ``DataConfig``, the corpora (the standard library split by module, or a directory of
  text files) and the seeded batch sampler;
- ``optim``: ``InnerOptimConfig``, AdamW and its warm-up schedule;
- ``job``: ``ByteGPTOptions`` (its ``[site.job.options]``: the tables ``model``, ``data`` and
  ``optim``, and ``eval_batches`` / ``eval_batch_size``), ``ByteGPTJob`` and ``make_job``, the
  factory (``site_agent.jobs.bytegpt:make_job``), with ``check_options``, the check of its
  options the site runs when its config is read.

The names below come from ``job`` when first used, so that importing ``model_config`` alone
loads no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from site_agent.jobs.bytegpt.job import (
        ByteGPTJob,
        ByteGPTOptions,
        check_options,
        make_job,
        mean_loss,
    )

__all__ = ["ByteGPTJob", "ByteGPTOptions", "check_options", "make_job", "mean_loss"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("site_agent.jobs.bytegpt.job"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
