"""``crossdc status``: a role's status from its ``/status`` URL or a coordinator's state dir."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from typing import TYPE_CHECKING

from crossdc.cli_common import EXIT_BAD_CONFIG, SubParsers, add_command
from crossdc.progress_view import format_metrics

if TYPE_CHECKING:
    import ssl


def _status_request(url: str, args: argparse.Namespace) -> urllib.request.Request:
    """The GET of ``url``, with basic auth from ``--user`` and ``--password-file``."""
    import base64
    from pathlib import Path

    request = urllib.request.Request(url)
    if bool(args.user) != bool(args.password_file):
        raise ValueError("--user and --password-file go together")
    if args.user:
        try:
            password = Path(args.password_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read --password-file {args.password_file}: {exc}") from None
        token = base64.b64encode(f"{args.user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    return request


def _status_tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """For https URLs: the system's trusted CAs, or only ``--ca-file``'s."""
    import ssl

    if not args.url.startswith("https://"):
        return None
    return ssl.create_default_context(cafile=args.ca_file or None)


def cmd_status(args: argparse.Namespace) -> int:
    """A role's status from its ``/status`` URL, or a coordinator's from its state directory
    (``--state-dir``). A status carries the last rounds only; ``--history`` adds every round
    and validation loss from the state directory."""
    from pathlib import Path

    from coordinator.history_log import read_history

    if args.history and not args.state_dir:
        print(
            "crossdc status: --history reads the state directory: give --state-dir",
            file=sys.stderr,
        )
        return EXIT_BAD_CONFIG
    if args.state_dir:
        path = Path(args.state_dir) / "status.json"
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"crossdc status: cannot read {path}: {exc}", file=sys.stderr)
            return 1
    else:
        url = args.url.rstrip("/") + "/status"
        try:
            request = _status_request(url, args)
        except ValueError as exc:
            print(f"crossdc status: {exc}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        try:
            with urllib.request.urlopen(
                request, timeout=5, context=_status_tls_context(args)
            ) as resp:
                status = json.load(resp)
        except OSError as exc:
            print(f"crossdc status: cannot reach {url}: {exc}", file=sys.stderr)
            return 1
    if args.history:
        try:
            log = read_history(args.state_dir)
        except (OSError, ValueError) as exc:
            print(f"crossdc status: cannot read the history: {exc}", file=sys.stderr)
            return 1
        status["history"] = list(log.history)
        status["history_count"] = len(log.history)
        status["val_losses"] = {str(k): v for k, v in sorted(log.val_losses.items())}
        status["val_metrics"] = {str(k): v for k, v in sorted(log.val_metrics.items())}
    if args.json:
        print(json.dumps(status, indent=1, sort_keys=True))
        return 0
    for key in ("global_version", "rounds_completed", "members", "open_round", "finished"):
        if key in status:
            print(f"{key:>18}: {status[key]}")
    if args.history:
        vals, metrics = status["val_losses"], status["val_metrics"]
        for h in status["history"]:
            val = vals.get(str(h.get("global_version")))
            print(
                f"round {h.get('round_id')}: v{h.get('global_version')} "
                f"train_loss {h.get('train_loss', float('nan')):.4f} "
                f"val_loss {'n/a' if val is None else f'{val:.4f}'} "
                f"{h.get('duration_s', float('nan')):.1f}s"
                f"{format_metrics(metrics.get(str(h.get('global_version')), {}))}"
            )
    return 0


def add_status_command(sub: SubParsers) -> None:
    s = add_command(sub, "status", help="show a running role's /status")
    s.add_argument("--url", default="http://127.0.0.1:9710")
    s.add_argument("--ca-file", default="", help="PEM CA to verify an https --url against")
    s.add_argument("--user", default="", help="basic auth user ([*.http] basic_auth_user)")
    s.add_argument("--password-file", default="", help="file holding the basic auth password")
    s.add_argument(
        "--state-dir", default="", help="read a coordinator's status.json here instead of --url"
    )
    s.add_argument(
        "--history", action="store_true", help="every round, from --state-dir (not the last few)"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
