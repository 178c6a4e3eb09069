"""The baseline's processes: ``python -m crossdc.ddp coordinator --config FILE`` (FILE holding a
``[ddp]`` table) serves one run and exits 0 when it completed; ``python -m crossdc.ddp site
--config FILE`` (FILE holding the DiLoCo agent's ``[site]`` table, single-process sites only:
``stages = replicas = 1``) runs one site and exits 0 after a clean Shutdown.

This module owns argument parsing, logging setup, signals and exit codes; each role's module is
imported only by the process that runs it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from crossdc.cli_common import LOG_LEVELS, choice, setup_logging

EXIT_OK = 0
EXIT_ABORTED = 1
EXIT_BAD_CONFIG = 2

PROG = "python -m crossdc.ddp"


def run_coordinator(config: str) -> int:
    """Serve one run; 0 when it completed."""
    from comm.ops.configio import ConfigError
    from crossdc.ddp.coordinator import DDPCoordinator, log
    from crossdc.ddp.decision import load_ddp_config

    try:
        cfg = load_ddp_config(config)
    except ConfigError as exc:
        print(f"{PROG} coordinator: bad config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("[ddp] signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    coord = DDPCoordinator(cfg)
    coord.start()
    try:
        coord.run(stop)
    finally:
        coord.close()
    return EXIT_OK if coord.finished and not coord.aborted else EXIT_ABORTED


def run_site(config: str) -> int:
    """One baseline site; 0 after a clean Shutdown."""
    from comm.ops.configio import ConfigError
    from crossdc.ddp.site import build_ddp_site, log
    from site_agent.config import load_site_config

    try:
        cfg = load_site_config(config)
        site = build_ddp_site(cfg)
    except (ConfigError, ValueError) as exc:
        print(f"{PROG} site: bad config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("[site=%s] signal %d: stopping", site.site_id, signum)
        site.stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    site.start()
    try:
        return site.run()
    finally:
        site.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m crossdc.ddp {coordinator,site} --config FILE``."""
    p = argparse.ArgumentParser(
        prog=PROG, description="A process of the synchronous data-parallel baseline."
    )
    p.add_argument("role", choices=["coordinator", "site"])
    p.add_argument("--config", required=True, help="TOML file with a [ddp] or [site] table")
    p.add_argument(
        "--log-level",
        type=choice("log level", LOG_LEVELS),
        default=os.environ.get("CROSSDC_LOG_LEVEL", "info"),
    )
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    if args.role == "coordinator":
        return run_coordinator(args.config)
    return run_site(args.config)


if __name__ == "__main__":
    sys.exit(main())
