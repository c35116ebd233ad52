"""`bwstack bench`: the performance figures (P1-P7) against their anchors, in one run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bwstack.bench import BENCHES
from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.errors import UsageError

NAME = "bench"
HELP = "the performance figures (P1-P7) against their anchors, in one run"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_profile(p, help="profile to benchmark (default cu128: the one PyPI serves)")
    p.set_defaults(profile="cu128")
    p.add_argument("--work", default="/var/tmp/bwstack-bench", help="scratch directory (tens of GB for cu128)")
    p.add_argument("--runs", type=options.positive_int, default=3)
    p.add_argument("--quick", action="store_true", help="a small real closure: checks the harness, not speed")
    p.add_argument("--only", type=_benches, help=f"comma list of {', '.join(BENCHES)}, e.g. P1,P3")
    options.add_json(p)


def _benches(value: str) -> list[str]:
    names = [x.strip() for x in value.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{value!r} names no bench ({', '.join(BENCHES)})")
    unknown = [x for x in names if x.upper() not in BENCHES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, unknown))}: not a bench ({', '.join(BENCHES)})")
    return [x.upper() for x in names]


def _scratch(work: str) -> None:
    """The scratch directory can be made and written, before any bench spends minutes."""
    try:
        Path(work).mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"--work {work}: not a directory") from None
    except OSError as exc:
        raise UsageError(f"--work {work}: cannot be created ({exc.strerror or exc})") from None
    if not os.access(work, os.W_OK | os.X_OK):
        raise UsageError(f"--work {work}: not writable")


def run(args: argparse.Namespace) -> int:
    import time

    from bwstack.bench import run as bench

    console = Console.of(args)
    _scratch(args.work)
    figures = bench.run(args.lock, args.profile, args.work, args.runs, args.quick, args.only, log=console.note)

    def text() -> str:
        header = (
            f"bwstack bench{' --quick' if args.quick else ''} --profile {args.profile} --runs {args.runs}: "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {bench.machine()}"
        )
        return header + "\n\n" + bench.render(figures)

    console.result([f.as_dict() for f in figures], text)
    return 0
