"""`bwstack build`: back up, build the profile's generation from the lock, switch to it."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "build"
HELP = "back up, build the profile's generation, switch"
UNREAD = (options.Unread("offline", ignores=("index",)),)  # an offline build reaches no mirror


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_node(p, take_over_links=True, verify=True)
    options.add_sources(p, python=True)
    options.add_profile(p, help=None)
    p.add_argument("--no-switch", action="store_true", help="build and commit, but leave the active env")
    p.add_argument("--check", action="store_true", help="say what would change; change nothing")


def build_options(args: argparse.Namespace):
    """The source and node options as the provision layer's BuildOptions (build, rollback --rebuild)."""
    from bwstack.provision.build import BuildOptions

    return BuildOptions(
        sources=options.sources(args),
        allow_unhashed=tuple(args.allow_unhashed or ()),
        python=args.python,
        switch=not getattr(args, "no_switch", False),
        verify_depth=args.verify,
        ca_bundle=args.ca_bundle,
    )


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock
    from bwstack.provision import build

    console = Console.of(args)
    lock = load_lock(args.lock)
    profile = lock.profile(args.profile)
    layout = options.layout(args)
    options.apply_ca_bundle(args)
    if args.check:
        plan = build.plan_build(lock, profile, layout, switch=not args.no_switch)
        console.result(plan, "\n".join(plan["actions"]) or "nothing to do")
        return 0
    result = build.build(lock, profile, layout, build_options(args), log=console.log)
    state = "changed" if result["changed"] else "unchanged"
    console.result(result, f"{state}: {layout.ml_env} -> {result['active']}")
    return 0
