"""The atheris child of ``crossdc bench fuzz`` (``crossdc.bench.fuzz_engines`` starts it).

``python -m crossdc.bench.fuzz_atheris --targets I,J,... --findings DIR --stats FILE --
LIBFUZZER_ARGS...``: instruments the ``comm`` modules, then runs libFuzzer over the targets of
``crossdc.bench.fuzz_targets.all_targets()`` at those indices (an input's first byte picks one
of them, the rest is the target's input). A finding is written to ``DIR`` at once, one file per distinct finding, and
fuzzing goes on; the executions per target go to ``FILE`` about once a second (libFuzzer ends
this process without running Python's exit handlers). Mutations are libFuzzer's own and, half
the time, ``crossdc.bench.fuzz_mutate``'s structure-aware ones; one in ten starts from a seed of
a target picked at random, so that every target gets its share.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

SWITCH = 0.1
"""The share of mutations that start from a seed of a target picked at random."""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    split = args.index("--") if "--" in args else len(args)
    p = argparse.ArgumentParser(prog="crossdc.bench.fuzz_atheris")
    p.add_argument("--targets", required=True, help="indices into all_targets(), comma-separated")
    p.add_argument("--findings", required=True)
    p.add_argument("--stats", required=True)
    opts = p.parse_args(args[:split])
    libfuzzer_args = args[split + 1 :]

    import atheris

    warnings.simplefilter("ignore")  # what the parsers warn about malformed input

    with atheris.instrument_imports(include=["comm"]):
        from crossdc.bench import fuzz_targets
    from crossdc.bench.fuzz_mutate import Mutator
    from crossdc.bench.fuzz_seeds import tokens

    everyone = fuzz_targets.all_targets()
    targets = [everyone[int(i)] for i in opts.targets.split(",")]
    words = tokens(t.seeds() for t in targets)
    findings_dir, stats_path = Path(opts.findings), Path(opts.stats)
    per_target = {t.name: 0 for t in targets}
    seen: set[str] = set()
    flushed = [time.monotonic()]

    def one(data: bytes) -> None:
        if not data:
            return
        target = targets[data[0] % len(targets)]
        per_target[target.name] += 1
        finding = fuzz_targets.judge(target, data[1:])
        if finding is not None:
            key = hashlib.sha1(repr(finding.signature).encode()).hexdigest()[:16]
            if key not in seen:
                seen.add(key)
                _write(findings_dir / f"{key}.json", finding.report())
        if time.monotonic() - flushed[0] > 1.0:
            flushed[0] = time.monotonic()
            _write(stats_path, {"per_target": per_target})

    seeds = [t.seeds() for t in targets]

    def mutate(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if data and rng.random() < SWITCH:
            # Another target's seed, mutated: libFuzzer favours the inputs with the rarest
            # features, and without this the targets whose seeds have few starve.
            place = rng.randrange(len(targets))
            data = bytes([place]) + rng.choice(seeds[place])
        elif not data or rng.random() < 0.5:
            return bytes(atheris.Mutate(data, max_size))
        target = targets[data[0] % len(targets)]
        body = Mutator(rng, max_size=max_size - 1, tokens=words).mutate(data[1:], target.shape)
        return bytes([data[0]]) + body

    fuzz_targets.warm_up(targets)
    atheris.Setup([sys.argv[0], *libfuzzer_args], one, custom_mutator=mutate)
    atheris.Fuzz()


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


if __name__ == "__main__":
    main()
