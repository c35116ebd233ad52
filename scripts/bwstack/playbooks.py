"""`bwstack provision` (and `rollback --target`): drive the Ansible playbooks for users without inventory."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `provision` subcommand (to be implemented)."""


def run_rollback(args: argparse.Namespace) -> int:
    raise NotImplementedError
