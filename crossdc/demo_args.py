"""The command line of ``crossdc demo``: its arguments and their defaults, and what is wrong with
a given set of them (``argument_problem``).

``crossdc.cli`` adds these to its parser every time it builds one (``crossdc --version`` too), so
this module imports no coordinator and no torch. The outer rule's arguments default to None and
take the coordinator's defaults when a run starts (``resolve_outer_rule_defaults``); the
benchmarks that run a demo federation (``crossdc bench chaos``, ``crossdc bench equal_tokens``)
take the same arguments from here.
"""

from __future__ import annotations

import argparse

from crossdc.demo_roles import DEMO_SEED, job_options
from crossdc.progress import add_progress_argument


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """Every argument of ``crossdc demo``."""
    _add_run_shape_arguments(p)
    _add_sync_arguments(p)
    _add_output_arguments(p)
    _add_link_and_security_arguments(p)
    add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many s")
    add_progress_argument(p)


def add_outer_rule_arguments(p: argparse.ArgumentParser) -> None:
    """--outer-warmup-steps and --outer-final-mean; None where not given, for
    ``resolve_outer_rule_defaults``."""
    p.add_argument(
        "--outer-warmup-steps",
        type=int,
        default=None,
        help="rounds ending at or before this many inner steps merge by a plain mean "
        "(default: the coordinator's)",
    )
    p.add_argument(
        "--outer-final-mean",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the last round merges by a plain mean (the kept model is the sites' average; "
        "default: the coordinator's)",
    )


def resolve_outer_rule_defaults(args: argparse.Namespace) -> None:
    """Give the outer rule's arguments that were not on the command line the coordinator's
    defaults (``CoordinatorConfig``), as a run starts."""
    from coordinator.config import CoordinatorConfig

    if args.outer_warmup_steps is None:
        args.outer_warmup_steps = CoordinatorConfig.outer_warmup_steps
    if args.outer_final_mean is None:
        args.outer_final_mean = CoordinatorConfig.outer_final_mean


def argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (after ``resolve_outer_rule_defaults``); None: nothing."""
    if args.sites < 1 or args.rounds < 1 or args.inner_steps < 1:
        return "--sites, --rounds and --inner-steps must be >= 1"
    if args.outer_warmup_steps < 0:
        return "--outer-warmup-steps must be >= 0"
    problem = outer_strategy_problem(args)
    if problem is not None:
        return problem
    if not 0.0 <= args.error_feedback_decay <= 1.0:
        return f"--error-feedback-decay must be in [0, 1], got {args.error_feedback_decay}"
    if (args.job_path or args.job_option) and not args.job:
        return "--job-path and --job-option need --job"
    try:
        job_options(args, 0)
    except ValueError as exc:
        return str(exc)
    return None


COMMAND_LINE_SPELLING = (
    "--outer-strategy",
    "--broadcast",
    "--secure-aggregation",
    "secure aggregation",
)
"""How the demo's (and ``crossdc bench wan``'s) messages name the strategy's settings."""


def outer_strategy_problem(args: argparse.Namespace) -> str | None:
    """What the strategy registry says of ``--outer-strategy`` with ``--broadcast`` and
    ``--secure-aggregation``; None: they go together."""
    from coordinator import strategies

    # Secure aggregation's masked sum reveals only the sum of a round's updates.
    sum_only = bool(getattr(args, "secure_aggregation", False))
    return strategies.problem(
        args.outer_strategy,
        broadcast=args.broadcast,
        reveals=strategies.Revealed.SUM if sum_only else strategies.Revealed.EACH_UPDATE,
        spelling=strategies.Spelling(*COMMAND_LINE_SPELLING, command_line=True),
    )


