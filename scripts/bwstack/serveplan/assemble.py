"""From what the node observed to a plan: one row per chosen path, where its kernels come from, and a verdict.

SGLang's choices are never made here: they come from `inenv.py`'s observation of SGLang's code running. What this
module adds is bwstack's knowledge of where each backend's kernels live (a prebuilt library, FlashInfer's nvcc
JIT, Triton's JIT, FlashInfer's prebuilt TRT-LLM cubins, DeepGEMM's JIT) and the judgement of the kernel facts
the node read from the env's files, plus the catalogue of field reports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from bwstack.probe import fatbin
from bwstack.serveplan.catalogue import Applies, Catalogue, Kind
from bwstack.serveplan.records import Fix, Plan, PlanPath, Verdict

NO_IMAGE = "no kernel image is available for execution on the device"
# The oldest CUDA whose nvcc targets each architecture (NVIDIA CUDA 12.8 / 12.9 release notes: sm_100a and
# sm_120a arrived in 12.8, the family targets sm_100f/sm_120f and sm_103a/sm_121a in 12.9).
NVCC_FOR_ARCH = {"90a": "12.0", "100a": "12.8", "120a": "12.8", "100f": "12.9", "120f": "12.9", "103a": "12.9",
                 "121a": "12.9"}  # fmt: skip


@dataclass(frozen=True)
class _Kernel:
    kernels: tuple[str, ...]
    verdict: Verdict
    why: str
    jit_found: bool | None = None


@dataclass(frozen=True)
class Context:
    """Everything one request's plan is judged against."""

    steps: Mapping
    kernels: Mapping
    features: Mapping
    capability: str
    interconnect: str
    versions: Mapping[str, str | None]
    catalogue: Catalogue


# ------------------------------------------------------------------------------------------------ kernels


def _library(cov: Mapping | None, label: str) -> _Kernel:
    if not cov:
        return _Kernel((label,), Verdict.NOT_OBSERVED, f"{label} is not installed in this env")
    if cov.get("error"):
        return _Kernel((label,), Verdict.NOT_OBSERVED, f"{label}: cannot read its fatbin: {cov['error']}")
    name = cov["path"].rsplit("/", 1)[-1]
    where = f"{label} ({name})"
    if cov.get("covers"):
        return _Kernel((where,), Verdict.RUNS, f"{name}: {cov['reason']}")
    return _Kernel((where,), Verdict.MISSING, f"{name}: {cov['reason']}; the server fails with '{NO_IMAGE}'")


def _nvcc_for(arch_flags: list[str]) -> tuple[str, str | None]:
    """('sm_120a', '12.8') from FlashInfer's -gencode flags."""
    for flag in arch_flags:
        if "code=sm_" in flag:
            arch = flag.rsplit("code=sm_", 1)[1]
            return f"sm_{arch}", NVCC_FOR_ARCH.get(arch)
    return "", None


def _flashinfer_jit(ctx: Context, module: str) -> _Kernel:
    jit = ctx.steps.get("flashinfer_jit") or {}
    if not jit.get("ok"):
        error = (jit.get("error") or jit.get("not_observed") or {}).get("message", "FlashInfer could not be imported")
        return _Kernel((f"FlashInfer JIT ({module})",), Verdict.NOT_OBSERVED, f"FlashInfer's JIT settings: {error}")
    flags = jit.get("nvcc_flags") or []
    if jit.get("error"):
        error = jit["error"]
        return _Kernel(
            (f"FlashInfer JIT ({module})",),
            Verdict.MISSING,
            f"FlashInfer has no target for this GPU: {error['message']}",
        )
    arch, minimum = _nvcc_for(flags)
    nvcc = ctx.kernels.get("nvcc") or {}
    compile_ = nvcc.get("compile") or {}
    found = bool(nvcc.get("nvcc") and compile_.get("ok") and compile_.get("arch") == arch)
    gencode = next((f for f in flags if f.startswith("-gencode")), "")
    need = f"needs nvcc >= {minimum} for {arch}" if minimum else f"needs an nvcc that targets {arch}"
    if found:
        have = f"found nvcc {nvcc.get('nvcc_version')} at {nvcc['nvcc']}, which compiles {arch} (tried)"
    elif nvcc.get("nvcc"):
        have = f"nvcc {nvcc.get('nvcc_version')} at {nvcc['nvcc']} cannot compile {arch}: {compile_.get('error', '')}"
    elif nvcc.get("cuda_home"):
        have = f"no nvcc in the env's CUDA_HOME {nvcc['cuda_home']}"
    else:
        have = "no nvcc for this env (no CUDA_HOME, none on PATH)"
    cache = ctx.kernels.get("flashinfer_jit_cache")
    cached = f"; flashinfer-jit-cache holds {cache['covering']} prebuilt modules for this GPU" if cache else ""
    why = f"FlashInfer compiles its {module} kernels at first use with {gencode}: {need}; {have}{cached}"
    return _Kernel((f"FlashInfer JIT ({module}, nvcc {arch})",), Verdict.JIT, why, jit_found=found)


