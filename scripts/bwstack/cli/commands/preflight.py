"""`bwstack preflight`: is this node fit for the profile? (GPU, driver, disk, glibc, Python; changes nothing)"""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "preflight"
HELP = "is this node fit for the profile? (changes nothing)"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_node(p, take_over_links=False, verify=False)
    options.add_profile(p, help=None)
    options.add_min_free_gb(p, default=25.0, help="free disk required at the store (default %(default)s)")
    p.add_argument("--allow-no-gpu", action="store_true", help="accept a CPU-only target (containers, CI), loudly")
    p.add_argument("--allow-other-gpu", action="store_true", help="accept GPUs of another capability, loudly")


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock
    from bwstack.probe import preflight

    console = Console.of(args)
    profile = load_lock(args.lock).profile(args.profile)
    report = preflight.check(
        preflight.requirements_of(profile),
        root=str(options.layout(args).root),
        min_free_gb=args.min_free_gb,
        allow_no_gpu=args.allow_no_gpu,
        allow_other_gpu=args.allow_other_gpu,
    )
    console.result(report.as_dict(), report.render)
    if not report.ok:
        console.note(f"bwstack: error: preflight refused: {report.refusal()}")
        return 4
    return 0
