"""`bwstack restore`: bring an archived generation back and switch to it."""

from __future__ import annotations

import argparse
from pathlib import Path

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "restore"
HELP = "bring an archived generation back and switch to it"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_node(p, take_over_links=True, verify=False)
    p.add_argument("archive")
    p.add_argument(
        "--sha256",
        type=options.sha256_digest,
        help="the archive's sha256 as `bwstack backup --archive` printed it where it was written (needed unless "
        "this store wrote the archive: restoring runs its code as root)",
    )
    p.add_argument("--no-switch", action="store_true")


def run(args: argparse.Namespace) -> int:
    from bwstack.store import archive
    from bwstack.store.session import open_store

    console = Console.of(args)
    with open_store(options.layout(args), console.log) as store:
        result = archive.restore(
            store, Path(args.archive), sha256=args.sha256, switch=not args.no_switch, log=console.log
        )
    console.result(result, f"restored {result['generation']}" if result.get("changed", True) else result["note"])
    return 0
