"""`bwstack plan`: what provisioning would change in an env (missing, extra, version, hash)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "plan"
HELP = "what provisioning would change in an env (missing, extra, version, hash)"
UNREAD = (options.Unread("env", ignores=("ml_env",)),)  # it only finds the env


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_profile(p, help=None)
    p.add_argument("--env", type=options.plain_path, help="the env to compare (default: the active ml-env)")
    options.add_ml_env(p)
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock
    from bwstack.provision import plan

    profile = load_lock(args.lock).profile(args.profile)
    result = plan.plan_env(profile, Path(args.env) if args.env else None, ml_env=args.ml_env)
    Console.of(args).result(result.as_dict(), result.render)
    return 0
