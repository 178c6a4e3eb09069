"""``crossdc keys``: create a federation kit, issue and revoke sites, roll the CA over."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from crossdc.cli_common import EXIT_BAD_CONFIG, SubParsers, add_command

DEFAULT_ENDPOINT = "tcp://COORDINATOR_HOST:7710"


def cmd_keys(args: argparse.Namespace) -> int:
    from comm.security.common import AuthError
    from comm.security.kits import init_kit, issue_site, revoke_site
    from comm.security.rollover import retire_ca, rotate_ca

    try:
        if args.keys_command == "init":
            path = init_kit(args.kit_dir, ca_days=args.ca_days)
            out: dict[str, Any] = {"kit_dir": str(path)}
        elif args.keys_command == "issue":
            issued = issue_site(
                args.kit,
                args.site,
                args.days,
                out_dir=args.out,
                coordinator_endpoint=args.endpoint or [DEFAULT_ENDPOINT],
            )
            cert = issued.certificate
            out = {
                "site_id": cert.site_id,
                "serial": cert.serial,
                "not_after": cert.not_after,
                "site_kit_dir": str(issued.site_kit_dir),
            }
        elif args.keys_command == "rotate-ca":
            rolled = rotate_ca(args.kit, ca_days=args.ca_days, days=args.days)
            out = {
                "ca_fingerprint": rolled.ca.fingerprint,
                "ca_not_after": rolled.ca.not_after,
                "previous_ca_fingerprint": rolled.previous_ca.fingerprint,
                "previous_ca_not_after": rolled.previous_ca.not_after,
                "certificates": [
                    {"site_id": c.site_id, "serial": c.serial, "not_after": c.not_after}
                    for c in rolled.certificates
                ],
                "coordinator_files": [str(p) for p in rolled.coordinator_files],
                "site_files": {s: [str(p) for p in f] for s, f in rolled.site_files.items()},
            }
        elif args.keys_command == "retire-ca":
            retired = retire_ca(args.kit, force=args.force)
            out = {
                "retired_ca_fingerprint": retired.retired_ca.fingerprint,
                "ca_fingerprint": retired.ca.fingerprint,
                "revoked_serials": list(retired.revoked),
                "record_dir": str(retired.record_dir),
                "coordinator_files": [str(p) for p in retired.coordinator_files],
                "site_files": {s: [str(p) for p in f] for s, f in retired.site_files.items()},
            }
        else:
            out = {"site_id": args.site, "revoked_serials": revoke_site(args.kit, args.site)}
    except (ValueError, OSError, AuthError) as exc:
        print(f"crossdc keys {args.keys_command}: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.json:
        print(json.dumps(out, indent=1, sort_keys=True))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 0


def add_keys_command(sub: SubParsers) -> None:
    """``keys init``, ``issue``, ``revoke``, ``rotate-ca`` and ``retire-ca``."""
    k = add_command(sub, "keys", help="federation keys: CA, coordinator and site kits")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    ki = add_command(ksub, "init", help="create a federation kit (CA and coordinator keys)")
    ki.add_argument("kit_dir")
    ki.add_argument(
        "--ca-days", type=float, default=3650.0, help="the CA certificate's validity (days)"
    )
    ki.add_argument("--json", action="store_true")
    ks = add_command(ksub, "issue", help="issue a site its keys, certificate and startup kit")
    ks.add_argument("--kit", required=True)
    ks.add_argument("--site", required=True)
    ks.add_argument("--days", type=float, default=90.0)
    ks.add_argument("--out", default=None, help="where the site's startup kit goes")
    ks.add_argument(
        "--endpoint",
        action="append",
        default=None,
        help="the coordinator's endpoint for the site's starter config; once per shard, shard 0 "
        f"first, for a coordinator of several shards (default: {DEFAULT_ENDPOINT})",
    )
    ks.add_argument("--json", action="store_true")
    kr = add_command(ksub, "revoke", help="revoke every certificate of a site")
    kr.add_argument("--kit", required=True)
    kr.add_argument("--site", required=True)
    kr.add_argument("--json", action="store_true")
    kc = add_command(
        ksub,
        "rotate-ca",
        help="start a CA rollover: a new CA, trusted beside the current one, and every site's "
        "certificate re-issued under it (same keys)",
    )
    kc.add_argument("--kit", required=True)
    kc.add_argument(
        "--ca-days", type=float, default=3650.0, help="the new CA certificate's validity (days)"
    )
    kc.add_argument(
        "--days",
        type=float,
        default=None,
        help="the re-issued certificates' validity from now (days; default: each keeps its expiry)",
    )
    kc.add_argument("--json", action="store_true")
    kx = add_command(
        ksub,
        "retire-ca",
        help="end a CA rollover: the previous CA revokes what it issued and is trusted no more",
    )
    kx.add_argument("--kit", required=True)
    kx.add_argument(
        "--force",
        action="store_true",
        help="retire even if a site's key holds a certificate of the previous CA only",
    )
    kx.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_keys)
