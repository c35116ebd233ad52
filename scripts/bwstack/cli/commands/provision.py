"""`bwstack provision`: run the provision playbook (preflight, CUDA, env, verify) on local://, ssh:// or
ansible:// targets. The fleet layer runs it from typed settings built here."""

from __future__ import annotations

import argparse

from bwstack.cli import options

NAME = "provision"
HELP = "run the provision playbook (preflight, CUDA, env, verify) on local://, ssh:// or ansible:// targets"

UNREAD = (options.Unread("offline", ignores=("index",)),)  # the nodes' offline builds reach no mirror

TARGET_HELP = "local:// (default), ssh://[user@]host[:port][,ssh://...], or ansible://INVENTORY[?limit=...&group=...]"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_target(p, default="local://", help=TARGET_HELP)
    options.add_profile(p)
    p.add_argument("--check", action="store_true", help="report what would change; change nothing")
    p.add_argument("--diff", action="store_true", help="show the planned changes as diffs")
    p.add_argument(
        "--cuda-method",
        choices=["pip", "apt", "none"],
        help="how the profile's CUDA toolkit is installed (default pip; none: managed elsewhere)",
    )
    p.add_argument(
        "--allow-no-gpu",
        action="store_true",
        help="accept CPU-only targets (containers, CI); said loudly in the output",
    )
    options.add_min_free_gb(
        p, default=None, help="free disk the preflight requires at the store for a build (default 25)"
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="run every role even on a node that is as the last run from the same inputs left it (which only verifies)",
    )
    options.add_store(p, on_targets=True)
    p.add_argument(
        "--take-over-links",
        action="store_true",
        help="let the targets' store re-point an ml-env or CUDA link that another store or somebody else made",
    )
    options.add_sources(p, on_targets=True)
    options.add_waivers(p)
    options.add_extra_vars(p)
    options.add_ssh(p)


def run(args: argparse.Namespace) -> int:
    from bwstack.fleet import playbooks

    return playbooks.run_provision(
        options.playbook_settings(args),
        profile=args.profile,
        cuda_method=args.cuda_method,
        allow_no_gpu=args.allow_no_gpu,
        min_free_gb=args.min_free_gb,
        full=args.full,
    )
