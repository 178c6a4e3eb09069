"""``crossdc status``: a role's status from its ``/status`` URL or a coordinator's state dir.

Building the parser imports nothing beyond ``crossdc.cli_common``; the command imports the HTTP
client, TLS and the coordinator's history reader when it uses them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crossdc.cli_common import EXIT_BAD_CONFIG, SubParsers, add_command
from crossdc.progress_view import format_metrics

if TYPE_CHECKING:
    import ssl
    import urllib.request


def _status_request(url: str, args: argparse.Namespace) -> urllib.request.Request:
    """The GET of ``url``, with basic auth from ``--user`` and ``--password-file``."""
    import base64
    import urllib.request

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


class _StatusFailed(Exception):
    """Why no status can be shown, and the exit code that says so."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def cmd_status(args: argparse.Namespace) -> int:
    """A role's status from its ``/status`` URL, or a coordinator's from its state directory
    (``--state-dir``). A status carries the last rounds only; ``--history`` adds every round
    and validation loss from the state directory."""
    if args.history and not args.state_dir:
        print(
            "crossdc status: --history reads the state directory: give --state-dir",
            file=sys.stderr,
        )
        return EXIT_BAD_CONFIG
    try:
        status = _from_state_dir(Path(args.state_dir)) if args.state_dir else _from_url(args)
        if args.history:
            _add_history(status, args.state_dir)
    except _StatusFailed as exc:
        print(f"crossdc status: {exc}", file=sys.stderr)
        return exc.code
    if args.json:
        print(json.dumps(status, indent=1, sort_keys=True))
    else:
        _print_status(status, history=args.history)
    return 0


def _from_state_dir(state_dir: Path) -> dict[str, Any]:
    """The ``status.json`` a coordinator wrote in its state directory."""
    path = state_dir / "status.json"
    try:
        status: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _StatusFailed(f"cannot read {path}: {exc}", 1) from None
    return status


def _from_url(args: argparse.Namespace) -> dict[str, Any]:
    """The status a role serves at ``--url``/status."""
    import urllib.request

    url = args.url.rstrip("/") + "/status"
    try:
        request = _status_request(url, args)
    except ValueError as exc:
        raise _StatusFailed(str(exc), EXIT_BAD_CONFIG) from None
    try:
        with urllib.request.urlopen(request, timeout=5, context=_status_tls_context(args)) as resp:
            status: dict[str, Any] = json.load(resp)
    except OSError as exc:
        raise _StatusFailed(f"cannot reach {url}: {exc}", 1) from None
    return status


def _add_history(status: dict[str, Any], state_dir: str) -> None:
    """Every round and validation result in the state directory's history, into ``status``."""
    from coordinator.history_log import read_history

    try:
        log = read_history(state_dir)
    except (OSError, ValueError) as exc:
        raise _StatusFailed(f"cannot read the history: {exc}", 1) from None
    status["history"] = list(log.history)
    status["history_count"] = len(log.history)
    status["val_losses"] = {str(k): v for k, v in sorted(log.val_losses.items())}
    status["val_metrics"] = {str(k): v for k, v in sorted(log.val_metrics.items())}


def _print_status(status: dict[str, Any], *, history: bool) -> None:
    """The status as text: its counters, and with ``history`` a line per round."""
    for key in ("global_version", "rounds_completed", "members", "open_round", "finished"):
        if key in status:
            print(f"{key:>18}: {status[key]}")
    if not history:
        return
    vals, metrics = status["val_losses"], status["val_metrics"]
    for h in status["history"]:
        val = vals.get(str(h.get("global_version")))
        print(
            f"round {h.get('round_id')}: v{h.get('global_version')} "
            f"train_loss {_four(h.get('train_loss'))} "
            f"val_loss {'n/a' if val is None else f'{val:.4f}'} "
            f"{h.get('duration_s', float('nan')):.1f}s"
            f"{format_metrics(metrics.get(str(h.get('global_version')), {}))}"
        )


def _four(value: Any) -> str:
    """A figure to four places, ``-`` where there is none (no site reported a train loss)."""
    return "-" if value is None else f"{value:.4f}"


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
