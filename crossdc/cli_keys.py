"""``crossdc keys``: create a federation kit, issue and revoke sites, migrate an older kit."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from crossdc.cli_common import EXIT_BAD_CONFIG, SubParsers, add_command


def cmd_keys(args: argparse.Namespace) -> int:
    from comm.security.common import AuthError
    from comm.security.kits import init_kit, issue_site, revoke_site
    from comm.security.migrate import migrate_kit

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
                coordinator_endpoint=args.endpoint,
            )
            cert = issued.certificate
            out = {
                "site_id": cert.site_id,
                "serial": cert.serial,
                "not_after": cert.not_after,
                "site_kit_dir": str(issued.site_kit_dir),
            }
        elif args.keys_command == "migrate":
            done = migrate_kit(args.kit)
            out = {
                "kit_dir": str(done.kit_dir),
                "certificates": len(done.certificates),
                "revoked_serials": list(done.revoked),
                "backup_dir": str(done.backup_dir),
                "site_files": {
                    site: [str(done.upgrade_dir / site / name) for name in ("site.pem", "ca.pem")]
                    for site in sorted({c.site_id for c in done.certificates})
                },
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
    """``keys init``, ``keys issue``, ``keys revoke`` and ``keys migrate``."""
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
    ks.add_argument("--endpoint", default="tcp://COORDINATOR_HOST:7710")
    ks.add_argument("--json", action="store_true")
    kr = add_command(ksub, "revoke", help="revoke every certificate of a site")
    kr.add_argument("--kit", required=True)
    kr.add_argument("--site", required=True)
    kr.add_argument("--json", action="store_true")
    km = add_command(
        ksub, "migrate", help="convert a format-1 kit to X.509, keeping every site's identity"
    )
    km.add_argument("--kit", required=True)
    km.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_keys)
