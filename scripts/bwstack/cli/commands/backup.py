"""`bwstack backup`: capture the active env as a verified generation (and, with --archive, an off-node copy)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.errors import UsageError

NAME = "backup"
HELP = "capture the active env as a verified generation"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_node(p, take_over_links=True, verify=True)
    p.add_argument(
        "--archive", type=options.plain_path, help="also write an off-node archive (tar + zstd, with .sha256)"
    )


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock
    from bwstack.provision import backup
    from bwstack.store import archive
    from bwstack.store.session import open_store

    console = Console.of(args)
    lock = load_lock(args.lock)
    with open_store(options.layout(args), console.log) as store:
        result = backup.backup(store, lock, depth=args.verify, log=console.log)
        if args.archive:
            gen = store.active()
            if gen is None:
                raise UsageError("nothing to archive: no active generation")
            result["archive"] = archive.write_archive(store, gen, Path(args.archive))
    text = f"{result['action']}: {result.get('generation') or result.get('note')}"
    if args.archive:
        written = result["archive"]
        # Whole: a restore on another node needs it (--sha256) to know the archive is the one written here.
        text += f"; archive {written['archive']} ({written['bytes'] >> 20} MiB, sha256 {written['sha256']})"
    console.result(result, text)
    return 0
