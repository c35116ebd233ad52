"""The options shared by commands, declared once (like pip's cmdoptions), and the argument types behind them.

Option groups: the source options (--wheelhouse, --index, --offline, --ca-bundle, --allow-unhashed), the
target and SSH options (--target, --ssh-key, --known-hosts), the --skip waivers, the store location (--root,
--ml-env, --cuda-link), --profile and --json. A command adds the groups it takes; the typed values the
layers below want (Sources, SshOptions, the fleet's PlaybookSettings) are built here from them, so no layer
below the CLI reads an argparse namespace for these.

Every bad value is one line and exit 2 (argparse's own errors included, see `Parser`), and an empty value is
an error wherever it is given, never a silent default.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from bwstack import paths
from bwstack.errors import UsageError

CAPABILITY_RE = re.compile(r"^\d{1,2}\.\d$")
PYTHON_VERSION_RE = re.compile(r"^3\.\d+\Z")  # the rule of the lock's profiles.<name>.python


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


def python_version(value: str) -> str:
    """A CPython minor version as the lock's profiles give it: "3.12"."""
    if not PYTHON_VERSION_RE.match(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a Python version like 3.12")
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


def plain_path(value: str) -> str:
    """A path without control characters: it is written into scripts, unit files and Ansible variables, where a
    newline would start a line of its own."""
    why = paths.path_problem(value)
    if why:
        raise argparse.ArgumentTypeError(f"{value!r} {why}")
    return value


def existing_file(value: str) -> str:
    if value.strip() and not Path(value).is_file():
        raise argparse.ArgumentTypeError(f"{value!r}: no such file")
    return value


def existing_dir(value: str) -> str:
    if value.strip() and not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"{value!r}: no such directory")
    return value


