"""``crossdc bench fuzz``: coverage-guided fuzzing of every decoder that reads network bytes.

The targets (``crossdc/bench/fuzz_targets.py``): frames and headers (``comm.wire.frames``), chunk
reassembly (``comm.transport.receiver`` over ``comm.wire.chunking``) and the transfer drivers'
acknowledgements, tensor payloads (``comm.wire.tensors``), every codec's decode
(``comm.codecs``), site and CA certificates and revocation lists as the loaders read them
(``comm.security.certs``, ``crl``), and ZAP requests (``comm.security.zap``). A decoder may
refuse an input only with its documented error (``WireError``, ``ValueError``, ``AuthError``);
any other exception, a result that breaks its contract, or an input that runs past
``--per-input-s`` is a finding. The engine is atheris (libFuzzer) when the ``fuzz`` extra is
installed, else a built-in loop with line-arc coverage (``crossdc/bench/fuzz_engines.py``).

``--live`` then starts a real ``crossdc coordinator`` process with a key kit and two simulated
sites that close rounds, and sends it mutated valid frames over a CURVE connection of its own
(``crossdc/bench/fuzz_live.py``): the coordinator must survive and keep closing rounds.

Prints executions, coverage and findings (``--json``); exits 1 when there is a finding.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from crossdc.bench import print_report
from crossdc.bench.fuzz_engines import EngineResult, atheris_available, run_atheris, run_builtin


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="crossdc bench fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="decoder fuzzing time (0: none)")
    p.add_argument(
        "--engine",
        choices=("auto", "atheris", "builtin"),
        default="auto",
        help="auto: atheris when installed (the fuzz extra), else builtin",
    )
    p.add_argument(
        "--per-input-s",
        type=float,
        default=2.0,
        help="an input that runs longer is a hang (atheris: whole seconds, wall time; builtin: "
        "CPU time)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--live", action="store_true", help="also fuzz a live coordinator process")
    p.add_argument(
        "--live-seconds", type=float, default=None, help="live fuzzing time (default --seconds)"
    )
    p.add_argument("--workdir", default="", help="keep the corpus, artifacts and logs here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.seconds < 0 or args.per_input_s <= 0:
        p.error("--seconds must be >= 0 and --per-input-s > 0")
    if args.engine == "atheris" and not atheris_available():
        p.error("--engine atheris: atheris is not installed (pip install 'crossdc[fuzz]')")
    if args.live_seconds is None:
        args.live_seconds = args.seconds
    if args.live_seconds < 0:
        p.error("--live-seconds must be >= 0")
    return args


def _decoders(args: argparse.Namespace, workdir: Path) -> EngineResult:
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if atheris_available() else "builtin"
    if engine == "atheris":
        return run_atheris(
            args.seconds, per_input_s=args.per_input_s, seed=args.seed, workdir=workdir
        )
    return run_builtin(args.seconds, per_input_s=args.per_input_s, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    with tempfile.TemporaryDirectory(prefix="crossdc-fuzz-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {
            "config": {
                "seconds": args.seconds,
                "engine": args.engine,
                "per_input_s": args.per_input_s,
                "seed": args.seed,
                "live": args.live,
                "live_seconds": args.live_seconds,
            }
        }
        findings: list[dict[str, Any]] = []
        if args.seconds > 0:
            started = time.monotonic()
            result = _decoders(args, workdir / "decoders")
            wall = time.monotonic() - started
            findings += result.findings
            report.update(
                engine=result.engine,
                executions=result.executions,
                executions_per_second=round(result.executions / max(wall, 1e-9)),
                coverage=result.coverage,
                corpus=result.corpus,
                targets=len(result.per_target),
                executions_per_target=result.per_target,
                restarts=result.restarts,
            )
        if args.live:
            from crossdc.bench.fuzz_live import run_live

            live = run_live(args.live_seconds, seed=args.seed, workdir=workdir / "live")
            findings += live.pop("findings")
            report["live"] = live
        report["findings"] = findings
    print_report(report, as_json=args.json)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
