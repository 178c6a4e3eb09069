"""What a site reports about itself with its update, checked before anything uses it.

An :class:`~comm.wire.schema.Update` carries figures the coordinator takes on the site's word:
the tokens it trained on (the update's weight), its mean loss, its compute time and time per
inner step, and its link's round trip and goodput. The planner divides by the step time and the
goodput and rounds the quotients up to inner steps, the ledger multiplies by the weight: a value
that is not finite, or so small that a quotient overflows (``step_seconds = 5e-324``), would
raise at the next round's opening, in every round after it. So every figure must be finite and
within the range below, or the whole update is refused (``NON_FINITE``, ``OUT_OF_RANGE``) and
nothing it says is kept. The ranges are far wider than any real site's figures; 0 means "not
measured" where the field's docstring says so.
"""

from __future__ import annotations

import math

from comm.wire.schema import ErrorCode, Update
from coordinator.round import UpdateRefusal

MAX_WEIGHT = 1e15
"""Tokens (or samples) one update may stand for."""
MIN_WEIGHT = 2.0**-20
"""The smallest weight: the coordinator sums w·x in float32, and a weight that float32 rounds to
0 (below about 1.4e-45) would make a round's sum 0 over a positive total, and its mean NaN. Far
below any real site's token count, far above float32's smallest normal, so w·x keeps float32's
precision."""
MAX_ABS_TRAIN_LOSS = 1e30
"""The largest training loss, either sign (NaN: the site reports none)."""
MAX_COMPUTE_SECONDS = 1e7
"""Compute seconds one round may have taken (about four months)."""
MIN_STEP_SECONDS = 1e-12
"""The shortest inner step (0: not measured): any shorter makes the planner's quotients overflow."""
MAX_STEP_SECONDS = 1e6
"""The longest inner step."""
MAX_RTT_S = 3600.0
"""The longest round trip a site may report (0: not measured)."""
MIN_GOODPUT_BPS = 1.0
"""The lowest goodput, bits/s (0: not measured)."""
MAX_GOODPUT_BPS = 1e15
"""The highest goodput, bits/s."""

# field: (lowest, highest, whether 0 means "not measured" below the lowest)
RANGES: dict[str, tuple[float, float, bool]] = {
    "weight": (MIN_WEIGHT, MAX_WEIGHT, False),
    "train_loss": (-MAX_ABS_TRAIN_LOSS, MAX_ABS_TRAIN_LOSS, False),
    "compute_seconds": (0.0, MAX_COMPUTE_SECONDS, False),
    "step_seconds": (MIN_STEP_SECONDS, MAX_STEP_SECONDS, True),
    "link_rtt_s": (0.0, MAX_RTT_S, False),
    "link_goodput_bps": (MIN_GOODPUT_BPS, MAX_GOODPUT_BPS, True),
}
"""Each reported figure's range, inclusive."""


def check_reported(msg: Update) -> UpdateRefusal | None:
    """None when every figure ``msg`` reports is finite and in range, else the refusal naming
    the first one that is not (a NaN ``train_loss`` is a loss not reported, and passes)."""
    for name, (low, high, zero_unmeasured) in RANGES.items():
        value = getattr(msg, name)
        if name == "train_loss" and math.isnan(value):
            continue
        if not math.isfinite(value):
            return UpdateRefusal(ErrorCode.NON_FINITE, f"{name} {value}")
        if zero_unmeasured and value == 0.0:
            continue
        if not low <= value <= high:
            return UpdateRefusal(
                ErrorCode.OUT_OF_RANGE, f"{name} {value!r} is outside [{low!r}, {high!r}]"
            )
    return None