def _triton(ctx: Context, what: str) -> _Kernel:
    triton = ctx.kernels.get("triton")
    if not triton:
        return _Kernel((f"Triton JIT ({what})",), Verdict.NOT_OBSERVED, "triton is not installed in this env")
    label = f"Triton JIT ({what}, ptxas {triton.get('version')} {triton['arch']})"
    if triton.get("override"):
        return _Kernel(
            (label,), Verdict.NOT_OBSERVED, f"TRITON_PTXAS_PATH={triton['override']} replaces Triton's ptxas"
        )
    if triton["compiles"]["ok"]:
        why = (
            f"Triton compiles {what} at first use with its bundled ptxas {triton.get('version')}, which assembles "
            f"{triton['arch']} (tried)"
        )
        return _Kernel((label,), Verdict.RUNS, why)
    error = triton["compiles"]["error"]
    return _Kernel((label,), Verdict.MISSING, f"Triton's bundled ptxas cannot assemble {triton['arch']}: {error}")


def _trtllm_cubins(ctx: Context, family: str, what: str) -> _Kernel:
    info = (ctx.kernels.get("flashinfer_cubin") or {}).get(family)
    label = f"flashinfer-cubin {family} cubins ({what})"
    if not info:
        return _Kernel((label,), Verdict.NOT_OBSERVED, f"flashinfer-cubin has no {family} cubins in this env")
    archs = list(info["archs"])
    usable = [a for a in archs if a.startswith("sm_") and _cubin_runs(a, ctx.capability)]
    shown = ", ".join(f"{a} x{n}" for a, n in info["archs"].items())
    if usable:
        return _Kernel((label,), Verdict.RUNS, f"prebuilt TRT-LLM kernels: {shown}")
    guard = (ctx.kernels.get("flashinfer_guards") or {}).get(family)
    error = f"; FlashInfer rejects the GPU at {guard['site']}: `{guard['code']}`" if guard else ""
    why = f"FlashInfer's prebuilt TRT-LLM {what} kernels are {shown} only: none for {ctx.capability}{error}"
    return _Kernel((label,), Verdict.MISSING, why)


def _cubin_runs(arch: str, capability: str) -> bool:
    number = int("".join(c for c in arch.removeprefix("sm_") if c.isdigit()))
    entry = fatbin.FatbinEntry("cubin", number, "", (0, 0), None, 0, 0, 0)
    return fatbin.runs_on(entry, capability)


