"""`bwstack waivers`: the verify waivers this node remembers (set at provision time), listed or replaced."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.errors import BwstackError, UsageError

NAME = "waivers"
HELP = "the verify waivers this node remembers (set at provision time)"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_node(p, take_over_links=False, verify=False)
    p.add_argument("--set", action="append", metavar="CHECK=REASON", help="replace the remembered waivers (repeatable)")
    p.add_argument("--clear", action="store_true", help="forget every remembered waiver")
    p.add_argument(
        "--check", action="store_true", help="with --set/--clear: say whether it would change; change nothing"
    )


def run(args: argparse.Namespace) -> int:
    from bwstack.checks.verify import parse_waivers
    from bwstack.probe import waivers
    from bwstack.store.layout import is_store
    from bwstack.store.runlock import RunLock
    from bwstack.store.session import check_store_root

    layout = options.layout(args)
    replace = args.set is not None or args.clear
    changed = False
    if args.set is not None and args.clear:
        raise UsageError("--set and --clear: give one (--set replaces the remembered waivers, --clear drops them)")
    if args.check and not replace:
        raise UsageError("--check: give --set or --clear with it (it says whether they would change anything)")
    # A write goes where a store is: not into any folder --root names, nor through a link at its name.
    if replace and (layout.root.is_symlink() or not is_store(layout.root)):
        raise UsageError(f"no bwstack store at {layout.root}: provision the node first (or name the store, --root)")
    # The same names verify accepts: a waiver that matches no check would waive nothing.
    wanted = [] if args.clear else parse_waivers(args.set, "--set") if args.set else None
    try:
        current = waivers.load(layout.root)
    except ValueError as exc:
        if not replace:
            raise UsageError(str(exc)) from None
        current = None  # a damaged file is replaced
    if wanted is not None:
        changed = current != wanted
        if changed and not args.check:
            # The store's run lock, one change at a time; not the store's repairs (open_store): --root alone may
            # name it, and an interrupted adoption is finished by a command given the env link it was adopting.
            check_store_root(layout)
            with RunLock(layout.root):
                try:
                    waivers.save(layout.root, wanted)
                except OSError as exc:
                    raise BwstackError(f"could not write {waivers.path_of(layout.root)}: {exc.strerror}") from None
        current = wanted
    rows = [{"check": w.check, "reason": w.reason} for w in current or []]
    payload = {"store": str(layout.root), "waivers": rows, "changed": changed}
    text = "\n".join(f"{w['check']}: {w['reason']}" for w in rows) or f"no waivers remembered in {layout.root}"
    Console.of(args).result(payload, text)
    return 0
