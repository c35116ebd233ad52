"""`bwstack lock`: resolve every profile's closure with hashes, or --check the lock."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "lock"
HELP = "resolve every profile's closure with hashes, or --check the lock"


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="verify the lock instead of resolving it")
    p.add_argument("--offline", action="store_true", help="with --check: skip the comparison with PyPI")
    options.add_profile(p, help="resolve only this profile (others keep their closure)")
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    from bwstack.errors import UsageError
    from bwstack.lock import resolve
    from bwstack.lock.model import load_lock

    console = Console.of(args)
    if args.check:
        if args.profile is not None:
            raise UsageError("--profile: only when resolving (--check checks every profile of the lock)")
        from bwstack.lock import check as lockcheck

        report = lockcheck.check_lock(load_lock(args.lock), online=not args.offline)
        console.result(report.as_dict(), report.render)
        return 0 if report.ok else 1
    if args.offline:
        raise UsageError("--offline: only with --check (resolving reads PyPI)")
    with resolve.rewriting(args.lock):
        lock = load_lock(args.lock)
        profiles = [lock.profile_name(args.profile)] if args.profile else None
        text = resolve.lock_profiles(lock, profiles, log=console.note)
        resolve.write_lock(args.lock, text)
    console.result({"wrote": args.lock}, f"wrote {args.lock}")
    return 0
