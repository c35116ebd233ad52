"""`bwstack show`: what a profile pins, at a glance or as JSON."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "show"
HELP = "what a profile pins"


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_profile(p, help="profile (default: the lock's default_profile)")
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    from bwstack.lock.describe import describe
    from bwstack.lock.model import load_lock

    lock = load_lock(args.lock)
    payload = describe(lock, lock.profile(args.profile))
    Console.of(args).result(payload, lambda: render(payload))
    return 0


def render(payload: dict) -> str:
    lines = [f"profile {payload['profile']}: {payload['description']}", ""]
    width = max(len(k) for k in payload["stack"])
    for label, version in payload["stack"].items():
        lines.append(f"  {label:<{width}}  {version}")
    tk = payload["cuda_toolkit"]
    lines += [
        "",
        f"  python {payload['python']} on {payload['platform']}; CUDA toolkit at {tk['home']}, "
        f"driver >= {tk['min_driver']}",
        f"  apt {tk['apt']} | pip {tk['pip']} | image {tk['docker_base']}",
    ]
    if payload["overrides"]:
        lines.append("  overrides:")
        for o in payload["overrides"]:
            lines.append(f"    {o['package']} {o['replaces']} -> {o['with']} (for {o['required_by']})")
    lines.append(f"  patches: {', '.join(payload['patches']) or 'none'}")
    lines.append(f"  target {payload['target']['name']}: {payload['target']['description']}")
    features = ", ".join(f"{k}={v}" for k, v in payload["expect"]["features"].items())
    lines.append(f"  expected on SM{payload['expect']['target_capability'].replace('.', '')}: {features}")
    closure = payload["closure"]
    if closure is None:
        lines.append("  closure: not resolved (run `bwstack lock`)")
    else:
        lines.append(
            f"  closure: {closure['packages']} packages, {closure['resolved_here']} resolved here; "
            f"not resolvable here: {', '.join(closure['not_resolved_here']) or 'none'}"
        )
        if closure["missing_hashes"]:
            lines.append(f"  no hash known for: {', '.join(closure['missing_hashes'])} (needs --allow-unhashed)")
    lines.append(f"  lock digest {payload['lock_digest']}")
    return "\n".join(lines)