def _add_run_shape_arguments(p: argparse.ArgumentParser) -> None:
    """How many sites train how long, on what batches, from which seed."""
    p.add_argument("--sites", type=int, default=3, help="number of site agents (default 3)")
    p.add_argument("--rounds", type=int, default=8, help="outer rounds to train (default 8)")
    p.add_argument("--inner-steps", type=int, default=50, help="H: inner steps per round")
    p.add_argument("--batch-size", type=int, default=8, help="inner batch size per site")
    p.add_argument(
        "--seed",
        type=int,
        default=DEMO_SEED,
        help=f"seed of θ0 and of the sites' sampling (default {DEMO_SEED})",
    )


def _add_sync_arguments(p: argparse.ArgumentParser) -> None:
    """How the sites sync and the coordinator merges, and how each site runs its steps."""
    p.add_argument(
        "--uplink-codec", default="auto", help="codec for site updates (auto: the scheduler's)"
    )
    p.add_argument(
        "--downlink-codec",
        default="auto",
        help="codec for the global delta (auto: the scheduler's)",
    )
    p.add_argument("--fragments", type=int, default=1, help="streaming sync fragments")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum")
    p.add_argument(
        "--outer-strategy",
        default="diloco",
        help="the outer optimizer, by its registered name (coordinator.strategies): diloco "
        "(default): Nesterov outer step; sparseloco: outer SGD, the sites' decayed error "
        "feedback as the only memory",
    )
    p.add_argument(
        "--broadcast",
        choices=("dense", "sparse"),
        default="dense",
        help="dense: the outer delta through the downlink codec; sparse: the round's updates "
        "forwarded (a strategy without momentum, e.g. sparseloco)",
    )
    p.add_argument(
        "--error-feedback-decay",
        type=float,
        default=1.0,
        help="the sites' residual decay per round (SparseLoCo: 0.95)",
    )
    add_outer_rule_arguments(p)
    p.add_argument(
        "--no-overlap", action="store_true", help="block each site on every sync (no overlap)"
    )
    p.add_argument(
        "--no-align-arrivals",
        action="store_true",
        help="every site trains exactly the planned steps (no extra steps for early sites)",
    )
    p.add_argument(
        "--eval-every", type=int, default=1, help="validation loss every N rounds (and the last)"
    )
    p.add_argument("--stages", type=int, default=1, help="pipeline stages per site")


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """Where the run's files, its report and its metrics go."""
    p.add_argument("--workdir", default="", help="where configs, state and logs go")
    p.add_argument("--report", default="", help="write a JSON report here")
    p.add_argument("--metrics-port", type=int, default=0, help="coordinator /metrics port")


def _add_link_and_security_arguments(p: argparse.ArgumentParser) -> None:
    """The emulated WAN links, the keys, differential privacy and secure aggregation."""
    p.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="SITE=PROFILE",
        help="WAN link of a site, e.g. ap=20mbit,150ms (default: eu/us/ap presets, others lan)",
    )
    p.add_argument("--no-wan", action="store_true", help="connect sites directly, no WAN emulator")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="no CURVE and no certificates (default: a fresh federation kit in the work dir)",
    )
    p.add_argument(
        "--dp-noise",
        type=float,
        default=0.0,
        help="differential privacy: Gaussian noise multiplier z on site updates (0: off)",
    )
    p.add_argument("--dp-clip", type=float, default=1.0, help="differential privacy: clip norm C")
    p.add_argument(
        "--secure-aggregation",
        action="store_true",
        help="pairwise-masked updates: the coordinator learns only their sum",
    )


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """Another job than the embedded byte GPT, and its options."""
    p.add_argument(
        "--job",
        default="",
        metavar="FACTORY",
        help="train this job (package.module:callable) instead of the embedded byte GPT",
    )
    p.add_argument(
        "--job-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory put on sys.path before the job's factory is imported (repeatable)",
    )
    p.add_argument(
        "--job-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the job (a TOML value; dotted keys make tables; {site_index} and "
        "{num_sites} are replaced per site), e.g. site_index={site_index} (repeatable)",
    )
