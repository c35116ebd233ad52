"""`bwstack probe-bundle`: write the probe zipapp (what the playbooks ship to nodes)."""

from __future__ import annotations

import argparse

from bwstack.cli.console import Console

NAME = "probe-bundle"
HELP = "write the probe zipapp (what the playbooks ship to nodes)"


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)


def run(args: argparse.Namespace) -> int:
    from bwstack.fleet import probe_bundle

    Console().text(str(probe_bundle.write(args.out)))
    return 0
