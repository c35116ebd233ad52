"""`bwstack controller-facts`: what the Ansible roles need from the lock, as JSON (run on the controller)."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "controller-facts"
HELP = "(for the Ansible roles) what the lock says, as JSON"
UNREAD = (options.Unread("wheel", ignores=("wheel_dir",)),)  # a given wheel is used, none is built


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probe-dir", help="also write the probe zipapp into this directory")
    p.add_argument("--wheel-dir", help="also build bwstack's wheel (pip wheel --no-deps) into this directory")
    p.add_argument("--wheel", help="use this bwstack wheel instead of building one")
    p.add_argument(
        "--profile",
        help="also resolve this profile name as every command does ('profile': the name, else the lock's "
        "default_profile; an unknown one is refused)",
    )


def run(args: argparse.Namespace) -> int:
    from bwstack.fleet import playbooks
    from bwstack.lock.model import load_lock

    facts = playbooks.controller_facts(
        load_lock(args.lock), args.probe_dir, args.wheel_dir, args.wheel, profile=args.profile
    )
    Console(json_mode=True).json(facts)
    return 0
