"""`bwstack image build|verify`: the serving image from the same lock, through the Docker SDK."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `image` subcommand (to be implemented)."""
