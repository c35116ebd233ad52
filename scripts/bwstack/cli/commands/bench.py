"""`bwstack bench`: the performance figures (P1-P7) against their anchors, in one run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bwstack.bench import BENCHES
from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.errors import UsageError
from bwstack.store.layout import check_private_folder

NAME = "bench"
HELP = "the performance figures (P1-P7) against their anchors, in one run"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_profile(p, help="profile to benchmark (default cu128: the one PyPI serves)")
    p.set_defaults(profile="cu128")
    p.add_argument(
        "--work",
        type=options.plain_path,
        default="/var/tmp/bwstack-bench",
        help="scratch directory (tens of GB for cu128)",
    )
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
    """The scratch directory can be made and written, and is this user's alone, before any bench spends minutes.
    The benches write a lock, requirement files and stores there, and run what they put there as this user
    (root): a folder others can write (one they made first in /var/tmp, the default's parent) could swap any of
    it. Checked before it is made (nothing is made under a folder others can write) and again after (a folder of
    that name someone else made in the meantime is theirs)."""
    folder = Path(work)
    if not os.path.lexists(folder):
        check_private_folder(folder, "--work", "--work")
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:
        raise UsageError(f"--work {work}: not a directory") from None
    except OSError as exc:
        raise UsageError(f"--work {work}: cannot be created ({exc.strerror or exc})") from None
    if not folder.is_dir():
        raise UsageError(f"--work {work}: not a directory")
    check_private_folder(folder, "--work", "--work")
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
    missing = bench.unmeasured(figures)
    if missing:
        names = "; ".join(f"{f.bench} {f.what} ({f.outcome.value})" for f in missing)
        console.note(f"bwstack bench: not measured: {names} (the notes below the table say why)")
        return 1
    return 0
