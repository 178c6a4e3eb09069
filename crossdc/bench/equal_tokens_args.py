"""The command line of ``crossdc bench equal_tokens``: its arguments, and lists of integers."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from coordinator import strategies
from crossdc.demo_args import add_outer_rule_arguments
from crossdc.progress import add_progress_argument
from site_agent.jobs.bytegpt.optim import InnerOptimConfig


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="crossdc bench equal_tokens", description=description)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--steps", type=int, default=600, help="inner steps of every site (= DDP steps)")
    p.add_argument("--inner-steps", type=int, default=150, help="H: inner steps per round")
    p.add_argument("--batch-size", type=int, default=8, help="per-site batch (the demo's)")
    p.add_argument("--lr", type=float, default=InnerOptimConfig.lr, help="inner AdamW lr")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    add_outer_rule_arguments(p)
    p.add_argument(
        "--overlap-steps",
        type=int,
        default=0,
        help="0: blocking sync; d > 0: overlapped, each result merged d inner steps after the send "
        "(at the slot's end if d >= H, where the site waits for it before sending again)",
    )
    p.add_argument("--codec", default="fp32", help="both directions unless overridden")
    p.add_argument("--uplink-codec", default=None)
    p.add_argument("--downlink-codec", default=None)
    p.add_argument(
        "--strategy",
        default="diloco",
        choices=strategies.names(),
        help=strategies.help_text(),
    )
    p.add_argument("--ef-decay", type=float, default=1.0, help="site residual decay beta")
    p.add_argument(
        "--broadcast",
        default="dense",
        choices=strategies.BROADCASTS,
        help="dense: the outer delta through the downlink codec; sparse ("
        + ", ".join(strategies.supporting(broadcast="sparse"))
        + "): the sites' encoded updates forwarded",
    )
    p.add_argument(
        "--selsync-threshold",
        type=float,
        default=0.0,
        help="SelSync: a site whose accumulator's norm over the parameters' is below this sends "
        "a marker instead of its update (held for later); 0 sends every update",
    )
    _add_run_arguments(p)
    add_progress_argument(p)
    return p


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Evaluation, seed, the baseline cache, processes and the sweep."""
    p.add_argument("--eval-every", type=int, default=150, help="baseline evaluation period")
    p.add_argument("--seed", type=int, default=0, help="model and sampler seed")
    p.add_argument(
        "--baseline-cache",
        default=str(
            Path(os.environ.get("CROSSDC_CACHE_DIR") or Path.home() / ".cache" / "crossdc")
            / "equal_tokens"
        ),
        help="folder of cached baseline curves (default $CROSSDC_CACHE_DIR/equal_tokens or "
        "~/.cache/crossdc/equal_tokens)",
    )
    p.add_argument("--no-baseline-cache", dest="baseline_cache", action="store_const", const=None)
    p.add_argument("--jobs", type=int, default=2, help="processes (the baseline beside DiLoCo)")
    p.add_argument("--sweep", action="store_true", help="run the chunktopk grid below")
    p.add_argument("--sweep-inner-steps", default="30", help="H values, comma-separated")
    p.add_argument("--sweep-k", default="64", help="values kept per chunk, comma-separated")
    p.add_argument("--sweep-bits", default="2", help="bits per kept value (1, 2)")
    p.add_argument("--sweep-chunk", type=int, default=4096)
    p.add_argument("--seeds", default="0,1", help="the sweep's seeds")
    p.add_argument("--out", default="equal_tokens_sweep", help="the sweep's output folder")
    p.add_argument("--json", action="store_true")


def int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{flag} takes comma-separated integers >= 0, got {text!r}")
    return values
