"""What every ``crossdc`` command shares: the exit code of a bad config, the global
``--log-level`` and ``--log-format`` options and the logging they set up (``setup_logging``),
and ``add_command``, which gives a (sub)command those options after its name too.

``crossdc.cli`` assembles the parser from these and from the commands' own modules
(``crossdc.cli_keys``, ``crossdc.cli_status``, ``crossdc.demo_args``), and ``python -m crossdc.ddp`` sets up its logging
with them; none of them imports ``crossdc.cli`` back. Only the standard library is imported here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

EXIT_BAD_CONFIG = 2
"""The exit code of a command refused for its config or its arguments (the roles' too)."""

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")

SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""Where ``add_command`` adds a command: what ``add_subparsers`` returns."""


def choice(kind: str, allowed: Sequence[str]) -> Callable[[str], str]:
    """An argparse type: one of ``allowed``, any case; otherwise an error naming them."""

    def parse(value: str) -> str:
        v = value.strip().lower()
        if v not in allowed:
            raise argparse.ArgumentTypeError(
                f"{kind} must be one of {', '.join(allowed)}, got {value!r}"
            )
        return v

    parse.__name__ = kind
    return parse


def global_options(*, suppress: bool) -> argparse.ArgumentParser:
    """``--log-level`` and ``--log-format``: before the command or after it (``suppress``: the
    command's copy leaves the value given before it alone unless it is given again)."""
    g = argparse.ArgumentParser(add_help=False)
    level = os.environ.get("CROSSDC_LOG_LEVEL", "info")
    fmt = os.environ.get("CROSSDC_LOG_FORMAT", "text")
    g.add_argument(
        "--log-level",
        type=choice("log level", LOG_LEVELS),
        default=argparse.SUPPRESS if suppress else level,
        help=f"{', '.join(LOG_LEVELS)} (default {level}; env CROSSDC_LOG_LEVEL)",
    )
    g.add_argument(
        "--log-format",
        type=choice("log format", LOG_FORMATS),
        default=argparse.SUPPRESS if suppress else fmt,
        help=f"text or json, one object a line (default {fmt}; env CROSSDC_LOG_FORMAT)",
    )
    return g


def add_command(sub: SubParsers, name: str, **kw: Any) -> argparse.ArgumentParser:
    """A (sub)command that takes the global options after its name too."""
    return sub.add_parser(name, parents=[global_options(suppress=True)], **kw)


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message (and the
    exception's traceback when there is one), for log shippers that parse lines."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class TextLogFormatter(logging.Formatter):
    """``time LEVEL logger message``, one line a record: control characters in the message
    (a peer's site id or session can reach it from the wire) are written as escapes, so no value
    can break a line or forge one; an exception's traceback follows on its own lines."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        line = super().formatMessage(record)
        return _CONTROL.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), line)


def setup_logging(level: str, fmt: str = "text") -> None:
    """The root logger's one handler: stderr, as text or as ``JsonLogFormatter`` lines."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        formatter: logging.Formatter = JsonLogFormatter()
        formatter.converter = time.gmtime
    else:
        formatter = TextLogFormatter()
    handler.setFormatter(formatter)
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
