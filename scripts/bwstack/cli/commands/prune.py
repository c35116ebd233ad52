"""`bwstack prune`: remove old generations (never the active or the last verified one)."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "prune"
HELP = "remove old generations (never the active or last verified)"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_node(p, take_over_links=False, verify=False)
    p.add_argument("--keep", type=options.positive_int, required=True)


def run(args: argparse.Namespace) -> int:
    from bwstack.store.session import open_store

    console = Console.of(args)
    with open_store(options.layout(args), console.log) as store:
        removed = store.prune(args.keep)
    console.result({"removed": removed}, "removed: " + (", ".join(removed) or "nothing"))
    return 0
