"""`bwstack patch apply|revert|status`: the SGLang SM120 patches of a profile, in an env."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.errors import UsageError

NAME = "patch"
HELP = "SGLang SM120 patches: apply, revert or show their state"
UNREAD = (
    options.Unread("env", ignores=("ml_env",)),  # it only finds the env
    options.Unread("patch", ignores=("profile",)),  # the profile only names the default patches
)


def add_env_selection(p: argparse.ArgumentParser) -> None:
    """--env, else the active ml-env of the store the (hidden) store options name."""
    p.add_argument("--env", type=options.plain_path, help="the env (default: the active ml-env)")
    options.add_ml_env(p, hidden=True)
    options.add_json(p)


def site_packages(args: argparse.Namespace, *, writes: bool = False) -> Path:
    """The env's site-packages. One that bwstack will write (`writes`) must be reached only through folders and
    links of root's or this user's, none writable by others: the env is opened again for every file patched, so
    a user who could re-point a name on the way would choose which env root changes (a sealed generation)."""
    from bwstack.probe import envinspect, pathtrust
    from bwstack.store.layout import open_to_others

    env = Path(args.env) if args.env else options.layout(args).ml_env
    if writes and os.path.lexists(env):
        why = open_to_others(pathtrust.open_to_others, env, "the env")
        if why:
            raise UsageError(
                f"the env {env} is reached through what others can change ({why}): bwstack patches only an env "
                "that only root and this user can re-point"
            )
    try:
        return envinspect.site_packages(env)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None


def add_options(p: argparse.ArgumentParser) -> None:
    add_env_selection(p)
    p.add_argument("action", choices=["apply", "revert", "status"])
    p.add_argument("--patch", action="append", help="patch id (default: the profile's patches)")
    options.add_profile(p, help=None)


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock
    from bwstack.provision import patches

    console = Console.of(args)
    site = site_packages(args, writes=args.action != "status")
    ids = args.patch or list(load_lock(args.lock).profile(args.profile).patches)
    if args.action == "status":
        states = patches.status(site, ids)
        text = "\n".join(
            f"{s.patch_id}: {s.state} ({s.package} {s.version or 'not installed'}) {s.reason}".rstrip() for s in states
        )
        console.result([s.as_dict() for s in states], text)
        return 0
    results = patches.apply(site, ids) if args.action == "apply" else patches.revert(site, ids)
    text = "\n".join(f"{r.patch_id}: {r.action} ({r.package} {r.version})" for r in results)
    console.result([r.as_dict() for r in results], text)
    return 0
