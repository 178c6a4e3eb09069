"""The synchronous data-parallel baseline that ``crossdc bench ddp`` and ``crossdc bench wan``
measure crossdc against: one gradient all-reduce over the WAN per inner step.

This package owns the baseline's coordinator and site. Every inner step each participating site
sends the gradient of its own batch (:class:`~comm.wire.schema.StepGrad`, fp32, weighted by its
tokens); once all of them are in, the coordinator computes the token-weighted mean
(``coordinator.strategies.base.weighted_mean``, sites in id order, so the mean is a pure function of the
inputs) and broadcasts it (:class:`~comm.wire.schema.StepMean`). Every site applies the same mean with
the same AdamW step, so the sites stay bit-identical and the coordinator holds no parameters.

Protocol, over the same channels as DiLoCo:

- sites ``Join``, declaring their fingerprint, initial state hash and ``capabilities["param_spec"]``
  (``[[name, shape], ...]``); every joiner must match the first one, so all start from the same
  parameters. The run starts once ``min_sites`` have joined; later joiners are refused.
- the run is cut into segments of ``eval_every`` steps (one segment when evaluation is off). Each
  segment opens with a ``RoundStart`` (``round_id`` = segment number, ``global_version`` = steps
  done, ``num_inner_steps`` = steps in the segment); the first participant (by id) is asked to
  ``evaluate`` the model it holds before training the segment. After the last step a segment of
  zero steps asks it for the final validation loss.
- then every site gets ``Shutdown``; a participant that leaves or falls silent ends the run early.

Modules: ``decision`` (the coordinator's config, what it admits and its pure decision),
``coordinator`` (the coordinator's service loop), ``trainer`` (a ``LocalTrainer`` driven one
gradient at a time), ``site`` (a site's loop) and ``__main__`` (the processes:
``python -m crossdc.ddp coordinator --config FILE`` and ``python -m crossdc.ddp site --config
FILE``).

The roles (``coordinator``, ``site_agent``, ``comm``) never import this package.
"""
