"""bwstack: one pinned LLM-serving stack for Blackwell (SM120) nodes, provisioned, snapshotted and verified."""

import contextlib as _contextlib
import os as _os
import signal as _signal
import sys as _sys

__version__ = "0.1.0"

# Ctrl-C while the CLI is still importing would otherwise end in a KeyboardInterrupt traceback from inside an
# import, before bwstack.cli.main's handlers exist. This is the first code the `bwstack` script and `python -m
# bwstack` run, so the guard goes here; bwstack.cli.main hands SIGINT back (end_start_up) before a command runs.
_START_UP_MESSAGE = b"bwstack: interrupted while starting; nothing was done\n"


def _interrupted_at_start_up(signum: int, frame: object) -> None:
    # os.write, not print: the handler may run in the middle of another write to stderr.
    _os.write(2, _START_UP_MESSAGE)
    raise SystemExit(130)


def _run_as_the_cli() -> bool:
    """The `bwstack` script or `python -m bwstack...` (argv[0] is "-m" while runpy imports the package); a
    program that imports bwstack as a library (pytest, Ansible) keeps its own Ctrl-C."""
    argv = getattr(_sys, "argv", None) or [""]
    return argv[0] == "-m" or _os.path.basename(argv[0]) == "bwstack"


def end_start_up() -> None:
    """From here an interrupt is a KeyboardInterrupt again: a command's cleanup runs, then main's one line."""
    if _signal.getsignal(_signal.SIGINT) is _interrupted_at_start_up:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)


if _run_as_the_cli() and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    with _contextlib.suppress(ValueError):  # imported outside the main thread: not a start-up to guard
        _signal.signal(_signal.SIGINT, _interrupted_at_start_up)
