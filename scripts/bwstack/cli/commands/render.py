"""`bwstack render`: a profile's hash-pinned requirements (stdout), or one file per image layer."""

from __future__ import annotations

import argparse
from pathlib import Path

from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.fsutil import atomic_write_text, new_file_mode

NAME = "render"
HELP = "hash-pinned requirements of a profile (stdout), or per Docker layer"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_profile(p, help=None)
    p.add_argument("--part", choices=["env", "cuda-toolkit"], default="env")
    p.add_argument("--layers", metavar="DIR", help="write one file per image layer into DIR")


def run(args: argparse.Namespace) -> int:
    from bwstack.lock import requirements
    from bwstack.lock.model import load_lock

    console = Console()
    lock = load_lock(args.lock)
    profile = lock.profile(args.profile)
    closure = profile.require_closure(lock.path)
    packages = closure.cuda_toolkit if args.part == "cuda-toolkit" else closure.env
    if args.layers:
        out = Path(args.layers)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for i, (layer, text) in enumerate(requirements.render_layers(profile, packages, lock.image_layers).items(), 1):
            path = out / f"{i:02d}-{layer}.txt"
            # A new file put in place: a link already at that name (in a folder others can write) is replaced,
            # not written through.
            atomic_write_text(path, text, new_file_mode())
            written.append(str(path))
        console.text("\n".join(written))
        return 0
    console.raw(requirements.render(profile, packages))
    return 0
