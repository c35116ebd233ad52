"""`bwstack features`: what the installed code will really do on SM120 (symm-mem all-reduce, FlashInfer
all-reduce fusion), read from the env's sources."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.commands.patch import add_env_selection, site_packages
from bwstack.cli.console import Console

NAME = "features"
HELP = "what the installed code will really do on SM120"
UNREAD = (options.Unread("env", ignores=("ml_env",)),)  # it only finds the env


def add_options(p: argparse.ArgumentParser) -> None:
    add_env_selection(p)
    p.add_argument(
        "--capability", type=options.capability, default="12.0", help="target compute capability (default 12.0)"
    )


def run(args: argparse.Namespace) -> int:
    from bwstack.probe import features

    site = site_packages(args)
    report = features.report(site, args.capability)
    Console.of(args).result(report, lambda: _render(report, site, args.capability))
    return 0


def _render(report: dict, site, capability: str) -> str:
    lines = [f"SM{capability.replace('.', '')} features of {site}:"]
    for key in ("torch_symm_mem_allreduce", "flashinfer_allreduce_fusion"):
        item = report[key]
        lines += [f"  {key}: {item['state'].upper()}", f"    {item['reason']}"]
    return "\n".join(lines)
