"""`bwstack system-packages`: the lock's OS packages for a host, by the one rule (bwstack.lock.system.pick).

    bwstack system-packages                             this machine's /etc/os-release
    bwstack system-packages --os-release FILE --json    another host's (e.g. fetched from a node)
    bwstack system-packages --os-release - --json       read from stdin (an Ansible task can pass a node's file
                                                        slurped, so the role asks this rule instead of its own)

`bwstack image build` applies the same function to its base image's /etc/os-release. Exit status 0 with the
packages (one a line, or JSON), 1 when the lock lists none for that OS, 2 for an unreadable os-release.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bwstack.cli import options
from bwstack.errors import UsageError
from bwstack.lock import system

DEFAULT_OS_RELEASE = "/etc/os-release"
NAME = "system-packages"
HELP = "the lock's OS packages for this host's (or a given) os-release"


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--os-release",
        default=DEFAULT_OS_RELEASE,
        help="the host's os-release file, - for stdin (default: %(default)s)",
    )
    options.add_json(p)


def read_os_release(path: str) -> dict[str, str]:
    """An os-release file, or stdin for "-" (a FIFO, a directory or an oversized file is refused, never read)."""
    limit = 64 * 1024
    if path == "-":
        text = sys.stdin.read(limit + 1)
        if len(text) > limit:
            raise UsageError("--os-release -: more than 64 KiB on stdin: not an os-release file")
        return system.parse_os_release(text, "stdin")
    file = Path(path)
    try:
        if not file.is_file() or file.stat().st_size > limit:
            raise UsageError(f"--os-release {path}: not a regular os-release file")
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"--os-release {path}: {exc.strerror or exc}") from None
    return system.parse_os_release(text, path)


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock

    lock = load_lock(args.lock)
    picked = system.pick(lock.system_packages, read_os_release(args.os_release))
    if args.json:
        json.dump(picked.as_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif picked.os_id is not None:
        print("\n".join(picked.packages))
    if picked.os_id is None:
        tried = " or ".join(picked.os_ids) or "an OS without VERSION_ID"
        print(
            f"bwstack: the lock's system_packages has no entry for {tried} (it has "
            f"{', '.join(sorted(lock.system_packages)) or 'none'}): install the equivalents yourself",
            file=sys.stderr,
        )
        return 1
    return 0
