"""The node check on top of serve-plan: a model the lock says a node must serve passes when every path SGLang
chooses for it has kernels for the GPU, or when the suggested flags take it onto paths that do (they are listed);
it fails otherwise, naming the path and why."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from bwstack.lock.model import ServedModel
from bwstack.serveplan import assemble, render
from bwstack.serveplan.catalogue import Catalogue
from bwstack.serveplan.records import Plan


@dataclass(frozen=True)
class Outcome:
    passed: bool
    message: str
    notes: tuple[str, ...]
    plan: Plan


def request_of(served: ServedModel, index: int) -> dict:
    """The node request for one `expect.models` entry."""
    request: dict = {"id": f"model-{index}", "model": served.model, "tp": served.tp}
    for key in ("draft", "speculative_algorithm", "quantization", "attention_backend", "moe_runner_backend"):
        value = getattr(served, key)
        if value:
            request[key] = value
    if served.env:
        request["env"] = dict(served.env)
    return request


def _label(plan: Plan) -> str:
    return plan.model + (f" + {plan.draft}" if plan.draft else "")


def _summary(plan: Plan) -> str:
    return ", ".join(f"{p.component} {p.backend}: {render.verdict_text(p)}" for p in plan.paths)


def judge(observation: Mapping, index: int, catalogue: Catalogue, run: assemble.Runner) -> Outcome:
    """Judge the index-th model of a node observation; `run` plans changed requests on the same node."""
    plan = assemble.plan_for(observation, index, catalogue)
    label = _label(plan)
    if plan.error:
        return Outcome(False, f"{label}: no plan: {plan.error}", (), plan)
    notes = [f"{label} on {plan.device}: {_summary(plan)}", *plan.notes]
    if plan.ok:
        return Outcome(True, "", tuple(notes), plan)
    failing = "; ".join(f"{p.component} {p.backend} is {render.verdict_text(p)}: {p.why}" for p in plan.failing)
    fix = assemble.find_fix(plan, observation["requests"][index], catalogue, run)
    plan = replace(plan, fix=fix)
    if fix is not None and fix.fixes:
        change = " ".join([*fix.flags, *(f"{k}={v}" for k, v in fix.env.items())])
        short = ", ".join(f"{p.component} {p.backend} {render.verdict_text(p)}" for p in plan.failing)
        notes.insert(0, f"serve {label} with: {change} (the plan with them runs; without them: {short})")
        return Outcome(True, "", tuple(notes), plan)
    tried = (
        f"; the suggested {' '.join([*fix.flags, *(f'{k}={v}' for k, v in fix.env.items())])} leave "
        f"{', '.join(fix.remaining)} failing"
        if fix is not None and (fix.flags or fix.env)
        else "; no flag or environment from the catalogue fixes it"
    )
    return Outcome(False, f"{label} on {plan.device}: {failing}{tried}", tuple(notes), plan)