def _deep_gemm(ctx: Context) -> _Kernel:
    info = ctx.kernels.get("deep_gemm")
    if not info:
        return _Kernel(("DeepGEMM JIT",), Verdict.NOT_OBSERVED, "deep_gemm is not installed in this env")
    majors = {int(a.removeprefix("sm_")) // 10 for a in info["archs"]}
    label = f"DeepGEMM JIT ({info['impls']}: {', '.join(info['archs'])})"
    major = int(ctx.capability.split(".")[0])
    if major in majors:
        nvcc = ctx.kernels.get("nvcc") or {}
        found = bool(nvcc.get("nvcc"))
        have = f"nvcc {nvcc.get('nvcc_version')} found" if found else "no nvcc found for this env"
        return _Kernel((label,), Verdict.JIT, f"DeepGEMM compiles its kernels at first use: {have}", found)
    why = (
        f"DeepGEMM compiles its kernels at first use from {info['impls']}, which holds "
        f"{', '.join(info['archs'])} implementations only: none for {ctx.capability}"
    )
    return _Kernel((label,), Verdict.MISSING, why)


def _sgl_kernel(ctx: Context, lib: str, what: str) -> _Kernel:
    cov = (ctx.kernels.get("sgl_kernel") or {}).get(lib)
    got = _library(cov, f"sgl-kernel {lib}")
    return replace(got, why=f"{what}: {got.why}")


def _torch(ctx: Context, what: str) -> _Kernel:
    got = _library(ctx.kernels.get("torch"), "torch")
    return replace(got, why=f"{what}: {got.why}")


def _cublas(ctx: Context) -> _Kernel:
    got = _library(ctx.kernels.get("cublas"), "cuBLASLt")
    return replace(got, why=f"torch's matmul on cuBLASLt: {got.why}")


# ------------------------------------------------------------------------------------------------ backends

ATTENTION: dict[str, Callable[[Context, bool], _Kernel]] = {
    "flashinfer": lambda c, mla: _flashinfer_jit(c, "MLA attention" if mla else "attention"),
    "triton": lambda c, mla: _triton(c, "attention kernels"),
    "fa3": lambda c, mla: _sgl_kernel(c, "flash_ops", "FlashAttention 3 from sgl-kernel"),
    "flashmla": lambda c, mla: _sgl_kernel(c, "flashmla_ops", "FlashMLA from sgl-kernel"),
    "cutlass_mla": lambda c, mla: _sgl_kernel(c, "common_ops", "CUTLASS MLA from sgl-kernel"),
    "trtllm_mha": lambda c, mla: _trtllm_cubins(c, "fmha", "attention"),
    "trtllm_mla": lambda c, mla: _trtllm_cubins(c, "fmha", "MLA attention"),
    "torch_native": lambda c, mla: _torch(c, "PyTorch SDPA"),
    "flex_attention": lambda c, mla: _triton(c, "torch flex attention"),
}


def _attention_kernel(ctx: Context, backend: str, mla: bool) -> _Kernel:
    make = ATTENTION.get(backend)
    if make is None:
        return _Kernel((backend,), Verdict.NOT_OBSERVED, f"bwstack does not know where {backend!r} finds its kernels")
    return make(ctx, mla)


def _site(decision: Mapping | None) -> str | None:
    if not decision:
        return None
    if decision.get("function") == "given":
        return f"given: {decision.get('code')}"
    if not decision.get("site"):
        return None
    code = f": {decision['code']}" if decision.get("code") else " (default)"
    return f"{decision['site']}{code}"


def _sites(ctx: Context, primary: str, *secondary: str) -> tuple[str, ...]:
    """Where `primary` got its value, then the others that SGLang (or the user) set (their defaults say nothing)."""
    sites = (ctx.steps.get("server_args") or {}).get("sites") or {}
    out = [_site(sites.get(primary))]
    out += [_site(sites.get(n)) for n in secondary if (sites.get(n) or {}).get("function") != "default"]
    return tuple(s for s in out if s)


# ------------------------------------------------------------------------------------------------ rows


def _row(component: str, backend: str, kernel: _Kernel, decided: tuple[str, ...], why: str = "") -> PlanPath:
    text = f"{why}; {kernel.why}" if why else kernel.why
    return PlanPath(component, backend, kernel.kernels, kernel.verdict, text, decided, kernel.jit_found)


def _unobserved(component: str, step: Mapping) -> PlanPath | None:
    """A step that could not run here (its imports failed in this env) gives a not-observed row."""
    error = step.get("not_observed")
    if not error:
        return None
    kernel = _Kernel(
        (), Verdict.NOT_OBSERVED, f"not observed: SGLang's code for it could not run here: {_error_text(error)}"
    )
    return _row(component, "?", kernel, ())


def _error_text(error: Mapping) -> str:
    where = f" (raised at {error['site']}: {error.get('code')})" if error.get("site") else ""
    return f"{error['type']}: {error['message']}{where}"


def _attention_rows(ctx: Context) -> list[PlanPath]:
    step = ctx.steps.get("attention") or {}
    if (row := _unobserved("attention", step)) is not None:
        return [row]
    mla = bool((ctx.steps.get("model") or {}).get("use_mla_backend"))
    decided = _sites(ctx, "attention_backend", "prefill_attention_backend", "decode_attention_backend")
    names = [("attention", step.get("prefill"))]
    if step.get("decode") != step.get("prefill"):
        names = [("attention (prefill)", step.get("prefill")), ("attention (decode)", step.get("decode"))]
    rows = []
    for component, backend in names:
        gate = (step.get("gates") or {}).get(backend) or {}
        if gate and not gate.get("passed"):
            error = gate.get("error") or {}
            kernel = _Kernel(
                (backend,), Verdict.MISSING, f"SGLang refuses the backend on this GPU: {_error_text(error)}"
            )
            rows.append(
                _row(
                    component,
                    backend,
                    kernel,
                    (
                        *decided,
                        *(filter(None, [error.get("site")])),
                    ),
                )
            )
            continue
        rows.append(_row(component, backend, _attention_kernel(ctx, backend, mla), decided))
    return rows


def _draft_rows(ctx: Context) -> list[PlanPath]:
    spec = ctx.steps.get("speculative") or {}
    if (row := _unobserved("speculative decoding", spec)) is not None:
        return [row]
    if not spec.get("applies"):
        return []
    rows = []
    decided = _sites(ctx, "speculative_algorithm", "speculative_eagle_topk", "speculative_num_steps")
    draft = spec.get("draft") or {}
    if draft:
        target = ctx.steps.get("model") or {}
        if not draft.get("ok"):
            error = draft.get("error") or {"type": "Error", "message": "the draft model could not be resolved"}
            kernel = _Kernel((), Verdict.MISSING, f"the draft model cannot load: {_error_text(error)}")
        elif spec.get("algorithm") == "EAGLE3" and target.get("supports_eagle3_capture") is False:
            kernel = _Kernel(
                (), Verdict.MISSING, f"{target.get('model_class')} does not capture hidden states for EAGLE-3"
            )
        else:
            kernel = _Kernel(
                (),
                Verdict.RUNS,
                f"draft {draft.get('architecture')} -> {draft.get('model_class')} ({draft.get('model_class_site')}); "
                f"target {target.get('model_class')} captures EAGLE-3 hidden states; the draft's kernels are the rows "
                "marked (draft)",
            )
        values = (ctx.steps.get("server_args") or {}).get("values") or {}
        backend = (
            f"{spec.get('algorithm')} steps={values.get('speculative_num_steps')} "
            f"topk={values.get('speculative_eagle_topk')} draft_tokens={values.get('speculative_num_draft_tokens')}"
        )
        rows.append(_row("speculative decoding", backend, kernel, decided))
    mla = bool((ctx.steps.get("model") or {}).get("use_mla_backend"))
    for step, label in (("decode", "attention (draft decode)"), ("draft_extend", "attention (draft extend)")):
        info = (spec.get("draft_backends") or {}).get(step) or {}
        if not info or (info.get("backend") is None and not info.get("error")):
            continue
        site = (info.get("site"),) if info.get("site") else ()
        if info.get("error"):
            error = info["error"]
            kernel = _Kernel((), Verdict.MISSING, f"SGLang has no draft backend for it: {_error_text(error)}")
            rows.append(_row(label, info.get("backend") or "?", kernel, site))
            continue
        rows.append(_row(label, info["backend"], _attention_kernel(ctx, info["backend"], mla), site))
    return rows


def _sampling_rows(ctx: Context) -> list[PlanPath]:
    values = (ctx.steps.get("server_args") or {}).get("values") or {}
    backend = values.get("sampling_backend")
    decided = _sites(ctx, "sampling_backend")
    if backend == "flashinfer":
        return [_row("sampling", backend, _flashinfer_jit(ctx, "sampling"), decided)]
    if backend == "pytorch":
        return [_row("sampling", backend, _torch(ctx, "PyTorch sampling"), decided)]
    kernel = _Kernel((str(backend),), Verdict.NOT_OBSERVED, f"bwstack does not know where {backend!r} finds kernels")
    return [_row("sampling", str(backend), kernel, decided)]


BLOCK_FP8: dict[str, tuple[str, Callable[[Context], _Kernel]]] = {
    "deepgemm": ("deep_gemm", _deep_gemm),
    "flashinfer_deepgemm": ("flashinfer_deepgemm", lambda c: _trtllm_cubins(c, "deep-gemm", "FP8 GEMM")),
    "flashinfer_gemm": ("flashinfer_trtllm", lambda c: _trtllm_cubins(c, "gemm", "FP8 block GEMM")),
    "cutlass": ("cutlass (sgl-kernel)", lambda c: _sgl_kernel(c, "common_ops", "CUTLASS FP8 block GEMM")),
    "triton": ("triton", lambda c: _triton(c, "the FP8 block GEMM")),
}


def _linear_rows(ctx: Context) -> list[PlanPath]:
    step = ctx.steps.get("linear")
    if not step:
        return []
    if (row := _unobserved("dense GEMM", step)) is not None:
        return [row]
    decided = tuple(s for s in [step.get("method_site")] if s)
    if not step.get("ok"):
        error = step.get("error") or {}
        if "quant_method is not None" in (error.get("code") or ""):
            qc = (ctx.steps.get("quant_config") or {}).get("class")
            kernel = _cublas(ctx)
            why = (
                f"{qc}.get_quant_method gives dense layers no method: the model class decides whether it builds them "
                f"unquantized (not observed; then {kernel.why})"
            )
            return [PlanPath("dense GEMM", "cublas (if unquantized)", kernel.kernels, Verdict.NOT_OBSERVED, why)]
        kernel = _Kernel((), Verdict.NOT_OBSERVED, f"the dense layer could not be built here: {_error_text(error)}")
        return [_row("dense GEMM", "?", kernel, decided)]
    method = step.get("method")
    if method == "UnquantizedLinearMethod":
        return [_row("dense GEMM", "cublas", _cublas(ctx), decided)]
    block = step.get("block_fp8_gemm")
    if block:
        function = block.get("function") or ""
        key = next((k for k in BLOCK_FP8 if function.startswith(k)), None)
        sites = (*decided, *(filter(None, [block.get("site")])), *_sites(ctx, "fp8_gemm_runner_backend"))
        if key is None:
            kernel = _Kernel((function,), Verdict.NOT_OBSERVED, f"bwstack does not know where {function} finds kernels")
            return [_row("dense GEMM", function, kernel, sites)]
        backend, make = BLOCK_FP8[key]
        return [_row("dense GEMM", backend, make(ctx), sites, f"{method}: block FP8 via {function}")]
    fp4 = step.get("fp4_gemm")
    if fp4:
        sites = (
            *decided,
            *(filter(None, [fp4.get("flashinfer_mm_fp4_site")])),
            *_sites(ctx, "fp4_gemm_runner_backend"),
        )
        if not fp4.get("flashinfer_mm_fp4"):
            kernel = _sgl_kernel(ctx, "common_ops", "sgl-kernel cutlass_scaled_fp4_mm")
            return [_row("dense GEMM", "cutlass_scaled_fp4_mm (sgl-kernel)", kernel, sites)]
        sub = fp4.get("flashinfer_backend")
        backend = f"flashinfer mm_fp4 ({sub})"
        declared = ((fp4.get("flashinfer_declares") or {}).get("backends") or {}).get(sub)
        if declared is False:
            kernel = _Kernel(
                (backend,),
                Verdict.MISSING,
                f"FlashInfer declares mm_fp4 backend {sub!r} unsupported on capability "
                f"{fp4['flashinfer_declares']['capability']}: BackendSupportedError at the first FP4 GEMM",
            )
            return [_row("dense GEMM", backend, kernel, sites)]
        return [_row("dense GEMM", backend, _flashinfer_jit(ctx, f"FP4 GEMM ({sub})"), sites, f"{method}: NVFP4")]
    kernel = _Kernel((str(method),), Verdict.NOT_OBSERVED, f"bwstack does not know where {method} finds its kernels")
    return [_row("dense GEMM", str(method), kernel, decided)]


def _moe_backend(step: Mapping) -> tuple[str, str | None]:
    """(backend, the flag or runner that chose it) from the quant method SGLang built for the MoE layer."""
    method, flags = step.get("method"), step.get("flags") or {}
    runner = (step.get("runner") or {}).get("backend")
    for flag, backend in (
        ("use_flashinfer", "flashinfer_mxfp4"),
        ("use_flashinfer_trtllm_moe", "flashinfer_trtllm"),
        ("enable_flashinfer_trtllm_moe", "flashinfer_trtllm"),
        ("use_flashinfer_cutlass", "flashinfer_cutlass"),
        ("enable_flashinfer_cutlass_moe", "flashinfer_cutlass"),
        ("use_triton_kernels", "triton_kernels"),
    ):
        if flags.get(flag):
            return backend, flag
    if method == "ModelOptNvFp4FusedMoEMethod":
        return "cutlass (sgl-kernel)", None
    return (runner or "?"), None


def _triton_kernels(ctx: Context) -> _Kernel:
    base = _triton(ctx, "triton_kernels matmul_ogs")
    info, triton = ctx.kernels.get("triton_kernels"), ctx.kernels.get("triton")
    if base.verdict is not Verdict.RUNS or not info or not info.get("tma_gather_from") or not triton:
        return base
    if fatbin.parse_capability(ctx.capability) < fatbin.parse_capability(info["tma_gather_from"]):
        return base
    if triton["tile_gather4"]["ok"]:
        return replace(base, why=f"{base.why}; its TMA gather (.tile::gather4) assembles too (tried)")
    why = (
        f"triton_kernels uses TMA gather on capability >= {info['tma_gather_from']} ({info['site']}), and Triton's "
        f"bundled ptxas {triton.get('version')} rejects it for {triton['arch']} (tried): "
        f"{triton['tile_gather4']['error'][:200]}; the server fails at the first MoE forward (PTXASError)"
    )
    return _Kernel(base.kernels, Verdict.MISSING, why)


MOE: dict[str, Callable[[Context], _Kernel]] = {
    "triton": lambda c: _triton(c, "SGLang's fused MoE"),
    "triton_kernels": _triton_kernels,
    "deep_gemm": _deep_gemm,
    "flashinfer_trtllm": lambda c: _trtllm_cubins(c, "batched_gemm", "MoE"),
    "flashinfer_mxfp4": lambda c: _trtllm_cubins(c, "batched_gemm", "MXFP4 MoE"),
    "flashinfer_cutlass": lambda c: _flashinfer_jit(c, "CUTLASS fused MoE"),
    "cutlass (sgl-kernel)": lambda c: _sgl_kernel(c, "common_ops", "CUTLASS FP4 grouped GEMM"),
}


def _moe_rows(ctx: Context) -> list[PlanPath]:
    step = ctx.steps.get("moe") or {}
    if (row := _unobserved("MoE", step)) is not None:
        return [row]
    if not step.get("applies"):
        return []
    decided = _sites(ctx, "moe_runner_backend")
    if not step.get("ok"):
        error = step.get("error") or {}
        started = error.get("type") in ("ValueError", "NotImplementedError", "RuntimeError") and error.get("site")
        verdict = Verdict.MISSING if started else Verdict.NOT_OBSERVED
        text = "SGLang refuses the MoE layer on this GPU" if started else "the MoE layer could not be built here"
        kernel = _Kernel((), verdict, f"{text}: {_error_text(error)}")
        return [_row("MoE", "?", kernel, (*decided, *(filter(None, [error.get("site")]))))]
    backend, flag = _moe_backend(step)
    runner = step.get("runner") or {}
    sites = [*decided, step.get("method_site")]
    if flag:
        sites.append((step.get("flag_sites") or {}).get(flag))
    elif runner.get("site"):
        sites.append(f"{runner['site']}: {runner.get('code', '')}")
    make = MOE.get(backend)
    if make is None:
        kernel = _Kernel((backend,), Verdict.NOT_OBSERVED, f"bwstack does not know where MoE {backend!r} finds kernels")
    else:
        kernel = make(ctx)
    via = f"{step.get('method')}" + (f" with {flag}" if flag else f", runner {runner.get('backend')}")
    return [_row("MoE", backend, kernel, tuple(s for s in sites if s), via)]


def _all_reduce_rows(ctx: Context) -> list[PlanPath]:
    step = ctx.steps.get("all_reduce") or {}
    if (row := _unobserved("all-reduce", step)) is not None:
        return [row]
    if int(step.get("tp") or 1) <= 1:
        return []
    chain: list[str] = []
    decided = [s for s in [step.get("dispatch_site")] if s]
    chosen = None
    if step.get("disable_custom_all_reduce"):
        chain.append("custom all-reduce is off (--disable-custom-all-reduce)")
    else:
        custom = step.get("custom") or {}
        if custom.get("disabled") is True:
            chain.append(f'custom all-reduce disables itself: "{custom.get("why")}" ({custom.get("site")})')
            decided.append(custom.get("site"))
        elif custom.get("disabled") is False:
            chosen = ("custom", _sgl_kernel(ctx, "common_ops", "sgl-kernel custom all-reduce"))
        else:
            note = custom.get("not_observed") or "its construction needs the GPUs"
            chain.append(f"custom all-reduce: not observed ({note})")
            chosen = ("custom or nccl", _Kernel((), Verdict.NOT_OBSERVED, "which one runs needs the GPUs to decide"))
    symm = ctx.features.get("torch_symm_mem_allreduce") or {}
    if chosen is None and step.get("enable_torch_symm_mem"):
        state = symm.get("state")
        if state == "crashes":
            chosen = ("torch_symm_mem", _Kernel(("torch symmetric memory",), Verdict.MISSING, symm.get("reason", "")))
        elif state == "available" and ctx.interconnect == "pcie":
            chain.append(f"torch symm-mem is enabled but disables itself at run time on PCIe: {symm.get('reason')}")
        elif state == "available":
            chosen = ("torch_symm_mem", _torch(ctx, "torch symmetric-memory all-reduce"))
        else:
            chain.append(f"torch symm-mem is enabled but {state}: {symm.get('reason')}")
    elif chosen is None:
        chain.append(
            f"torch symm-mem is off (--enable-torch-symm-mem not given; bwstack features: {symm.get('state')})"
        )
    if chosen is None and step.get("enable_mscclpp"):
        chosen = ("mscclpp", _Kernel(("mscclpp",), Verdict.NOT_OBSERVED, "MSCCL++ needs the GPUs to decide"))
    if chosen is None:
        nccl = _library(ctx.kernels.get("nccl"), "NCCL")
        found = step.get("nccl_library")
        chosen = ("nccl", replace(nccl, why=f"PyNccl ({found or 'libnccl.so.2'}): {nccl.why}"))
    fusion = ctx.features.get("flashinfer_allreduce_fusion") or {}
    if step.get("enable_flashinfer_allreduce_fusion"):
        chain.append(f"FlashInfer all-reduce fusion is requested: {fusion.get('state')}: {fusion.get('reason')}")
    backend, kernel = chosen
    why = "; ".join(chain) + ("; " if chain else "") + f"so all-reduce runs on {backend}: {kernel.why}"
    return [PlanPath("all-reduce", backend, kernel.kernels, kernel.verdict, why, tuple(s for s in decided if s),
                     kernel.jit_found)]  # fmt: skip


# ------------------------------------------------------------------------------------------------ catalogue


def _with_catalogue(ctx: Context, path: PlanPath, notes: list[str]) -> PlanPath:
    findings = ctx.catalogue.findings(path.component, path.backend, ctx.capability, ctx.versions)
    ids, verdict, why = [], path.verdict, path.why
    for finding in findings:
        issue = finding.issue
        if finding.applies is Applies.YES:
            ids.append(issue.id)
            new = Verdict.KNOWN_WRONG if issue.kind is Kind.WRONG_RESULTS else Verdict.MISSING
            if verdict is not Verdict.MISSING:
                verdict = new
            why = f"{why}; known issue {issue.id} ({finding.detail}): {issue.symptom} [{', '.join(issue.sources)}]"
        elif finding.applies is Applies.NOT_CATALOGUED:
            notes.append(
                f"{path.component} {path.backend}: known issue {issue.id} is not catalogued for {finding.detail} "
                f"(it names {', '.join(f'{k} {v}' for k, v in issue.affects.items())}): no verdict from it"
            )
        elif finding.applies is Applies.FIXED:
            notes.append(f"{path.component} {path.backend}: {issue.id} is fixed in {finding.detail}")
    if not ids:
        return path
    return replace(path, verdict=verdict, why=why, catalogue=tuple(ids))


# ------------------------------------------------------------------------------------------------ plan


def describe_device(device: Mapping, real: Mapping | None = None) -> str:
    if device.get("mode") == "real":
        real = real or {}
        return f"real {real.get('name', device.get('name'))} x{real.get('count', device.get('count'))}"
    return (
        f"simulated {device['name']} x{device['count']} ({device['memory_mib'] // 1024} GiB each, "
        f"{device['interconnect']})"
    )


def plan_for(observation: Mapping, index: int, catalogue: Catalogue, label: str | None = None) -> Plan:
    """The plan of the index-th request of a node observation (Observation.as_dict())."""
    device = observation["device"]
    request = observation["requests"][index]
    inenv = observation.get("inenv") or {}
    versions = dict(inenv.get("versions") or (observation.get("features") or {}).get("packages") or {})
    model = label or request.get("model", "?")
    base = {
        "sglang": versions.get("sglang"),
        "capability": device["capability"],
        "device": describe_device(device, inenv.get("real_device")),
        "model": model,
        "draft": request.get("draft"),
        "request": {k: v for k, v in request.items() if k not in ("id",)},
        "packages": versions,
    }
    error = observation.get("error") or inenv.get("error")
    found = inenv.get("observations") or []
    if error or index >= len(found):
        text = error or "the node returned no observation for this model"
        return Plan(server_args={}, decisions={}, paths=(), error=text, **base)
    obs = found[index]
    if obs.get("crashed"):
        return Plan(
            server_args={},
            decisions={},
            paths=(),
            error=f"observing SGLang failed: {_error_text(obs['crashed'])}",
            **base,
        )
    steps = obs.get("steps") or {}
    server = steps.get("server_args") or {}
    decisions = {name: _site(site) or "" for name, site in (server.get("sites") or {}).items()}
    notes = list(inenv.get("notes") or [])
    if inenv.get("sgl_kernel_error"):
        notes.append(f"sgl-kernel cannot load here: {_error_text(inenv['sgl_kernel_error'])}")
    ctx = Context(
        steps=steps,
        kernels=observation.get("kernels") or {},
        features=observation.get("features") or {},
        capability=device["capability"],
        interconnect=device.get("interconnect", "pcie"),
        versions=versions,
        catalogue=catalogue,
    )
    if not server.get("ok"):
        error = server.get("error") or {}
        kernel = _Kernel((), Verdict.MISSING, f"SGLang refuses to start: {_error_text(error)}")
        paths = [_row("server arguments", "-", kernel, tuple(filter(None, [error.get("site")])))]
        return Plan(server_args={}, decisions=decisions, paths=tuple(paths), notes=tuple(notes), **base)
    paths: list[PlanPath] = []
    quant = steps.get("quant_config") or {}
    builders = [_attention_rows, _draft_rows, _sampling_rows, _linear_rows, _moe_rows, _all_reduce_rows]
    if quant.get("error"):
        error = quant["error"]
        kernel = _Kernel((), Verdict.MISSING, f"SGLang refuses the quantization: {_error_text(error)}")
        where = tuple(filter(None, [error.get("site"), quant.get("check_site")]))
        paths.append(_row("quantization", str((steps.get("model") or {}).get("quantization")), kernel, where))
        builders = [b for b in builders if b not in (_linear_rows, _moe_rows)]  # the model never gets that far
    for rows in builders:
        paths.extend(rows(ctx))
    paths = [_with_catalogue(ctx, p, notes) for p in paths]
    for name, error in ((steps.get("scheduler_init") or {}).get("errors") or {}).items():
        notes.append(f"{name} failed: {_error_text(error)}")
    return Plan(
        server_args=dict(server.get("values") or {}),
        decisions=decisions,
        paths=tuple(paths),
        notes=tuple(dict.fromkeys(notes)),
        **base,
    )


def plans(observation: Mapping, catalogue: Catalogue) -> list[Plan]:
    return [plan_for(observation, i, catalogue) for i in range(len(observation.get("requests") or []))]


# ------------------------------------------------------------------------------------------------ fixes

Runner = Callable[[list[dict]], Mapping]  # requests -> a node observation of them


@dataclass(frozen=True)
class _Candidate:
    flags: tuple[str, ...]
    server_args: Mapping[str, object]
    env: Mapping[str, str]
    why: str


def _candidates(plan: Plan, catalogue: Catalogue) -> list[tuple[str, _Candidate]]:
    out: list[tuple[str, _Candidate]] = []
    for path in plan.failing:
        for issue_id in path.catalogue:
            issue = next(i for i in catalogue.issues if i.id == issue_id)
            if issue.avoid and issue.avoid.env:
                why = f"avoids {issue_id}: {issue.avoid.note or issue.title}"
                out.append((path.component, _Candidate((), {}, issue.avoid.env, why)))
        for remedy in catalogue.remedies_for(path.component, path.backend):
            if remedy.server_args and all(plan.server_args.get(k) == v for k, v in remedy.server_args.items()):
                continue  # already what the plan runs
            out.append((path.component, _Candidate(remedy.flags, remedy.server_args, remedy.env, remedy.why)))
    seen, unique = set(), []
    for component, cand in out:
        key = (component, cand.flags, tuple(sorted(cand.env.items())))
        if key not in seen:
            seen.add(key)
            unique.append((component, cand))
    return unique


def speculation(catalogue: Catalogue) -> list[list[dict]]:
    """The server-argument changes a fix search may ask the node to plan, by component in the catalogue's order:
    a planner with nothing remembered plans them beside the model (node: speculated requests), so that a fix
    search finds its plans there instead of starting SGLang again. Changes of the environment are left out (they
    need an interpreter of their own), and so are remedies for one backend (which backend a path has is known
    only here, after the plan). Only which requests are planned early follows from this; which ones a fix search
    asks for, and what it keeps, is still find_fix's."""
    groups: dict[str, list[dict]] = {}
    for remedy in catalogue.remedies:
        if remedy.server_args and not remedy.env and remedy.backend == "*":
            group = groups.setdefault(remedy.component, [])
            if dict(remedy.server_args) not in group:
                group.append(dict(remedy.server_args))
    return list(groups.values())


def _first_per_component(candidates: list[tuple[str, _Candidate]]) -> list[_Candidate]:
    firsts: dict[str, _Candidate] = {}
    for component, cand in candidates:
        firsts.setdefault(component, cand)
    return list(firsts.values())


def _apply(request: Mapping, cands: list[_Candidate]) -> dict:
    new = {k: v for k, v in request.items()}
    args = dict(new.get("server_args") or {})
    env = dict(new.get("env") or {})
    for cand in cands:
        args.update(cand.server_args)
        env.update(cand.env)
    new["server_args"], new["env"] = args, env
    return new


def already_planned(observation: Mapping, requests: list[dict]) -> dict | None:
    """The observation of exactly these requests when the node planned each of them already in `observation`
    (a verify probe plans what the last fix search of the same job asked for beside the job itself): the same
    device, kernel facts and interpreter run. None when one of them was not planned there."""
    inenv = observation.get("inenv") or {}
    asked = [{k: v for k, v in r.items() if k != "id"} for r in observation.get("requests") or []]
    found = inenv.get("observations") or []
    if observation.get("error") or inenv.get("error") or len(found) != len(asked):
        return None
    picks = []
    for request in requests:
        wanted = {k: v for k, v in request.items() if k != "id"}
        if wanted not in asked:
            return None
        picks.append(asked.index(wanted))
    return {
        **observation,
        "requests": [observation["requests"][i] for i in picks],
        "inenv": {**inenv, "observations": [found[i] for i in picks]},
    }


def find_fix(plan: Plan, request: Mapping, catalogue: Catalogue, run: Runner) -> Fix | None:
    """Flags and env that take the failing paths onto paths that run, found by planning again with them (SGLang's
    own code decides what each change leads to). None when nothing fails."""
    if plan.ok or plan.error:
        return None
    candidates = _candidates(plan, catalogue)
    failing = {p.component for p in plan.failing}
    if not candidates:
        return Fix((), {}, {}, (), False, tuple(sorted(failing)))
    batch = [_apply(request, [c]) for _, c in candidates]
    # The likely answer (each failing component's first candidate, together) is planned in the same batch when it
    # needs no interpreter of its own (same environment as a candidate): SGLang's imports cost an interpreter
    # seconds, one more plan in it well under one. Which changes are kept is still decided below.
    firsts = _first_per_component(candidates)
    likely = _apply(request, firsts)
    if len(firsts) > 1 and any(r["env"] == likely["env"] for r in batch):
        batch.append(likely)
    tried = run(batch)
    passing_before = {p.component for p in plan.paths if not p.fails}
    chosen: list[_Candidate] = []
    rejected: list[str] = []
    fixed: set[str] = set()
    for i, (component, cand) in enumerate(candidates):
        if component in fixed:
            continue
        attempt = plan_for(tried, i, catalogue)
        still = {p.component for p in attempt.failing}
        if attempt.error or component in still or (still & passing_before):
            rejected.append(f"{_describe(cand)}: {_outcome(attempt, component, still & passing_before)}")
            continue
        chosen.append(cand)
        fixed |= failing - still
    if not chosen:
        return Fix((), {}, {}, (), False, tuple(sorted(failing)), rejected=tuple(rejected))
    wanted = _apply(request, chosen)
    # The same request planned in the batch is the same plan: observe() builds every request's ServerArgs afresh in
    # the interpreter (the candidates were always judged that way; re-recording the fixtures gave final plans equal
    # in paths, verdicts, decision sites and arguments to the separately made ones of the recording before).
    planned = next((i for i, r in enumerate(batch) if r == wanted), None)
    final = plan_for(tried, planned, catalogue) if planned is not None else plan_for(run([wanted]), 0, catalogue)
    flags = tuple(f for c in chosen for f in c.flags)
    env = {k: v for c in chosen for k, v in c.env.items()}
    args = {k: v for c in chosen for k, v in c.server_args.items()}
    remaining = tuple(sorted({p.component for p in final.failing})) if not final.error else ("(plan failed)",)
    reasons = tuple(c.why for c in chosen)
    fixes = not remaining and not final.error
    return Fix(flags, env, args, reasons, fixes, remaining, final.paths, tuple(rejected))


def _describe(cand: _Candidate) -> str:
    return " ".join([*cand.flags, *(f"{k}={v}" for k, v in cand.env.items())])


def _outcome(attempt: Plan, component: str, broken: set[str]) -> str:
    """What a rejected change led to, in the words of the plan SGLang made with it."""
    if attempt.error:
        return f"no plan ({attempt.error[:200]})"
    rows = [p for p in attempt.paths if p.fails and (p.component == component or p.component in broken)]
    return "; ".join(f"{p.component} becomes {p.backend}, {p.verdict.value}" for p in rows) or "no change"
