"""The plan as a table for people (the JSON is Plan.as_json())."""

from __future__ import annotations

import textwrap

from bwstack.serveplan.records import Fix, Plan, PlanPath, Verdict

WIDTH = 118
SHOWN_ARGS = (
    "attention_backend", "prefill_attention_backend", "decode_attention_backend", "sampling_backend",
    "moe_runner_backend", "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_num_draft_tokens", "quantization", "fp8_gemm_runner_backend", "fp4_gemm_runner_backend",
    "page_size", "tp_size", "disable_custom_all_reduce", "enable_torch_symm_mem",
    "enable_flashinfer_allreduce_fusion",
)  # fmt: skip
PACKAGES = ("sglang", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "sgl-kernel", "torch", "triton")


def verdict_text(path: PlanPath) -> str:
    if path.verdict is Verdict.JIT:
        return "JIT (found)" if path.jit_found else "JIT (NO nvcc)"
    return path.verdict.value.upper() if path.fails else path.verdict.value


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ") or [indent]


def _table(paths: tuple[PlanPath, ...], indent: str = "") -> list[str]:
    if not paths:
        return []
    comp = max(len("COMPONENT"), *(len(p.component) for p in paths))
    back = max(len("BACKEND"), *(len(p.backend) for p in paths))
    verd = max(len("VERDICT"), *(len(verdict_text(p)) for p in paths))
    lines = [f"{indent}{'COMPONENT':<{comp}}  {'BACKEND':<{back}}  {'VERDICT':<{verd}}  KERNELS"]
    for p in paths:
        kernels = "; ".join(p.kernels) or "-"
        lines.append(f"{indent}{p.component:<{comp}}  {p.backend:<{back}}  {verdict_text(p):<{verd}}  {kernels}")
        lines += _wrap(f"why: {p.why}", indent + "    ")
        if p.decided_at:
            lines += _wrap(f"decided at: {' | '.join(p.decided_at)}", indent + "    ")
    return lines


def _fix(fix: Fix, before: tuple[PlanPath, ...]) -> list[str]:
    tried = [line for change in fix.rejected for line in _wrap(f"- tried {change}", "  ")]
    if not fix.flags and not fix.env:
        return [f"no flag or environment from the catalogue fixes: {', '.join(fix.remaining)}", *tried]
    change = " ".join([*fix.flags, *(f"{k}={v}" for k, v in fix.env.items())])
    outcome = "with them every path runs" if fix.fixes else f"still failing with them: {', '.join(fix.remaining)}"
    lines = [f"suggested: {change}  ({outcome})"]
    lines += [line for reason in fix.reasons for line in _wrap(f"- {reason}", "  ")]
    if tried:
        lines += ["  not suggested (SGLang's plan with them still fails):", *tried]
    was = {(p.component, p.backend, p.verdict) for p in before}
    changed = tuple(p for p in fix.paths if (p.component, p.backend, p.verdict) not in was)
    if changed:
        lines.append("  the paths they change:")
        lines += _table(changed, "    ")
    return lines


def render(plan: Plan) -> str:
    draft = f" with draft {plan.draft}" if plan.draft else ""
    head = [f"serve-plan: {plan.model}{draft} on {plan.device}, capability {plan.capability}"]
    versions = ", ".join(f"{n} {plan.packages.get(n)}" for n in PACKAGES if plan.packages.get(n))
    if versions:
        head.append(versions)
    if plan.error:
        return "\n".join([*head, f"no plan: {plan.error}"])
    args = [f"{k}={plan.server_args[k]}" for k in SHOWN_ARGS if plan.server_args.get(k) is not None]
    head += _wrap("server args: " + " ".join(args), "")
    lines = [*head, "", *_table(plan.paths)]
    lines.append("")
    if plan.ok:
        lines.append("every chosen path has kernels for this GPU")
    else:
        failing = ", ".join(f"{p.component} ({p.backend}: {verdict_text(p)})" for p in plan.failing)
        lines += _wrap(f"FAILS: {failing}", "")
    if plan.fix is not None:
        lines += _fix(plan.fix, plan.paths)
    for note in plan.notes:
        lines += _wrap(f"note: {note}", "")
    return "\n".join(lines)
