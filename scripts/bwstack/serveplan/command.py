"""`bwstack serve-plan`: the plan for one model (its options are declared in bwstack.cli.commands.serve_plan,
which prints the plan as a table or JSON)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from bwstack.errors import UsageError

CAPABILITY_RE = re.compile(r"^\d{1,2}\.\d$")
NAME_RE = re.compile(r"^[A-Za-z0-9_]+$")


def _env(args: argparse.Namespace) -> Path:
    from bwstack.store.layout import Layout

    env = Path(args.env) if args.env else Layout.default(None, args.ml_env, None).ml_env
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


def list_models() -> dict[str, dict]:
    """The reference configs, each with where it comes from."""
    from bwstack.probe.serveplan import references

    return {name: references.source(name) for name in references.reference_names()}


def serve_plan(args: argparse.Namespace):
    """The plan (a serveplan.records plan) for the model and flags the serve-plan options name."""
    from bwstack.lock.model import load_lock
    from bwstack.probe.serveplan import node
    from bwstack.serveplan import assemble, catalogue

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
    # What the fix search may ask for is planned beside the model, in the same start of SGLang.
    speculate = None if args.no_fix else assemble.speculation(cat)
    first = node.observe_speculating(env, device, [request], speculate)
    observation = first.as_dict()
    cuda = observation["kernels"].get("nvcc")

    def run(requests: list[dict]) -> dict:
        planned = assemble.already_planned(observation, requests)
        if planned is not None:
            return planned
        tagged = [{**r, "id": f"fix-{i}"} for i, r in enumerate(requests)]
        return node.observe(env, device, tagged, cuda=cuda).as_dict()

    plan = assemble.plan_for(observation, 0, cat, label=args.model)
    if not args.no_fix:
        fix = assemble.find_fix(plan, request, cat, run)
        if fix is not None:
            from dataclasses import replace

            plan = replace(plan, fix=fix)
    return plan
