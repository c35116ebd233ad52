"""`bwstack verify`: run the node checks (ABI, CUDA, SM120 kernels, features, GPU) on hosts."""

from __future__ import annotations

import argparse
from pathlib import Path

from bwstack.cli import options
from bwstack.cli.console import Console
from bwstack.errors import UsageError

NAME = "verify"
HELP = "run the node checks (ABI, CUDA, SM120 kernels, features, GPU) on hosts"
UNREAD = (options.Unread("list_checks", reads=("json",)),)  # it only names the checks

TARGET_HELP = (
    "local:// (default), ssh://[user@]host[:port][,...], ansible://INVENTORY[?limit=...&group=...] "
    "or docker://CONTAINER"
)


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_target(p, default="local://", help=TARGET_HELP)
    options.add_profile(p, help="profile to check against (default: the env's own)")
    p.add_argument("--env", type=options.plain_path, help="env path on the targets (default: their ml-env)")
    p.add_argument("--capability", type=options.capability, help="target GPU capability (default: the profile's)")
    p.add_argument("--no-runtime", action="store_true", help="skip the GPU runtime probes")
    p.add_argument("--facts-dir", type=options.plain_path, help="also write each host's probe facts as JSON here")
    options.add_waivers(p)
    p.add_argument(
        "--no-remembered-waivers",
        action="store_true",
        help="ignore the waivers the node's store remembers (provision verifies with exactly the ones it is given)",
    )
    options.add_ssh(p)
    p.add_argument(
        "--host-name", help="the name the report gives the one target (the verify role passes user@host:port)"
    )
    p.add_argument("--list-checks", action="store_true", help="name every check (what --skip matches against)")
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    from bwstack.checks import hostspec, verify

    console = Console.of(args)
    if args.list_checks:
        checks = verify.known_checks()
        console.result(list(checks), "\n".join(checks))
        return 0
    if args.facts_dir:
        _make_facts_dir(Path(args.facts_dir))
    targets = hostspec.parse(args.target, frozenset(hostspec.Scheme))
    ssh = options.ssh_options(args)
    if args.host_name is not None:
        if not args.host_name.strip():
            raise UsageError("--host-name: empty")
        if len(targets) != 1 or isinstance(targets[0], hostspec.AnsibleTarget):
            raise UsageError("--host-name names one host: give exactly one local://, ssh:// or docker:// target")
    reports = verify.check_hosts(
        targets,
        lock_path=args.lock,
        ssh=ssh,
        host_name=args.host_name,
        profile=args.profile,
        env=args.env,
        capability=args.capability,
        runtime=not args.no_runtime,
        facts_dir=args.facts_dir,
        skip=options.waiver_texts(args.skip),
        extra_args=["--stack-no-remembered-waivers"] if args.no_remembered_waivers else [],
    )
    if console.json_mode:
        console.json_text(verify.as_json(reports))
    else:
        console.text(verify.render(reports))
    return 0 if verify.ok(reports) else 1


def _make_facts_dir(folder: Path) -> None:
    """--facts-dir made before any host is checked: one that cannot be was an error in every check of every host."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--facts-dir {folder}: cannot be made ({exc.strerror or exc})") from None
