"""`bwstack accept`: node acceptance against the lock's hardware target (the work: bwstack.accept)."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "accept"
HELP = (
    "node acceptance: driver, PCIe fabric and the first all-reduce against the lock's target "
    "(exit 0 accepted, 1 not, 2 bad input)"
)
UNREAD = (
    options.Unread("machine", ignores=("env", "timeout")),  # a recording runs nothing on the GPUs
    options.Unread("no_runtime", ignores=("env", "timeout")),  # nor does a static-only run
)


def add_options(p: argparse.ArgumentParser) -> None:
    from bwstack.accept.command import TIMEOUT_DEFAULT_S

    options.add_profile(p, help="the lock's profile (default: its default_profile); its target is the hardware")
    p.add_argument(
        "--hardware", metavar="TARGET", help="judge against this target of the lock instead of the profile's"
    )
    p.add_argument(
        "--env", help="the env (directory or its python) whose torch measures the GPUs (default: the ml-env)"
    )
    p.add_argument("--no-runtime", action="store_true", help="static facts only: run nothing on the GPUs")
    p.add_argument(
        "--timeout",
        default=str(TIMEOUT_DEFAULT_S),
        help=f"hard limit in seconds for each runtime stage, all-reduce included (default {TIMEOUT_DEFAULT_S:g})",
    )
    p.add_argument(
        "--machine",
        metavar="DIR",
        help="read the static facts from a recorded machine description instead of this machine (no runtime)",
    )
    p.add_argument(
        "--record",
        metavar="DIR",
        type=options.plain_path,
        help="also write this machine's facts as a recorded description into DIR",
    )
    options.add_json(p, help="the report as JSON on stdout (the verdict line on stderr)")


def run(args: argparse.Namespace) -> int:
    from bwstack.accept.command import accept
    from bwstack.accept.report import NodeVerdict

    console = Console.of(args)
    report = accept(args, log=console.note)
    console.result(report.as_json(), report.render)
    if console.json_mode:
        console.note(report.verdict_line())
    return 0 if report.verdict is NodeVerdict.ACCEPTED else 1
