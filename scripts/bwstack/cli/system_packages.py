"""`bwstack system-packages`: the OS packages the lock says a host needs, for its /etc/os-release.

The rule is `bwstack.lock.model.system_packages_for`; this command is how the Ansible role asks for it (the
node's os-release on stdin, the controller's lock), so the role never picks an entry itself."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bwstack.errors import UsageError
from bwstack.lock.model import load_lock
from bwstack.probe import osrelease


def cmd_system_packages(args: argparse.Namespace) -> int:
    lock = load_lock(args.lock)
    if args.os_release == "-":
        fields = osrelease.parse(sys.stdin.read())
    else:
        path = Path(args.os_release)
        if not path.is_file():
            raise UsageError(f"--os-release {args.os_release}: no such file")
        fields = osrelease.parse(path.read_text(encoding="utf-8", errors="replace"))
    chosen = lock.system_packages_for(fields.get("ID"), fields.get("VERSION_ID"))
    if args.json:
        json.dump(chosen.as_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif chosen.entry is None:
        print(f"{chosen.os}: the lock lists no system packages")
    else:
        print(f"{chosen.os} (the lock's {chosen.entry}): {' '.join(chosen.packages) or 'nothing'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("system-packages", help="the OS packages the lock says this host (or an os-release) needs")
    p.add_argument(
        "--os-release",
        default=str(osrelease.PATH),
        metavar="FILE",
        help="the os-release to choose by ('-': read it from stdin; default %(default)s)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_system_packages)
