"""`bwstack fetch`: download a profile's wheels, hash-checked, into a directory (a wheelhouse for
air-gapped nodes and image builds)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "fetch"
HELP = "download a profile's wheels (hash-checked) into a directory"
UNREAD = (options.Unread("offline", ignores=("index",)),)  # an offline run reaches no mirror


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_sources(p)  # no --python: a fetch makes no env
    options.add_profile(p, help=None)
    p.add_argument("--dest", required=True, type=options.plain_path)
    p.add_argument("--part", choices=["env", "cuda-toolkit", "all"], default="env")
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock
    from bwstack.lock.tags import Target, select
    from bwstack.provision.wheelhouse import Fetcher

    console = Console.of(args)
    lock = load_lock(args.lock)
    profile = lock.profile(args.profile)
    closure = profile.require_closure(lock.path)
    options.apply_ca_bundle(args)
    dest = Path(args.dest)
    # DEST is the operator's directory (often shared, handed to other machines): what is already in it, its
    # .store included, is hashed again before it is reused.
    fetcher = Fetcher(
        dest / ".store", options.sources(args), args.allow_unhashed or (), log=console.log, rehash_store=True,
        inside=dest,
    )  # fmt: skip
    parts = {"env": closure.env, "cuda-toolkit": closure.cuda_toolkit}
    chosen = {}
    for part in ["env", "cuda-toolkit"] if args.part == "all" else [args.part]:
        chosen.update(select(parts[part], Target.of(profile)))
    wheels = fetcher.fetch_all(chosen)
    replaced = fetcher.export(wheels, dest, console.log)
    payload = {n: w.as_dict() for n, w in wheels.items()}
    text = f"{len(wheels)} wheels in {dest}" + (f" ({len(replaced)} damaged files replaced)" if replaced else "")
    console.result(payload, text)
    return 0
