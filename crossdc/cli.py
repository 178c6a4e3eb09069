"""The ``crossdc`` command: coordinator, agent, demo, bench, plot; keys (``crossdc.cli_keys``) and
status (``crossdc.cli_status``), on the parser pieces every command shares (``crossdc.cli_common``).

Every command that reports takes ``--json``. A bad config prints one line naming the field and
exits with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from crossdc.cli_common import (
    EXIT_BAD_CONFIG,
    LOG_FORMATS,
    LOG_LEVELS,
    SubParsers,
    add_command,
    global_options,
    setup_logging,
)
from crossdc.cli_keys import add_keys_command
from crossdc.cli_status import add_status_command
from crossdc.demo_args import add_demo_arguments

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig, InitialModelConfig
    from coordinator.initial_model import DescribedModel, InitialModel
    from coordinator.service import Coordinator
    from coordinator.shard_service import FollowShard, LeadShard
    from coordinator.sharding import ShardIdentity
    from site_agent.config import SiteConfig
    from site_agent.jobs.bytegpt.model_config import ModelConfig


class _VersionAction(argparse.Action):
    """``--version``: print ``crossdc VERSION`` and exit; the installed version is looked up
    only then, not each time the parser is built."""

    def __init__(self, option_strings: Sequence[str], dest: str, **_kw: Any) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="show program's version number and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any) -> None:
        print(f"crossdc {package_version()}")
        parser.exit()


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("crossdc")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum: int, _frame: Any) -> None:
        logging.getLogger("crossdc").info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _insecure_override(args: argparse.Namespace) -> dict[str, Any]:
    """``--insecure`` replaces the security table: no kit, no CURVE."""
    return {"security": {"insecure": True}} if args.insecure else {}


def _initial_model(
    cfg: InitialModelConfig | None, identity: ShardIdentity
) -> DescribedModel | None:
    """θ0 as every site builds it from ``[coordinator.initial_model]`` (the embedded model),
    described: built only if the coordinator's start needs it (``coordinator.initial_model``), so
    that a restart that finds its state imports no torch. Its model options are checked here,
    at every start. With several shards only this shard's part is built, with the whole θ0's
    shapes and state hash: a shard draws θ0 a tensor at a time and keeps only its part
    (``coordinator.sharding.keep_part``), never holding the rest."""
    if cfg is None:
        return None
    from coordinator.initial_model import DescribedModel
    from site_agent.jobs.bytegpt.model_config import ModelConfig

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(cfg.model) - known)
    if unknown:
        raise ValueError(
            f"unknown key coordinator.initial_model.model.{unknown[0]} "
            f"(known: {', '.join(sorted(known))})"
        )
    try:
        model_cfg = ModelConfig(**cfg.model)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"coordinator.initial_model.model: {exc}") from None
    description = {"job": "bytegpt", "seed": cfg.seed, "model": dataclasses.asdict(model_cfg)}
    return DescribedModel(description, lambda: _build_initial(model_cfg, cfg.seed, identity))


def _build_initial(model_cfg: ModelConfig, seed: int, identity: ShardIdentity) -> InitialModel:
    """θ0 of the byte GPT at ``model_cfg`` and ``seed`` (this shard's part with several)."""
    import torch

    from coordinator.initial_model import InitialModel
    from coordinator.sharding import keep_part
    from site_agent.jobs.bytegpt.model import (
        ByteGPT,
        initial_parameters,
        initial_tensors,
        model_fingerprint,
    )

    fingerprint = model_fingerprint(model_cfg)
    if identity.count == 1:
        return InitialModel(initial_parameters(model_cfg, seed), fingerprint)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in ByteGPT(model_cfg).named_parameters()}
    own, whole = keep_part(initial_tensors(model_cfg, seed), shapes, identity)
    return InitialModel(own, fingerprint, whole)


def _this_shard(cfg: CoordinatorConfig, flag: str | None) -> ShardIdentity:
    """Which shard of ``cfg``'s this process is (``coordinator/sharding.py``): shard 0 of 1
    with one shard."""
    from coordinator.sharding import resolve, shard_config

    identity = resolve(cfg.shards, flag, os.environ)
    shard_config(cfg, identity)  # checks the shard's place
    if identity.count > 1:
        logging.getLogger("crossdc").info(
            "[coordinator] shard %d of %d (from %s)",
            identity.index,
            identity.count,
            identity.source,
        )
    return identity


