"""`bwstack rollback`: switch back to a verified generation, here or (--target) on hosts through the
rollback playbook."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.commands.build import build_options
from bwstack.cli.console import Console
from bwstack.errors import UsageError

NAME = "rollback"
HELP = "switch back to a verified generation"
# The rollback playbook gets the store, source and waiver options (options.playbook_settings); the role decides
# the rest on the node.
UNREAD = (
    options.Unread("target", ignores=("verify", "python", "json")),
    options.Unread("offline", ignores=("index",)),  # an offline rebuild reaches no mirror
)
# Wheels are fetched only to rebuild. A rollback here given source options without --rebuild says it reads none,
# and goes on: it is the emergency path, and a controller's older module passes them to every rollback.
SOURCE_OPTIONS = ("wheelhouse", "index", "offline", "ca_bundle", "allow_unhashed", "python")

TARGET_HELP = (
    "roll back these hosts through the rollback playbook, then verify them: local://, "
    "ssh://[user@]host[:port][,...] or ansible://INVENTORY[?limit=...&group=...]"
)


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_node(p, take_over_links=True, verify=True)
    # Unchecked while parsing: with --target they are paths on the hosts (run() checks them here otherwise).
    options.add_sources(p, python=True, checked=False)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--to", help="generation id or name")
    options.add_profile(group, help="the newest generation of this profile")
    p.add_argument(
        "--rebuild",
        action="store_true",
        help="with nothing to go back to, build the profile (default: the lock's rollback profile) from the lock",
    )
    p.add_argument("--check", action="store_true", help="say what the rollback would do; change nothing")
    options.add_target(p, default=None, help=TARGET_HELP)
    options.add_waivers(p)
    options.add_extra_vars(p)
    options.add_ssh(p)


def run(args: argparse.Namespace) -> int:
    if args.target:
        from bwstack.fleet import playbooks

        settings = options.playbook_settings(args)
        return playbooks.run_rollback(settings, to=args.to, profile=args.profile, rebuild=args.rebuild)
    for option in ("skip", "ssh_key", "known_hosts", "extra_vars"):
        if getattr(args, option, None):
            flag = "-e" if option == "extra_vars" else "--" + option.replace("_", "-")
            raise UsageError(f"{flag} is for `rollback --target` (the rollback playbook); a rollback here runs no play")
    from bwstack.lock.model import load_lock
    from bwstack.provision import build

    console = Console.of(args)
    unread = [f"--{o.replace('_', '-')}" for o in SOURCE_OPTIONS if getattr(args, o, None) and not args.rebuild]
    if unread:
        console.note(f"note: {', '.join(unread)} not read: without --rebuild a rollback fetches no wheel")
    if args.rebuild:
        options.check_sources_here(args)
    else:  # as the note says: nothing below reads them (a wheelhouse this node lacks fails nothing)
        args = argparse.Namespace(**{**vars(args), **dict.fromkeys(SOURCE_OPTIONS)})
    lock = load_lock(args.lock)
    layout = options.layout(args)
    options.apply_ca_bundle(args)
    if args.check:
        plan = build.plan_rollback(layout, to=args.to, profile_name=args.profile, rebuild=args.rebuild, lock=lock)
        console.result(plan, plan["action"])
        return 0
    result = build.rollback(
        lock, layout, to=args.to, profile_name=args.profile, rebuild=args.rebuild, opts=build_options(args),
        log=console.log,
    )  # fmt: skip
    note = f" ({result['note']})" if result.get("note") else ""
    console.result(result, f"{layout.ml_env} -> {result['generation']}{note}")
    return 0
