"""`bwstack serve-plan`: what SGLang will really run for a model on the target GPU (the work:
bwstack.serveplan)."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "serve-plan"
HELP = "what SGLang will really run for a model on the target GPU, with the kernels behind every path"
# Refused by bwstack.serveplan's own checks, which say what is expected (a capability, a model or reference).
OWN_EMPTY_CHECKS = ("capability", "model", "draft")
DESCRIPTION = (
    "Exit status: 0 when every chosen path has kernels for the GPU, 1 when one does not (the "
    "suggested flags are printed) or no plan could be made, 2 for bad input."
)
UNREAD = (
    options.Unread("list_models", reads=("json",)),  # it only lists the configs
    options.Unread("env", ignores=("ml_env",)),  # it only finds the env
)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a model directory (config.json, no weights) or a reference config name")
    p.add_argument("--draft", help="the speculative draft model (directory or reference name)")
    p.add_argument("--list-models", action="store_true", help="list the reference configs and where they come from")
    options.add_profile(p, help="the lock profile whose hardware target is planned for (default: the lock's)")
    p.add_argument("--env", type=options.plain_path, help="the env whose SGLang decides (default: the active ml-env)")
    options.add_ml_env(p, hidden=True)
    p.add_argument(
        "--capability",
        help="simulate this GPU capability (default: the profile target's, or the real GPU when this host has one)",
    )
    p.add_argument("--simulate", action="store_true", help="simulate the target even on a host with a GPU")
    p.add_argument("--tp", type=int, help="tensor parallel size (default: the target's GPU count)")
    p.add_argument("--speculative-algorithm", help="e.g. EAGLE3 (SGLang's names)")
    p.add_argument("--quantization", help="SGLang's --quantization")
    p.add_argument("--attention-backend", help="SGLang's --attention-backend")
    p.add_argument("--moe-runner-backend", help="SGLang's --moe-runner-backend")
    p.add_argument("--no-fix", action="store_true", help="do not search for flags that fix failing paths")
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    from bwstack.serveplan import command as serveplan

    console = Console.of(args)
    if args.list_models:
        rows = serveplan.list_models()
        width = max(len(n) for n in rows)
        console.result(rows, lambda: "\n".join(f"{n:<{width}}  {s['repo']}: {s['shape']}" for n, s in rows.items()))
        return 0
    from bwstack.serveplan import render

    plan = serveplan.serve_plan(args)
    console.result(plan.as_json(), lambda: render.render(plan))
    return 0 if plan.ok else 1
