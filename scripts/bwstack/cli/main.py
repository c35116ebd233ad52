"""The `bwstack` command line: the parser, assembled from the command registry (bwstack.cli.commands, one
module per command), and the error handlers that turn every failure into one line and an exit status."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence

import bwstack
from bwstack.errors import BwstackError, UsageError

# The commands, their options and the lock model are imported by build_parser, inside main's `try`: a Ctrl-C
# during those imports (the slow part of start-up) is then one line, never a traceback.


def build_parser() -> argparse.ArgumentParser:
    from bwstack.cli import options
    from bwstack.cli.commands import modules
    from bwstack.lock.model import default_lock_path

    parser = options.Parser(
        prog="bwstack",
        description="Provision, snapshot, roll back and verify the pinned SM120 LLM-serving stack.",
    )
    parser.add_argument("--version", action="version", version=f"bwstack {bwstack.__version__}")
    # No type check here: argparse would apply it to the default too, and commands that never read the lock
    # (generations, prune) must work where no lock file is beside them. load_lock says what is wrong.
    parser.add_argument(
        "--lock",
        default=os.environ.get("BWSTACK_LOCK", str(default_lock_path())),
        help="the stack lock (default: $BWSTACK_LOCK, else %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in modules():
        extra = {"description": command.DESCRIPTION} if hasattr(command, "DESCRIPTION") else {}
        p = sub.add_parser(command.NAME, help=command.HELP, **extra)
        command.add_options(p)
        p.set_defaults(
            func=command.run,
            own_empty_checks=getattr(command, "OWN_EMPTY_CHECKS", ()),
            unread=getattr(command, "UNREAD", ()),
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from bwstack.cli import options

        parser = build_parser()
        args = parser.parse_args(argv)
        if not args.lock.strip():
            raise UsageError("--lock (or BWSTACK_LOCK) is empty: give a lock file")
        options.reject_empty(parser, args)
        options.refuse_unread(parser, args)
        bwstack.end_start_up()
        return int(args.func(args))
    except BwstackError as exc:
        _error(str(exc))
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("bwstack: interrupted (a switch is whole or not made; re-run to converge)", file=sys.stderr)
        return 130
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        _error(f"{where}{exc.strerror or exc}")
        return 2 if exc.errno in _FIX_WHERE_IT_POINTS else 1
    except Exception as exc:  # the last line of defence: a person gets one line, not a traceback
        if os.environ.get("BWSTACK_DEBUG"):
            raise
        _error(f"internal error ({type(exc).__name__}: {exc}); BWSTACK_DEBUG=1 shows where")
        return 70


# A path that does not exist, is not a folder, cannot be written, or a disk that is full: the command was pointed
# at something the user or the host must fix (exit 2, like any bad input); anything else is bwstack's failure.
_FIX_WHERE_IT_POINTS = frozenset({
    errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC,
    errno.EDQUOT, errno.ELOOP, errno.ENAMETOOLONG, errno.EXDEV,
})  # fmt: skip


def _error(text: str) -> None:
    from bwstack.terminal import visible

    message = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    print(f"bwstack: error: {visible(message)}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
