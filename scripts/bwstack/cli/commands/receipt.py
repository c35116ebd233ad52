"""`bwstack receipt`: whether this node is still as the last provision run left it (the provision play's
converged fast path), or record that it is. The rules are bwstack.provision.receipt's."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.errors import UsageError

NAME = "receipt"
HELP = "check (or record) that this node is as the last provision run from the same inputs left it"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_store(p)
    options.add_json(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="say whether the node is converged (exit 0 either way)")
    mode.add_argument("--write", action="store_true", help="record the node as provisioned from these inputs")
    p.add_argument(
        "--inputs", required=True, type=options.sha256_digest, metavar="SHA256",
        help="the digest of the run's inputs (the play's)",
    )  # fmt: skip
    p.add_argument(
        "--watch", action="append", default=[], type=options.absolute_path, metavar="PATH",
        help="a file or directory the run made, fingerprinted with the receipt (repeatable; absolute)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from bwstack.provision import receipt

    console = Console.of(args)
    layout = options.layout(args)
    if not layout.root.is_dir():
        raise UsageError(f"no bwstack store at {layout.root}")
    if args.check:
        verdict = receipt.check(layout, args.inputs, args.watch)
        if console.json_mode:
            console.json(verdict.as_dict())
        else:
            console.text(("converged: " if verdict.converged else "not converged: ") + verdict.why)
        return 0
    changed = receipt.write(layout, args.inputs, args.watch)
    if console.json_mode:
        console.json({"changed": changed, "receipt": str(layout.root / receipt.NAME)})
    else:
        console.text(f"{'recorded' if changed else 'unchanged'}: {layout.root / receipt.NAME}")
    return 0
