"""`bwstack serve-plan`: the plan for one model, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bwstack.errors import UsageError

CAPABILITY_RE = re.compile(r"^\d{1,2}\.\d$")
NAME_RE = re.compile(r"^[A-Za-z0-9_]+$")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-plan",
        help="what SGLang will really run for a model on the target GPU, with the kernels behind every path",
        description="Exit status: 0 when every chosen path has kernels for the GPU, 1 when one does not (the "
        "suggested flags are printed) or no plan could be made, 2 for bad input.",
    )
    p.add_argument("--model", help="a model directory (config.json, no weights) or a reference config name")
    p.add_argument("--draft", help="the speculative draft model (directory or reference name)")
    p.add_argument("--list-models", action="store_true", help="list the reference configs and where they come from")
    p.add_argument("--profile", help="the lock profile whose hardware target is planned for (default: the lock's)")
    p.add_argument("--env", help="the env whose SGLang decides (default: the active ml-env)")
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--ml-env", help=argparse.SUPPRESS)
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
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_serve_plan)


def _env(args: argparse.Namespace) -> Path:
    from bwstack.store.generations import Layout

    env = Path(args.env) if args.env else Layout.default(args.root, args.ml_env, None).ml_env
    if not (env / "bin" / "python").exists():
        raise UsageError(f"--env {env}: not a Python env (no bin/python); provision one or pass --env PATH")
    return env


def _model(value: str | None, option: str) -> str | None:
    from bwstack.probe.serveplan import references

    if value is None:
        return None
    if not value.strip():
        raise UsageError(
            f"{option}: empty value (a model directory or one of {', '.join(references.reference_names())})"
        )
    if value in references.reference_names():
        return value
    path = Path(value).expanduser()
    if not (path / "config.json").is_file():
        raise UsageError(
            f"{option} {value}: neither a reference config ({', '.join(references.reference_names())}) "
            "nor a directory with a config.json"
        )
    return str(path.resolve())


def _name(value: str | None, option: str) -> str | None:
    if value is None:
        return None
    if not NAME_RE.match(value):
        raise UsageError(f"{option} {value!r}: expected a name such as those SGLang's --help lists")
    return value


def _check(args: argparse.Namespace) -> None:
    if args.capability is not None and not CAPABILITY_RE.match(args.capability):
        raise UsageError(f"--capability {args.capability!r}: expected a compute capability like 12.0")
    if args.tp is not None and not 1 <= args.tp <= 64:
        raise UsageError(f"--tp {args.tp}: expected a tensor parallel size between 1 and 64")
    if args.draft is not None and not args.speculative_algorithm:
        raise UsageError("--draft needs --speculative-algorithm (e.g. EAGLE3)")


def _list_models(args: argparse.Namespace) -> int:
    from bwstack.probe.serveplan import references

    rows = {name: references.source(name) for name in references.reference_names()}
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    width = max(len(n) for n in rows)
    for name, src in rows.items():
        print(f"{name:<{width}}  {src['repo']}: {src['shape']}")
    return 0


def cmd_serve_plan(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock
    from bwstack.probe.serveplan import node
    from bwstack.serveplan import assemble, catalogue, render

    if args.list_models:
        return _list_models(args)
    _check(args)
    model = _model(args.model, "--model")
    if model is None:
        raise UsageError("--model is required (a model directory or a reference config; --list-models lists them)")
    draft = _model(args.draft, "--draft")
    target = load_lock(args.lock).profile(args.profile).target
    env = _env(args)
    device = None
    if not args.capability and not args.simulate:
        device = node.real_device(env, target.interconnect)
    if device is None:
        device = node.Device(
            node.SIMULATED,
            args.capability or target.capability,
            target.count,
            target.memory_gb * 1024,
            target.gpu_name,
            target.interconnect,
        )
    tp = args.tp or (target.count if device.mode == node.SIMULATED else device.count)
    request: node.Request = {"id": "plan", "model": model, "tp": tp}
    if draft:
        request["draft"] = draft
    for key in ("speculative_algorithm", "quantization", "attention_backend", "moe_runner_backend"):
        value = _name(getattr(args, key), f"--{key.replace('_', '-')}")
        if value:
            request[key] = value
    cat = catalogue.load()
    first = node.observe(env, device, [request])
    observation = first.as_dict()
    cuda = observation["kernels"].get("nvcc")

    def run(requests: list[dict]) -> dict:
        tagged = [{**r, "id": f"fix-{i}"} for i, r in enumerate(requests)]
        return node.observe(env, device, tagged, cuda=cuda).as_dict()

    plan = assemble.plan_for(observation, 0, cat, label=args.model)
    if not args.no_fix:
        fix = assemble.find_fix(plan, request, cat, run)
        if fix is not None:
            from dataclasses import replace

            plan = replace(plan, fix=fix)
    if args.json:
        json.dump(plan.as_json(), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(render.render(plan))
    return 0 if plan.ok else 1
