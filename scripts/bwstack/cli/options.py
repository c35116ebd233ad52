"""Argument types and checks shared by every command: one rule for each kind of value.

Every bad value is one line and exit 2 (argparse's own errors included, see `Parser`), and an empty value is
an error wherever it is given, never a silent default.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from bwstack.errors import UsageError

CAPABILITY_RE = re.compile(r"^\d{1,2}\.\d$")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `bwstack build: error: argument --verify: invalid choice ...`."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {' '.join(message.split())}\n")
        raise SystemExit(2)


def capability(value: str) -> str:
    """A compute capability as the driver reports it: "12.0", "9.0"."""
    if not CAPABILITY_RE.match(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a compute capability like 12.0 or 9.0")
    return value


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be at least 1")
    return number


def non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number >= 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} must be a finite number, 0 or more")
    return number


def existing_file(value: str) -> str:
    if value.strip() and not Path(value).is_file():
        raise argparse.ArgumentTypeError(f"{value!r}: no such file")
    return value


def existing_dir(value: str) -> str:
    if value.strip() and not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"{value!r}: no such directory")
    return value


def reject_empty(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every string value given on the command line must say something."""
    names = _option_names(parser, args)
    for dest, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        for item in values:
            if isinstance(item, str) and not item.strip():
                raise UsageError(f"{names.get(dest, dest)} is empty: give a value or leave the option out")
            if isinstance(item, str) and "\0" in item:
                raise UsageError(f"{names.get(dest, dest)} contains a NUL byte")


def _option_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    names: dict[str, str] = {}
    stack = [parser]
    while stack:
        current = stack.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            elif action.dest not in names:
                names[action.dest] = action.option_strings[-1] if action.option_strings else action.dest
    return names
