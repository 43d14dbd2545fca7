"""``slipstream tenants``: make API keys, hash them for the tenants file, check a file.

    slipstream tenants new-key [--id NAME]  --> the key (give it to the tenant, once) and the
                                                api_keys entry with its digest (for the file)
    echo -n KEY | slipstream tenants hash-key [--id NAME] --> the entry for a key you have
    slipstream tenants check FILE           --> validates it as serve/router would

The key is read from standard input, never from the command line, where ``ps`` and shell
history would keep it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slipstream.agent.server.tenancy.config import load_tenants
from slipstream.agent.server.tenancy.keys import check_key_strength, key_digest, new_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tenants_command", metavar="ACTION", required=True)
    make = sub.add_parser("new-key", help="generate a random API key and its tenants-file entry")
    make.add_argument("--id", default="key-1", help="the key's id in the file (for logs)")
    hashing = sub.add_parser("hash-key", help="the tenants-file entry for a key read from stdin")
    hashing.add_argument("--id", default="key-1", help="the key's id in the file (for logs)")
    check = sub.add_parser("check", help="validate a tenants file")
    check.add_argument("file", type=Path)


def entry(key_id: str, key: str) -> str:
    return f"- {{id: {key_id}, sha256: {key_digest(key)}}}"


def run(args: argparse.Namespace) -> int:
    if args.tenants_command == "new-key":
        key = new_key()
        print(key)  # stdout: the key alone, for a pipe; it is stored nowhere
        print(f"# give the key above to the tenant; in the tenants file, under its api_keys:"
              f"\n  {entry(args.id, key)}", file=sys.stderr)
        return 0
    if args.tenants_command == "hash-key":
        key = sys.stdin.readline().strip()
        try:
            check_key_strength(key)
        except ValueError as error:
            print(f"refused: {error}", file=sys.stderr)
            return 2
        print(entry(args.id, key))
        return 0
    try:
        tenants_file = load_tenants(args.file)
    except (OSError, ValueError) as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    for tenant in tenants_file.tenants:
        live = sum(1 for key in tenant.api_keys if not key.revoked)
        print(f"{tenant.name}: weight {tenant.weight:g}, {live} live keys, SLO classes "
              f"{', '.join(tenant.slo_classes)} (default {tenant.default_slo_class}), "
              f"limits {tenant.limits.model_dump(exclude_none=True) or 'none'}")
    return 0