def sha256_digest(value: str) -> str:
    if value.strip() and not re.fullmatch(r"[0-9a-f]{64}", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a sha256 digest (64 lowercase hex characters)")
    return value


def absolute_path(value: str) -> str:
    if value.strip() and not value.startswith("/"):
        raise argparse.ArgumentTypeError(f"{value!r}: give an absolute path")
    return value


def port(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535; 0: any free port)")
    return number


def reject_empty(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every string value given on the command line must say something. A command that refuses an empty
    value itself, with a message that says what the value should be, names those options in
    `own_empty_checks` (a command module's OWN_EMPTY_CHECKS)."""
    names = _option_names(parser, args)
    own = set(getattr(args, "own_empty_checks", ()))
    for dest, value in vars(args).items():
        if dest in own:
            continue
        values = value if isinstance(value, list) else [value]
        for item in values:
            if isinstance(item, str) and not item.strip():
                raise UsageError(f"{names.get(dest, dest)} is empty: give a value or leave the option out")
            if isinstance(item, str) and "\0" in item:
                raise UsageError(f"{names.get(dest, dest)} contains a NUL byte")


def _option_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """How the user wrote each option of this command line: its long name (the command's own options, then the
    top-level ones). Another command's option of the same dest (restore's positional `archive`, backup's
    `--archive`) never lends its name."""
    names: dict[str, str] = {}
    command = getattr(args, "command", None)
    for current in ([_command_parser(parser, args)] if command else []) + [parser]:
        for action in current._actions:
            if action.dest not in names and not isinstance(action, argparse._SubParsersAction):
                names[action.dest] = max(action.option_strings, key=len) if action.option_strings else action.dest
    return names


@dataclass(frozen=True)
class Unread:
    """Options a command does not read in one of its modes (a command module's UNREAD). Given there, they are
    refused rather than ignored: whoever gives one expects it to act.

    `mode` is the option (its dest) whose being given selects the mode, or DEST=VALUE for a positional's value.
    In the mode, the command reads only `reads` of its own options when that is given, else all but `ignores`.
    `absent`: the mode is the option's absence instead (`--verify full` acts only with `--check`)."""

    mode: str
    reads: tuple[str, ...] | None = None
    ignores: tuple[str, ...] = ()
    absent: bool = False


def refuse_unread(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An option given in a mode of its command that does not read it is one line and exit 2. "Given" is a
    value other than the option's default: argparse keeps no other record of it."""
    rules: tuple[Unread, ...] = getattr(args, "unread", ())
    if not rules:
        return
    actions = [a for a in _command_parser(parser, args)._actions if a.dest != "help"]
    shown = _option_names(parser, args)
    given = [a.dest for a in actions if getattr(args, a.dest, a.default) != a.default]
    for rule in rules:
        dest, _, value = rule.mode.partition("=")
        selected = getattr(args, dest, None) == value if value else dest in given
        if selected == rule.absent:
            continue
        mode = value or shown.get(dest, dest)
        for other in given:
            if other == dest or (other in rule.reads if rule.reads is not None else other not in rule.ignores):
                continue
            name = shown.get(other, other)
            if rule.absent:
                raise UsageError(f"{name} is read only with {mode}: add {mode} or leave {name} out")
            raise UsageError(f"{name} is not read with {mode}: leave it out")


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command this line runs: `env install`'s, not `env`'s, whose only option is the choice."""
    current = _subparser(parser, args.command)
    while True:
        nested = next((a for a in current._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, nested.dest, None) if nested is not None else None
        if nested is None or chosen not in nested.choices:
            return current
        current = nested.choices[chosen]


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise LookupError(name)


# ------------------------------------------------------------------------------------------------ option groups

Container = argparse.ArgumentParser | argparse._ActionsContainer

STORE_ROOT_HELP = f"bwstack's store (default: {paths.DEFAULT_ROOT} as root, else ~/{paths.USER_ROOT})"
CUDA_LINK_HELP = "the /usr/local/cuda-style link to keep on the active toolkit ('none' to leave it)"


def _group(p: Container, title: str) -> Container:
    """The shared groups get their own heading in --help (a group inside a group stays where it is)."""
    return p.add_argument_group(title) if isinstance(p, argparse.ArgumentParser) else p


def add_json(p: Container, help: str | None = None) -> None:
    p.add_argument("--json", action="store_true", help=help)


def add_profile(p: Container, help: str | None = "the lock's profile (default: its default_profile)") -> None:
    """--profile: a name of the lock's profiles; none given means the lock's default (Lock.profile_name)."""
    p.add_argument("--profile", help=help)


def add_store(p: Container, *, cuda_link: bool = True, hidden: bool = False, on_targets: bool = False) -> None:
    """--root and --ml-env (and --cuda-link): where the store and the env users run are. `hidden` for
    commands that accept them only to find the active env; `on_targets` for playbook runs."""
    if not hidden:
        p = _group(p, "store location")
    if on_targets:
        p.add_argument("--root", type=plain_path, help=f"bwstack's store on the targets (default {paths.DEFAULT_ROOT})")
        p.add_argument("--ml-env", type=plain_path, help="the env path users run on the targets (default /opt/ml-env)")
        if cuda_link:
            link_help = "the /usr/local/cuda-style link on the targets ('none' to leave it)"
            p.add_argument("--cuda-link", type=plain_path, help=link_help)
        return
    p.add_argument("--root", type=plain_path, help=argparse.SUPPRESS if hidden else STORE_ROOT_HELP)
    add_ml_env(p, hidden=hidden)
    if cuda_link:
        p.add_argument("--cuda-link", type=plain_path, help=argparse.SUPPRESS if hidden else CUDA_LINK_HELP)


def add_ml_env(p: Container, *, hidden: bool = False) -> None:
    """--ml-env alone, for commands that read an env and no store: the env users run is the ml-env link, which
    --root does not move (a --root here was read by nothing, so `patch apply --root X` patched the default env)."""
    p.add_argument(
        "--ml-env",
        type=plain_path,
        help=argparse.SUPPRESS if hidden else "the env path users run (default: /opt/ml-env as root, else ~/ml-env)",
    )


def add_node(p: Container, *, take_over_links: bool, verify: bool) -> None:
    """The options of commands that work on this node's store: its location (the store's and its links', which
    must not overlap) and --json; --take-over-links for those that point links, --verify for those that check a
    generation against its manifest (a command never takes an option it does not read)."""
    add_store(p)
    add_json(p)
    if take_over_links:
        p.add_argument(
            "--take-over-links",
            action="store_true",
            help="let this store re-point an ml-env or CUDA link that another store or somebody else made",
        )
    if verify:
        p.add_argument(
            "--verify", choices=["quick", "full"], default="quick",
            help="manifest check: quick (inode/size/mtime, re-hash what moved) or full (every byte)",
        )  # fmt: skip


def add_sources(
    p: Container,
    *,
    on_targets: bool = False,
    index: bool = True,
    python: bool = False,
    checked: bool = True,
    ca_help: str | None = None,
) -> None:
    """Where wheels come from. Here: directories and files that must exist on this machine (`checked`).
    `on_targets`: paths on the hosts a playbook provisions (not checked here). `index=False` for commands
    that reach no index mirror (the image build: its steps get wheels from the build's own server)."""
    p = _group(p, "wheel sources")
    if on_targets:
        p.add_argument(
            "--wheelhouse",
            action="append",
            type=plain_path,
            help="directory of wheels on the targets, used first (repeatable)",
        )
        p.add_argument(
            "--index",
            action="append",
            metavar="NAME=URL",
            help="a mirror for one of the lock's indexes (or BWSTACK_INDEX, one a line: kept out of `ps`)",
        )
        p.add_argument("--offline", action="store_true", help="use only --wheelhouse (and the node's wheel store)")
        p.add_argument(
            "--ca-bundle", type=plain_path, help=ca_help or "CA bundle on the targets for TLS (always verified)"
        )
    else:
        p.add_argument(
            "--wheelhouse",
            action="append",
            type=existing_dir if checked else plain_path,
            help="directory of wheels to use first (repeatable)",
        )
        if index:
            p.add_argument(
                "--index",
                action="append",
                help="NAME=URL: a mirror for one of the lock's indexes (or BWSTACK_INDEX, one a line: not in `ps`)",
            )
        p.add_argument("--offline", action="store_true", help="use only the store and --wheelhouse")
        p.add_argument(
            "--ca-bundle",
            type=existing_file if checked else plain_path,
            help=ca_help or "CA bundle for TLS (always verified)",
        )
    p.add_argument(
        "--allow-unhashed", action="append", metavar="NAME",
        help="install NAME although the lock has no sha256 for it (recorded as unverified)",
    )  # fmt: skip
    if python:
        p.add_argument("--python", help="interpreter for new envs (default: pythonX.Y of the profile)")


def check_sources_here(args: argparse.Namespace) -> None:
    """The source options' paths checked as add_sources checks them while parsing, for a command that takes them
    unchecked because in another mode they name paths on the targets (`rollback --target`)."""
    checks = (("wheelhouse", "--wheelhouse", existing_dir), ("ca_bundle", "--ca-bundle", existing_file))
    for dest, flag, check in checks:
        given = getattr(args, dest, None)
        for value in given if isinstance(given, list) else [given] if given else []:
            try:
                check(value)
            except argparse.ArgumentTypeError as exc:
                raise UsageError(f"argument {flag}: {exc}") from None


def add_target(p: Container, *, default: str | None, help: str) -> None:
    p.add_argument("--target", default=default, help=help)


def add_ssh(p: Container) -> None:
    p = _group(p, "SSH (ssh:// and ansible:// targets)")
    p.add_argument("--ssh-key", metavar="FILE", help="private key for ssh:// and ansible:// hosts")
    p.add_argument(
        "--known-hosts",
        metavar="FILE",
        help="known-hosts file for ssh:// and ansible:// hosts (host keys are then checked strictly)",
    )


def add_waivers(
    p: Container,
    help: str = "waive the verify checks whose name contains CHECK, with the reason (the report shows it; repeatable)",
) -> None:
    p.add_argument("--skip", action="append", metavar="CHECK=REASON", help=help)


def add_min_free_gb(p: Container, *, default: float | None, help: str) -> None:
    """--min-free-gb, one definition for every command that takes it: `nan`, `inf` or a negative size would
    pass every disk check (or none), so they are refused before anything runs."""
    p.add_argument("--min-free-gb", type=non_negative_float, default=default, metavar="GB", help=help)


def add_extra_vars(p: Container) -> None:
    p.add_argument(
        "-e", "--extra-vars", action="append", metavar="VARS", help="passed to ansible-playbook -e (repeatable)"
    )


# ------------------------------------------------------------------------------------------------ typed values


INDEX_VARIABLE = "BWSTACK_INDEX"  # NAME=URL mirrors, one a line: credentials kept out of the process table


def index_mirrors(args: argparse.Namespace) -> tuple[str, ...]:
    """--index entries, then those in BWSTACK_INDEX (one NAME=URL a line). A command line is readable by every
    user of the machine (/proc/PID/cmdline); a process's environment only by its owner, so a mirror URL with a
    token in it goes there (the Ansible module does so on the nodes)."""
    given = tuple(getattr(args, "index", None) or ())
    from_env = tuple(line.strip() for line in os.environ.get(INDEX_VARIABLE, "").splitlines() if line.strip())
    return tuple(index_mirror(item) for item in given + from_env)


def index_mirror(item: str) -> str:
    """One NAME=URL mirror, checked where every command reads the mirrors (wheelhouse.parse_mirror, the rule the
    nodes apply): a command that hands them to a playbook refuses a bad one before Ansible runs."""
    from bwstack.provision.wheelhouse import parse_mirror

    parse_mirror(item)
    return item


def sources(args: argparse.Namespace):
    """--wheelhouse, --index (and BWSTACK_INDEX) and --offline as the provision layer's Sources."""
    from bwstack.provision.wheelhouse import Sources

    return Sources.parse(args.wheelhouse or (), index_mirrors(args), args.offline)


def apply_ca_bundle(args: argparse.Namespace) -> None:
    """--ca-bundle for every TLS connection of this process (requests and urllib read these)."""
    import os

    bundle = getattr(args, "ca_bundle", None)
    if bundle:
        if not Path(bundle).is_file():
            raise UsageError(f"--ca-bundle {bundle}: no such file")
        os.environ["REQUESTS_CA_BUNDLE"] = bundle
        os.environ["SSL_CERT_FILE"] = bundle


def waiver_texts(items: list[str] | None) -> list[str]:
    """--skip CHECK=REASON items, each checked against the known checks, in their canonical spelling."""
    from bwstack.checks import verify

    return [w.text() for w in verify.parse_waivers(items or [])]


def ssh_options(args: argparse.Namespace):
    from bwstack.checks import hostspec

    return hostspec.SshOptions.from_args(getattr(args, "ssh_key", None), getattr(args, "known_hosts", None))


def layout(args: argparse.Namespace):
    """The store location options as the store's Layout (defaults: root or user, and BWSTACK_* variables)."""
    from bwstack.store.layout import Layout

    return Layout.default(
        getattr(args, "root", None),
        getattr(args, "ml_env", None),
        getattr(args, "cuda_link", None),
        getattr(args, "take_over_links", False),
    )


def playbook_settings(args: argparse.Namespace):
    """The fleet layer's typed settings from the target, SSH, store, source and waiver options."""
    from bwstack.fleet.settings import PlaybookSettings, SourceSettings, StoreSettings, TargetSettings

    return PlaybookSettings(
        lock=args.lock,
        target=TargetSettings(args.target, ssh_options(args)),
        store=StoreSettings(
            getattr(args, "root", None),
            getattr(args, "ml_env", None),
            getattr(args, "cuda_link", None),
            bool(getattr(args, "take_over_links", False)),
        ),
        sources=SourceSettings(
            wheelhouse=tuple(getattr(args, "wheelhouse", None) or ()),
            index=index_mirrors(args),
            offline=bool(getattr(args, "offline", False)),
            ca_bundle=getattr(args, "ca_bundle", None),
            allow_unhashed=tuple(getattr(args, "allow_unhashed", None) or ()),
        ),
        waivers=tuple(waiver_texts(getattr(args, "skip", None))),
        extra_vars=tuple(getattr(args, "extra_vars", None) or ()),
        check=bool(getattr(args, "check", False)),
        diff=bool(getattr(args, "diff", False)),
    )
