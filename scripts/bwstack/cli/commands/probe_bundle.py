"""`bwstack probe-bundle`: write the probe zipapp (what the playbooks ship to nodes)."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.errors import UsageError

NAME = "probe-bundle"
HELP = "write the probe zipapp (what the playbooks ship to nodes)"


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=options.plain_path)


def run(args: argparse.Namespace) -> int:
    from bwstack.fleet import probe_bundle

    try:
        written = probe_bundle.write(args.out)
    except OSError as exc:
        raise UsageError(f"--out {args.out}: cannot be written there ({exc.strerror})") from None
    Console().text(str(written))
    return 0
