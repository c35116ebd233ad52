"""`bwstack system-packages`: the OS packages the lock says a host needs, by the one rule
(`Lock.system_packages_for`: the exact ID-VERSION_ID entry, else ID-MAJOR).

    bwstack system-packages                             this machine's /etc/os-release
    bwstack system-packages --os-release FILE --json    another host's (e.g. fetched from a node)
    bwstack system-packages --os-release - --json       read from stdin: the mlenv role passes the node's file,
                                                        so the role asks this rule instead of deciding itself

`bwstack image build` applies the same rule to its base image's /etc/os-release. Exit status 0 with the
packages, 1 when the lock has no entry for that OS, 2 for an os-release that names no ID and VERSION_ID.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.errors import UsageError
from bwstack.probe import osrelease

NAME = "system-packages"
HELP = "the OS packages the lock says this host (or an os-release) needs"
LIMIT = 64 * 1024  # an os-release is a few hundred bytes: anything larger is not one


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--os-release",
        default=str(osrelease.PATH),
        metavar="FILE",
        help="the os-release to choose by ('-': read it from stdin; default %(default)s)",
    )
    options.add_json(p)


def read_os_release(path: str) -> dict[str, str]:
    """An os-release file, or stdin for "-" (a FIFO, a directory or an oversized file is refused, never read)."""
    if path == "-":
        text = sys.stdin.read(LIMIT + 1)
        if len(text) > LIMIT:
            raise UsageError("--os-release -: more than 64 KiB on stdin: not an os-release file")
        return osrelease.parse(text)
    file = Path(path)
    try:
        if not file.is_file() or file.stat().st_size > LIMIT:
            raise UsageError(f"--os-release {path}: not a regular os-release file")
        return osrelease.parse(file.read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        raise UsageError(f"--os-release {path}: {exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock

    fields = read_os_release(args.os_release)
    chosen = load_lock(args.lock).system_packages_for(fields.get("ID"), fields.get("VERSION_ID"))
    if chosen.entry is None:
        text = f"{chosen.os}: the lock lists no system packages"
    else:
        text = f"{chosen.os} (the lock's {chosen.entry}): {' '.join(chosen.packages) or 'nothing'}"
    Console.of(args).result(chosen.as_dict(), text)
    return 0
