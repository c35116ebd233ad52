"""`bwstack adopt`: turn a hand-made env at --ml-env into a generation, in place."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "adopt"
HELP = "turn a hand-made env at --ml-env into a generation"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_node(p, take_over_links=True, verify=False)


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock
    from bwstack.provision import backup
    from bwstack.store.session import open_store

    console = Console.of(args)
    lock = load_lock(args.lock)
    with open_store(options.layout(args), console.log) as store:
        gen = backup.adopt(store, lock, console.log)
    console.result({"generation": gen.name}, f"adopted as {gen.name}")
    return 0
