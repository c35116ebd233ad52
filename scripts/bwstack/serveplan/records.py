"""Typed records of a serve plan: the verdict of a path, the path, the suggested fix, the plan and its JSON."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TypedDict


class Verdict(str, Enum):
    """What a chosen path will do on the target GPU."""

    RUNS = "runs"  # a kernel image for the target is there (cubin, or PTX the driver JIT-compiles, or Triton)
    JIT = "jit"  # compiled at first use by nvcc (FlashInfer): runs when that nvcc is found and targets the GPU
    MISSING = "missing"  # no kernel for the target: the server fails (the start-up error is in `why`)
    KNOWN_WRONG = "known-wrong"  # runs but returns wrong results on the target (a catalogue entry says so)
    NOT_OBSERVED = "not-observed"  # this path could not be observed here; `why` says what is missing


# Every component a plan's paths name (assemble's rows): catalogue entries and remedies name one of these.
COMPONENTS = (
    "server arguments", "quantization", "attention", "attention (prefill)", "attention (decode)",
    "speculative decoding", "attention (draft decode)", "attention (draft extend)", "sampling", "dense GEMM", "MoE",
    "all-reduce",
)  # fmt: skip


@dataclass(frozen=True)
class PlanPath:
    component: str  # one of COMPONENTS
    backend: str
    kernels: tuple[str, ...]  # where the kernels come from for the target, read from the env's files
    verdict: Verdict
    why: str
    decided_at: tuple[str, ...] = ()  # SGLang file:line sites that made the choice
    jit_found: bool | None = None  # for Verdict.JIT: the compiler was found and targets the GPU
    catalogue: tuple[str, ...] = ()  # ids of the catalogue entries that apply

    @property
    def fails(self) -> bool:
        """A path the node check fails on: no kernel for the target, known wrong, or a JIT without its compiler."""
        return self.verdict in (Verdict.MISSING, Verdict.KNOWN_WRONG) or (
            self.verdict is Verdict.JIT and self.jit_found is False
        )


@dataclass(frozen=True)
class Fix:
    """Server flags and environment that route a model around its failing paths, found by planning again."""

    flags: tuple[str, ...]
    env: Mapping[str, str]
    server_args: Mapping[str, object]
    reasons: tuple[str, ...]
    fixes: bool  # the plan with these flags and env has no failing path
    remaining: tuple[str, ...] = ()  # components still failing with them
    paths: tuple[PlanPath, ...] = ()  # the plan's paths with them
    rejected: tuple[str, ...] = ()  # changes tried and not suggested, with what they led to


@dataclass(frozen=True)
class Plan:
    sglang: str | None
    capability: str
    device: str  # "simulated RTX PRO 6000 ... x8 (pcie)" or "real NVIDIA H200"
    model: str
    draft: str | None
    request: Mapping[str, object]
    server_args: Mapping[str, object]
    decisions: Mapping[str, str]  # server arg -> file:line where its value was set (or its default)
    paths: tuple[PlanPath, ...]
    packages: Mapping[str, str | None]
    notes: tuple[str, ...] = ()
    fix: Fix | None = None
    error: str | None = None  # the plan could not be made (the env could not run SGLang)

    @property
    def failing(self) -> tuple[PlanPath, ...]:
        return tuple(p for p in self.paths if p.fails)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.failing

    def as_json(self) -> PlanJSON:
        return {
            "sglang": self.sglang,
            "capability": self.capability,
            "device": self.device,
            "model": self.model,
            "draft": self.draft,
            "request": dict(self.request),
            "server_args": dict(self.server_args),
            "decisions": dict(self.decisions),
            "paths": [_path_json(p) for p in self.paths],
            "flags": list(self.fix.flags) if self.fix else [],
            "env": dict(self.fix.env) if self.fix else {},
            "fix": None
            if self.fix is None
            else {
                "flags": list(self.fix.flags),
                "env": dict(self.fix.env),
                "reasons": list(self.fix.reasons),
                "fixes": self.fix.fixes,
                "remaining": list(self.fix.remaining),
                "paths": [_path_json(p) for p in self.fix.paths],
                "rejected": list(self.fix.rejected),
            },
            "packages": dict(self.packages),
            "notes": list(self.notes),
            "ok": self.ok,
            "error": self.error,
        }


def _path_json(p: PlanPath) -> PathJSON:
    return {
        "component": p.component,
        "backend": p.backend,
        "kernels": list(p.kernels),
        "verdict": p.verdict.value,
        "why": p.why,
        "decided_at": list(p.decided_at),
        "jit_found": p.jit_found,
        "catalogue": list(p.catalogue),
    }


class PathJSON(TypedDict):
    component: str
    backend: str
    kernels: list[str]
    verdict: str
    why: str
    decided_at: list[str]
    jit_found: bool | None
    catalogue: list[str]


class FixJSON(TypedDict):
    flags: list[str]
    env: dict[str, str]
    reasons: list[str]
    fixes: bool
    remaining: list[str]
    paths: list[PathJSON]
    rejected: list[str]


class PlanJSON(TypedDict):
    sglang: str | None
    capability: str
    device: str
    model: str
    draft: str | None
    request: dict[str, object]
    server_args: dict[str, object]
    decisions: dict[str, str]
    paths: list[PathJSON]
    flags: list[str]  # the suggested server flags (empty when nothing needs changing)
    env: dict[str, str]  # the suggested environment
    fix: FixJSON | None
    packages: dict[str, str | None]
    notes: list[str]
    ok: bool
    error: str | None