def cmd_coordinator(args: argparse.Namespace) -> int:
    from comm.ops.configio import ConfigError
    from comm.ops.observe import ObserveServer
    from coordinator.config import load_coordinator_config
    from coordinator.service import Coordinator

    try:
        cfg = load_coordinator_config(args.config, **_insecure_override(args))
        identity = _this_shard(cfg, args.shard)
    except (ConfigError, ValueError) as exc:
        print(f"crossdc coordinator: bad config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        initial = _initial_model(cfg.initial_model, identity)
    except ValueError as exc:
        print(f"crossdc coordinator: bad config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    service: Coordinator | LeadShard | FollowShard
    try:  # loads the key kit and the state's store
        if identity.count > 1:
            from coordinator.shard_service import build_shard

            service = build_shard(cfg, identity, initial, os.environ)
            coord, cfg = service.coord, service.coord.cfg
        else:
            service = coord = Coordinator(cfg, initial=initial)
    except (ValueError, OSError) as exc:  # AuthError is a ValueError
        print(f"crossdc coordinator: cannot start: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    http = None
    if cfg.metrics_port:
        try:  # reads the TLS and password files: a bad one is a bad config, before any bind
            http = ObserveServer(
                registry=coord.metrics.registry,
                status=coord.status,
                host=cfg.metrics_host,
                port=cfg.metrics_port,
                security=cfg.http,
                on_refused=coord.metrics.refused,
            )
        except (ValueError, OSError) as exc:
            service.close()
            print(f"crossdc coordinator: cannot start: {exc}", file=sys.stderr)
            return EXIT_BAD_CONFIG
    stop = threading.Event()
    _stop_on_signals(stop)
    try:
        service.start()
    except ValueError as exc:  # the state dir holds another model than initial_model builds
        service.close()
        print(f"crossdc coordinator: cannot start: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if http is not None:
        http.start()
    try:
        service.run(stop)
    finally:
        service.close()
        if http is not None:
            http.close()
    return 0


def _die_with_parent() -> None:
    """In torchrun's process before it starts: SIGTERM it when the agent dies, however (Linux's
    ``PR_SET_PDEATHSIG``), so an agent killed outright does not leave torchrun and its ranks
    training on without a supervisor; torchrun passes the SIGTERM on to every rank."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _supervise_torchrun(cfg: SiteConfig, command: list[str]) -> int:
    """Run a pipelined site's torchrun as a child: SIGTERM and SIGINT go to it (so under
    ``KillMode=mixed`` the leader drains and sends LEAVE), and the exit status is the leader's
    own (2, 3, 4, ...), not torchrun's "a worker failed". Torchrun ends with the agent."""
    import subprocess

    from site_agent.launch import leader_exit_path, read_leader_exit

    log = logging.getLogger("crossdc")
    cfg.state_path.mkdir(parents=True, exist_ok=True)
    leader_exit_path(cfg).unlink(missing_ok=True)
    log.info("[site=%s] launching %s", cfg.site_id, " ".join(command))
    child = subprocess.Popen(command, preexec_fn=_die_with_parent)

    def forward(signum: int, _frame: Any) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    torchrun_code = child.wait()
    code = read_leader_exit(cfg)
    if code is None:
        log.error("[site=%s] torchrun exited %d before the leader did", cfg.site_id, torchrun_code)
        return torchrun_code or 1
    return code


def cmd_agent(args: argparse.Namespace) -> int:
    from comm.ops.configio import ConfigError
    from site_agent.config import load_site_config
    from site_agent.launch import build_agent, run_pipeline_site, torchrun_argv, under_torchrun

    try:
        cfg = load_site_config(
            args.config, **_insecure_override(args), stages=args.stages, replicas=args.replicas
        )
    except ConfigError as exc:
        print(f"crossdc agent: bad config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    pipelined = cfg.stages * cfg.replicas > 1
    if pipelined and not under_torchrun():
        # The site spans several processes: become torchrun, which starts them all.
        argv = ["agent", "--config", args.config, f"--stages={cfg.stages}"]
        argv += [f"--replicas={cfg.replicas}"] + (["--insecure"] if args.insecure else [])
        return _supervise_torchrun(cfg, torchrun_argv(cfg, argv))
    if pipelined:
        return run_pipeline_site(cfg)
    try:
        agent = build_agent(cfg)  # loads data, the model and the site's key kit
    except (ValueError, OSError) as exc:  # AuthError (an expired certificate) is a ValueError
        print(f"crossdc agent: cannot start: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    agent.start()
    try:
        return agent.run()
    except KeyboardInterrupt:
        agent.leave("stopped by signal")
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # close() is bounded by the socket linger
        agent.close()


def cmd_demo(args: argparse.Namespace) -> int:
    from crossdc.demo import run_demo

    return run_demo(args)


def cmd_plot(args: argparse.Namespace) -> int:
    from crossdc.plot import main as plot_main

    rc: int = plot_main(args.rest)
    return rc


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"crossdc.bench.{args.suite}")
    rc: int = module.main(args.rest)
    return rc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="crossdc",
        description=(
            "Train one model across several data centers: the coordinator, a site agent, the "
            "demo, benchmarks, plots, federation keys and status. Every command that reports "
            "takes --json; a bad config prints one line naming the field and exits with 2."
        ),
        parents=[global_options(suppress=False)],
    )
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True)
    _add_role_commands(sub)
    add_keys_command(sub)
    add_status_command(sub)
    _add_bench_command(sub)
    pl = add_command(sub, "plot", help="PNG figures of a run directory (crossdc plot RUN_DIR)")
    pl.add_argument("rest", nargs=argparse.REMAINDER)
    pl.set_defaults(func=cmd_plot)
    return p


def _add_role_commands(sub: SubParsers) -> None:
    """``coordinator``, ``agent`` and ``demo``."""
    c = add_command(sub, "coordinator", help="run the coordinator service")
    c.add_argument("--config", required=True, help="TOML file with a [coordinator] table")
    c.add_argument("--insecure", action="store_true", help="no CURVE, no certificates (loopback)")
    c.add_argument(
        "--shard",
        default=None,
        help="with [coordinator] shards > 1: this process's shard, N or 'ordinal' (a "
        "StatefulSet pod's); default: CROSSDC_SHARD, else torchrun's RANK",
    )
    c.set_defaults(func=cmd_coordinator)

    a = add_command(sub, "agent", help="run a site agent")
    a.add_argument("--config", required=True, help="TOML file with a [site] table")
    a.add_argument("--insecure", action="store_true", help="no CURVE, no certificates (loopback)")
    a.add_argument("--stages", type=int, default=None, help="pipeline stages (overrides config)")
    a.add_argument("--replicas", type=int, default=None, help="data-parallel replicas (overrides)")
    a.set_defaults(func=cmd_agent)

    d = add_command(sub, "demo", help="a coordinator and N sites on this machine")
    add_demo_arguments(d)
    d.set_defaults(func=cmd_demo)


def _add_bench_command(sub: SubParsers) -> None:
    b = add_command(sub, "bench", help="benchmarks (print JSON with --json)")
    b.add_argument(
        "suite",
        choices=[
            "chaos",
            "codecs",
            "convergence",
            "ddp",
            "delivery",
            "equal_tokens",
            "fold",
            "fuzz",
            "hostile",
            "pipeline",
            "scale",
            "site_memory",
            "wan",
            "wan_goodput",
        ],
    )
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    for name, allowed in (("CROSSDC_LOG_LEVEL", LOG_LEVELS), ("CROSSDC_LOG_FORMAT", LOG_FORMATS)):
        value = os.environ.get(name)
        if value is not None and value.strip().lower() not in allowed:
            parser.error(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if getattr(args, "func", None) is not cmd_plot:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        # argparse leaves a REMAINDER that starts with an option (plot --frontier ...) unknown:
        # the plot command takes every token after its name.
        tokens = list(sys.argv[1:] if argv is None else argv)
        args.rest = tokens[tokens.index("plot") + 1 :]
    setup_logging(args.log_level, args.log_format)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
