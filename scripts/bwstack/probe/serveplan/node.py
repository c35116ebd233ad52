"""Node side of serve-plan: run SGLang's own resolution in the env's interpreter and read the kernels its choices
need, from the env's files.

Standard library and bwstack's other node-side modules only: this module runs on target hosts inside
the probe zipapp. It decides nothing about SGLang: `inenv.py` observes SGLang's choices while they are made; this
module prepares the device (the real GPU, or the target simulated: torch.cuda/NVML answers installed by the
script, a stand-in `nvidia-smi` on PATH and, on a host without a driver, the probe's stand-in libcuda.so.1 so
sgl-kernel can load) and collects the kernel facts: fatbin coverage, cubin architectures, DeepGEMM's kernel
sources, nvcc and Triton's bundled ptxas tried for real.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

from bwstack.probe import elfscan, envinspect, fatbin, features, interp, sealed, treecheck
from bwstack.probe import main as probe
from bwstack.probe.serveplan import references

SCHEMA = 1
MARKER = "BWSTACK-SERVEPLAN "
SIMULATED = "simulated"
REAL = "real"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "SGLANG_USE_MODELSCOPE": "false"}


@dataclass(frozen=True)
class Device:
    """The GPU the plan is for: the real one on this host, or the target simulated."""

    mode: str  # "simulated" | "real"
    capability: str  # "12.0"
    count: int
    memory_mib: int
    name: str
    interconnect: str  # "pcie" | "nvlink"


class Request(TypedDict, total=False):
    id: str
    model: str  # a reference config name or an absolute path
    draft: str | None
    tp: int
    speculative_algorithm: str | None
    quantization: str | None
    attention_backend: str | None
    moe_runner_backend: str | None
    server_args: dict[str, object]  # further ServerArgs fields by name (how suggested fixes are tried)
    env: dict[str, str]


@dataclass
class Observation:
    """What the node reports for a batch of requests on one device (JSON: `as_dict`)."""

    device: Device
    requests: list[Request]
    inenv: dict = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)
    features: dict = field(default_factory=dict)
    error: str | None = None
    # What the env's interpreters loaded outside the env (sealed.loaded_changed's list; None: not known). Kept
    # with a recorded plan, never sent to the controller: it is the condition for reusing the plan.
    loaded: list | None = None

    def as_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "device": asdict(self.device),
            "requests": list(self.requests),
            "inenv": self.inenv,
            "kernels": self.kernels,
            "features": self.features,
            "error": self.error,
        }


# ------------------------------------------------------------------------------------------------ the run


def _script() -> bytes:
    return interp.script_source("serveplan").encode("utf-8")


def _model_path(value: str, models_dir: Path) -> str:
    if value in references.reference_names():
        return str(references.materialize(value, models_dir))
    return value


def _stand_in_smi(folder: Path, device: Device, python: str) -> None:
    """`nvidia-smi --query-gpu=...` answered for the simulated target (SGLang reads the memory from it)."""
    values = {
        "memory.total": str(device.memory_mib),
        "name": device.name,
        "compute_cap": device.capability,
        "driver_version": "simulated",
    }
    script = (
        f"#!{python}\n"
        "# bwstack serve-plan: a stand-in nvidia-smi for the SIMULATED target GPU (not a driver tool)\n"
        "import sys\n"
        f"VALUES = {json.dumps(values)}\n"
        f"COUNT = {int(device.count)}\n"
        "fields = next((a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith('--query-gpu=')), '')\n"
        "if not fields:\n"
        "    sys.exit(0)\n"
        "for index in range(COUNT):\n"
        "    row = [str(index) if f == 'index' else VALUES.get(f, '[N/A]') for f in fields.split(',')]\n"
        "    print(', '.join(row))\n"
    )
    path = folder / "nvidia-smi"
    path.write_text(script)
    path.chmod(0o755)


def _driver_present() -> bool:
    return any((Path(d) / "libcuda.so.1").exists() for d in elfscan.system_library_dirs())


def needs_stand_in(device: Device) -> bool:
    """Whether planning for this device loads the env's kernels against the stand-in libcuda.so.1: a simulated
    target on a host without an NVIDIA driver."""
    return device.mode == SIMULATED and not _driver_present()


def _child_env(base: dict[str, str], bin_dir: Path | None, stub_dir: Path | None) -> dict[str, str]:
    env = interp.clean_env(base=base)
    env.update(OFFLINE)
    if bin_dir is not None:
        env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
    if stub_dir is not None:
        env = interp.with_library_dir(env, stub_dir)
    return env


def _run_child(python: str, script: Path, job: dict, env: dict[str, str], cwd: str, timeout: int) -> dict:
    try:
        proc = subprocess.run(
            [python, "-I", str(script), json.dumps(job)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
        )
    except FileNotFoundError:
        return {"error": f"{python}: no such interpreter"}
    except subprocess.TimeoutExpired:
        return {"error": f"SGLang's resolution did not finish in {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    return {"error": f"the env's interpreter exited {proc.returncode} without a result: {tail[-1500:]}"}


def run_inenv(
    env: Path,
    device: Device,
    requests: list[Request],
    timeout: int = 1800,
    stand_in: probe.StandInLibcuda | None = None,
    speculate: list[list[dict]] | None = None,
) -> dict:
    """Run inenv.py in the env's interpreter for these requests; its JSON, or {"error": ...}.

    Requests with different environments run in different interpreters: SGLang reads most of its environment
    variables when its modules are imported, so a variable set later would change nothing. `speculate`: the
    server-argument changes each request is also planned with (speculation_groups); those requests and their
    observations follow the given ones ("speculated_requests")."""
    python = str(Path(env) / "bin" / "python")
    sp = envinspect.site_packages(Path(env))
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bwstack-serveplan-"))
        if stand_in is None:  # run alone (a fix search's `serve-plan`): its own
            stand_in = stack.enter_context(probe.StandInLibcuda(sp))
        tmpdir = Path(tmp)
        jobs = []
        for request in requests:
            job = {k: v for k, v in request.items() if k not in ("model", "draft", "env")}
            job["model_path"] = _model_path(request["model"], tmpdir / "models")
            if request.get("draft"):
                job["draft_path"] = _model_path(request["draft"], tmpdir / "models")
            jobs.append(job)
        script = tmpdir / "inenv.py"
        script.write_bytes(_script())
        bin_dir = stub_dir = None
        notes = []
        if device.mode == SIMULATED:
            bin_dir = tmpdir / "bin"
            bin_dir.mkdir()
            _stand_in_smi(bin_dir, device, python)
            if needs_stand_in(device):
                stub_dir = stand_in.folder()
                if stub_dir is None:
                    notes.append("no stand-in libcuda.so.1 (no C compiler, or nothing here links libcuda)")
                else:
                    notes.append("no NVIDIA driver on this host: sgl-kernel loaded against a stand-in libcuda.so.1")
        # Its own temporary folder, removed with this run's: torch writes a module into a new folder of TMPDIR on
        # import, which the interpreter's skipped teardown (_leave) would leave in /tmp on every run.
        base_env = {**_child_env(dict(os.environ), bin_dir, stub_dir), "TMPDIR": interp.private_folder(tmpdir)}
        device_json = {"mode": device.mode, **{k: v for k, v in asdict(device).items() if k != "mode"}}
        # The env (its manifest covers it) and this run's own folders (gone when it ends) are not what a recorded
        # plan depends on.
        inside = sorted({str(env), os.path.realpath(env), tmp, os.path.realpath(tmp)} | _folders(stub_dir))
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(_env_key(request), []).append(index)
        meta: dict | None = None
        errors: list[str] = []
        loaded: list | None = []
        observations: list[dict | None] = [None] * len(jobs)
        speculated: list[dict] = []
        extra_observations: list[dict] = []
        for key, indexes in groups.items():
            extra = dict(json.loads(key))
            job = {"device": device_json, "requests": [jobs[i] for i in indexes], "inside": inside}
            if speculate:
                job["speculate"] = speculate
            result = _run_child(python, script, job, {**base_env, **extra}, tmp, timeout)
            found = result.pop("loaded", None)
            loaded = sealed.union_loaded(loaded, found if isinstance(found, list) else None)
            if result.get("error"):
                errors.append(result["error"])
                for i in indexes:
                    crashed = {"type": "EnvError", "message": result["error"], "site": None, "code": ""}
                    observations[i] = {"id": jobs[i].get("id"), "crashed": crashed, "steps": {}}
                continue
            meta = meta or result
            for i, observation in zip(indexes, result.get("observations", []), strict=False):
                observation["model_path"] = jobs[i]["model_path"]
                observation["env"] = extra
                observations[i] = observation
            for entry in result.pop("speculated", None) or []:
                of, args = entry.get("of"), entry.get("server_args")
                if not (isinstance(of, int) and 0 <= of < len(indexes) and _scalar_args(args)):
                    continue
                i = indexes[of]
                asked = _normal(dict(requests[i]))  # as a fix search builds it: the given request, changed
                asked["server_args"] = {**asked["server_args"], **args}
                observation = entry.get("observation") if isinstance(entry.get("observation"), dict) else {}
                observation.update(
                    id=f"{SPECULATED_PREFIX}{len(speculated)}", model_path=jobs[i]["model_path"], env=extra
                )
                speculated.append({**asked, "id": observation["id"]})
                extra_observations.append(observation)
        if meta is None:
            return {"error": errors[0] if errors else "no requests"}
        meta["observations"] = [*observations, *extra_observations]
        meta["speculated_requests"] = speculated
        meta["notes"] = notes
        meta["loaded"] = loaded
        return meta


def _folders(path: Path | None) -> set[str]:
    return {str(path), os.path.realpath(path)} if path is not None else set()


# ------------------------------------------------------------------------------------------------ kernels


def _coverage(path: Path, capability: str) -> dict:
    found = fatbin.coverage(path, capability)
    if "error" in found:
        return found
    summary = found["summary"]
    return {
        "path": found["path"],
        "covers": found["covers"],
        "reason": found["reason"],
        "cubins": summary["cubins"],
        "ptx": summary["ptx"],
        "relocatable": summary["relocatable"],
    }


def _first(paths: list[Path]) -> Path | None:
    paths = [p for p in paths if p.is_file() and not p.is_symlink()] or [p for p in paths if p.is_file()]
    return sorted(paths)[0] if paths else None


def _cubin_categories(sp: Path) -> dict:
    """flashinfer-cubin's prebuilt kernels by family (fmha = TRT-LLM attention, batched_gemm = TRT-LLM MoE, ...)
    with the SM architectures of their cubins (ELF e_flags)."""
    root = sp / "flashinfer_cubin" / "cubins"
    out: dict[str, dict] = {}
    if not root.is_dir():
        return out
    for path in root.rglob("*.cubin"):
        parts = path.relative_to(root).parts
        if len(parts) < 3:
            continue
        family = re.sub(r"-[0-9a-f]+(-[0-9a-f]+)*$", "", parts[1])
        arch = probe._cubin_arch(path) or "unknown"
        entry = out.setdefault(family, {"cubins": 0, "archs": {}})
        entry["cubins"] += 1
        entry["archs"][arch] = entry["archs"].get(arch, 0) + 1
    for entry in out.values():
        entry["archs"] = dict(sorted(entry["archs"].items()))
    return out


# FlashInfer's own architecture checks in front of its prebuilt TRT-LLM kernels: the start-up error they give.
GUARDS = {
    "fmha": ("include/flashinfer/trtllm/fmha/fmhaRunner.cuh", r"Unsupported architecture"),
    "batched_gemm": ("csrc/trtllm_fused_moe_kernel_launcher.cu", r"ICHECK_EQ\(major, 10\)"),
}


def _flashinfer_guards(sp: Path) -> dict:
    out = {}
    for family, (rel, pattern) in GUARDS.items():
        path = sp / "flashinfer" / "data" / rel
        text = treecheck.read_text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if re.search(pattern, line):
                out[family] = {"site": f"{path.relative_to(sp)}:{number}", "code": line.strip()[:240]}
                break
    return out


def _deep_gemm(sp: Path) -> dict | None:
    impls = sp / "deep_gemm" / "include" / "deep_gemm" / "impls"
    if not impls.is_dir():
        return None
    archs = sorted({int(m.group(1)) for p in impls.glob("sm*_*.cuh") if (m := re.match(r"sm(\d+)_", p.name))})
    return {"impls": str(impls.relative_to(sp)), "archs": [f"sm_{a}" for a in archs]}


def _triton_kernels(sp: Path) -> dict | None:
    target = sp / "triton_kernels" / "target_info.py"
    text = treecheck.read_text(target)
    if text is None:
        return None
    match = re.search(r"def has_tma_gather\(\):\s*\n\s*return cuda_capability_geq\((\d+),\s*(\d+)\)", text)
    if not match:
        return {"file": str(target.relative_to(sp)), "tma_gather_from": None}
    line = text[: match.start()].count("\n") + 1
    return {
        "file": str(target.relative_to(sp)),
        "tma_gather_from": f"{match.group(1)}.{match.group(2)}",
        "site": f"{target.relative_to(sp)}:{line}",
    }


PTX_KERNEL = """.version 8.7
.target {arch}
.address_size 64
.visible .entry k(.param .u64 p)
{{
    ret;
}}
"""
PTX_GATHER4 = """.version 8.7
.target {arch}
.address_size 64
.visible .entry k(.param .u64 tmap, .param .u32 c0)
{{
    .reg .b64 %rd<2>;
    .reg .b32 %r<4>;
    .shared .align 128 .b8 smem[4096];
    .shared .align 8 .b64 bar;
    ld.param.u64 %rd1, [tmap];
    ld.param.u32 %r1, [c0];
    mov.u32 %r2, smem;
    mov.u32 %r3, bar;
    cp.async.bulk.tensor.2d.shared::cluster.global.tile::gather4.mbarrier::complete_tx::bytes
        [%r2], [%rd1, {{%r1, %r1, %r1, %r1, %r1}}], [%r3];
    ret;
}}
"""


def _ptxas_try(ptxas: Path, source: str, arch: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bwstack-ptxas-") as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(source.format(arch=arch))
        code, out, err = probe._run([str(ptxas), f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.o")])
    message = " ".join((err or out).replace(str(src), "k.ptx").split())
    return {"ok": code == 0, "error": message[:400] if code else ""}


def _triton(sp: Path, capability: str) -> dict | None:
    ptxas = sp / "triton" / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        return None
    override = os.environ.get("TRITON_PTXAS_PATH")
    _, out, _ = probe._run([str(ptxas), "--version"])
    match = re.search(r"release (\d+\.\d+), V([\d.]+)", out)
    major, minor = capability.split(".")
    arch = f"sm_{major}{minor}a"
    return {
        "ptxas": str(ptxas.relative_to(sp)),
        "version": match.group(2) if match else None,
        "override": override,
        "arch": arch,
        "compiles": _ptxas_try(ptxas, PTX_KERNEL, arch),
        "tile_gather4": _ptxas_try(ptxas, PTX_GATHER4, arch),
    }


def _jit_cache(sp: Path, capability: str) -> dict | None:
    root = sp / "flashinfer_jit_cache"
    if not root.is_dir():
        return None
    libs = probe._so_files(root)
    covering = [p for p in libs if _coverage(p, capability).get("covers")]
    return {"files": len(libs), "covering": len(covering)}


def _expected_ops(sgl: Path, capability: str) -> Path | None:
    """The common_ops sgl_kernel/__init__ loads: sm90/ on capability 9.0, sm100/ on any other."""
    return _first(list((sgl / ("sm90" if capability == "9.0" else "sm100")).glob("common_ops*.so")))


def file_kernel_facts(env: Path, capability: str, cuda: dict | None = None) -> dict:
    """What the env's files say about kernels for GPUs of `capability`, for every source a path can use. Read
    from the files alone, so that they can be read while the planner runs: sgl-kernel's common_ops is the one its
    __init__ picks for `capability` (with_loaded_ops puts the one the planner's interpreter loaded in its place)."""
    sp = envinspect.site_packages(Path(env))
    facts: dict = {"capability": capability}
    sgl = sp / "sgl_kernel"
    if sgl.is_dir():
        ops = _expected_ops(sgl, capability)
        facts["sgl_kernel"] = {
            "common_ops": _coverage(ops, capability) if ops else None,
            "flash_ops": _coverage(p, capability) if (p := _first(list(sgl.glob("flash_ops*.so")))) else None,
            "flashmla_ops": _coverage(p, capability) if (p := _first(list(sgl.glob("flashmla_ops*.so")))) else None,
        }
    facts["flashinfer_cubin"] = _cubin_categories(sp)
    facts["flashinfer_guards"] = _flashinfer_guards(sp)
    facts["flashinfer_jit_cache"] = _jit_cache(sp, capability)
    facts["deep_gemm"] = _deep_gemm(sp)
    facts["triton_kernels"] = _triton_kernels(sp)
    facts["triton"] = _triton(sp, capability)
    nvidia = sp / "nvidia"
    nccl = _first(list(nvidia.rglob("libnccl.so.2"))) if nvidia.is_dir() else None
    cublas = _first(list(nvidia.rglob("libcublasLt.so.*"))) if nvidia.is_dir() else None
    facts["nccl"] = _coverage(nccl, capability) if nccl else None
    facts["cublas"] = _coverage(cublas, capability) if cublas else None
    torch_cuda = sp / "torch" / "lib" / "libtorch_cuda.so"
    facts["torch"] = _coverage(torch_cuda, capability) if torch_cuda.is_file() else None
    facts["nvcc"] = cuda if cuda is not None else probe.cuda_facts(Path(env), capability)
    return facts


def with_loaded_ops(facts: dict, env: Path, capability: str, sgl_kernel_ops: str | None) -> dict:
    """file_kernel_facts() with the coverage of the common_ops the planner's interpreter loaded (`sgl_kernel_ops`;
    not known: the one sgl_kernel/__init__ picks, already there)."""
    if "sgl_kernel" not in facts or not sgl_kernel_ops:
        return facts
    if Path(sgl_kernel_ops) == _expected_ops(envinspect.site_packages(Path(env)) / "sgl_kernel", capability):
        return facts
    loaded = _coverage(Path(sgl_kernel_ops), capability)
    return {**facts, "sgl_kernel": {**facts["sgl_kernel"], "common_ops": loaded}}


# ------------------------------------------------------------------------------------------------ fix-search hints

HINTS_KEPT = 16  # requests remembered per job


def _asked_key(env: Path, job: dict) -> str | None:
    """Where the store's verify cache keeps what fix searches asked for after `job` on this generation."""
    return sealed.derived_key(env, "fix-search-asked", job)


def _env_key(request: dict) -> str:
    return json.dumps(sorted((request.get("env") or {}).items()))


def _without_id(request: dict) -> dict:
    return {k: v for k, v in request.items() if k != "id"}


def _normal(request: dict) -> dict:
    """A request as planned: no id, no server arguments and no environment are the empty ones."""
    return {**_without_id(request), "server_args": request.get("server_args") or {}, "env": request.get("env") or {}}


def _scalar_args(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and k.isidentifier() and (v is None or isinstance(v, (str, int, float, bool)))
        for k, v in value.items()
    )


def hinted_requests(env: Path, job: dict) -> list[Request]:
    """What a fix search asked this node to plan after the same job before, on this generation (remember_asked):
    planned beside the job's own requests, in the same interpreter, they answer that fix search without
    starting SGLang again when it asks the same (the controller matches requests exactly; anything else is
    planned as before). A hint is one of the job's own requests with other server arguments (what a fix search
    changes): anything else, and a request that would need an interpreter of its own (another environment), is
    left out."""
    hints = sealed.load_derived(env, _asked_key(env, job))
    if not isinstance(hints, list):
        return []
    base = [_normal(r) for r in job.get("requests") or [] if isinstance(r, dict)]
    shapes = [({k: v for k, v in r.items() if k not in ("server_args", "env")}, _env_key(r)) for r in base]
    seen = list(base)
    out: list[Request] = []
    for index, hint in enumerate(hints):
        if not (isinstance(hint, dict) and _scalar_args(hint.get("server_args") or {})):
            continue
        if not isinstance(hint.get("env") or {}, dict):
            continue
        plain = _normal(hint)
        shape = ({k: v for k, v in plain.items() if k not in ("server_args", "env")}, _env_key(plain))
        if shape in shapes and plain not in seen:
            seen.append(plain)
            out.append({**_without_id(hint), "id": f"hint-{index}"})  # type: ignore[typeddict-item]
    return out


SPECULATED_PREFIX = "speculated-"  # the id of a request planned early (the controller's remember call looks for it)
SPECULATION_GROUPS_MAX = 16
SPECULATION_CHANGES_MAX = 8


def speculation_groups(value: object) -> list[list[dict]] | None:
    """A job's `speculate` (the controller's assemble.speculation: server-argument changes by component) when it
    has that shape and size, else None: nothing is planned early."""
    if not (isinstance(value, list) and 0 < len(value) <= SPECULATION_GROUPS_MAX):
        return None
    for group in value:
        if not (isinstance(group, list) and 0 < len(group) <= SPECULATION_CHANGES_MAX):
            return None
        if not all(_scalar_args(change) and change for change in group):
            return None
    return value


def forget_asked(env: Path, job: dict) -> None:
    sealed.save_derived(env, _asked_key(env, job), [])


def observe_job(
    env: Path,
    device: Device,
    job: dict,
    *,
    cuda: dict | None = None,
    stand_in: probe.StandInLibcuda | None = None,
) -> Observation:
    """The job's own requests planned, with the hints beside them (hinted_requests). When planning with the
    hints fails for the job's own requests (an interpreter that crashed or timed out takes every request of it
    along), they are forgotten and the job is planned again without them: a hint never changes a verdict."""
    requests = list(job["requests"])
    hints = hinted_requests(env, job)
    if hints:
        observed = observe(env, device, [*requests, *hints], cuda=cuda, stand_in=stand_in)
        if _planned_own(observed, len(requests)):
            return observed
        forget_asked(env, job)
    # Nothing remembered: what a fix search may ask for is planned beside the job, in the same interpreter.
    speculate = speculation_groups(job.get("speculate"))
    return observe_speculating(env, device, requests, speculate, cuda=cuda, stand_in=stand_in)


def _planned_own(observed: Observation, own: int) -> bool:
    """Whether a run with more requests beside the given ones planned those: an interpreter that crashed, hung
    or ran out of time takes every request of it along."""
    found = (observed.inenv or {}).get("observations") or []
    mine = found[:own]
    failed = any(((o or {}).get("crashed") or {}).get("type") == "EnvError" for o in mine)
    return not observed.error and len(mine) == own and not failed


def observe_speculating(
    env: Path,
    device: Device,
    requests: list[Request],
    speculate: list[list[dict]] | None,
    *,
    cuda: dict | None = None,
    stand_in: probe.StandInLibcuda | None = None,
) -> Observation:
    """observe() with `speculate`'s requests planned beside the given ones; when that run fails for the given
    ones, they are planned again without: what is planned early never changes a verdict."""
    if speculate:
        observed = observe(env, device, requests, cuda=cuda, stand_in=stand_in, speculate=speculate)
        if _planned_own(observed, len(requests)):
            return observed
    return observe(env, device, requests, cuda=cuda, stand_in=stand_in)


def plan_key(env: Path | None, job: dict, gpu: object, cuda: object, base: list | None = None) -> str | None:
    """Where the store's verify cache keeps a verify probe's plan of `job` (its own requests and the hints beside
    them) on this generation, host, GPUs and CUDA toolkit, and the files of the model folders it names."""
    return sealed.derived_key(env, "serve-plan", job, gpu, cuda, model_folders(job), base=base)


def model_folders(job: dict, environ: Mapping[str, str] | None = None) -> list:
    """The model folders a job's models are read from, each with the stat of every entry in it: SGLang plans from
    their config files, which whoever owns the folder can change. A plan recorded before such a change is not
    the folder's plan any more. A model or draft given as /path is that folder; one given by its hub id is read
    offline from the HF cache (the planner runs with HF_HUB_OFFLINE) that the planner's environment names: this
    process's, with the request's own `env` over it. (The planner runs in a new private folder, so a relative
    name finds nothing there.) The bundled reference models are the probe's own files."""
    out: list = []
    references_ = references.reference_names()
    base = dict(os.environ if environ is None else environ)
    for request in job.get("requests") or []:
        if not isinstance(request, dict):
            continue
        extra = request.get("env") if isinstance(request.get("env"), dict) else {}
        seen = {**base, **{str(k): str(v) for k, v in extra.items()}}
        for key in ("model", "draft"):
            value = request.get(key)
            if not isinstance(value, str) or not value or value in references_:
                continue
            if value.startswith("/"):
                out.append([value, _folder_stamp(value)])
            else:
                for cached in hub_cache_folders(value, seen):
                    out.append([value, str(cached), _folder_stamp(str(cached))])
    return out


def hub_cache_folders(repo_id: str, environ: Mapping[str, str]) -> list[Path]:
    """Where a model repository is read from offline, by the rules of the env's huggingface_hub (constants.py) and
    transformers (utils/hub.py), which the planner loads: huggingface_hub's cache is HF_HUB_CACHE, else
    HUGGINGFACE_HUB_CACHE, else <HF_HOME>/hub, HF_HOME being <XDG_CACHE_HOME or ~/.cache>/huggingface (a variable
    set empty counts as set; HF_HOME and HF_HUB_CACHE have ~ and $VARS expanded); transformers reads configs from
    TRANSFORMERS_CACHE, else PYTORCH_TRANSFORMERS_CACHE, else PYTORCH_PRETRAINED_BERT_CACHE, else the hub's. The
    repository's folder in either is models--<org>--<name>."""

    def expanded(value: str) -> str:  # os.path.expandvars(os.path.expanduser(value)), in the planner's environment
        home = environ.get("HOME") or os.path.expanduser("~")
        value = home + value[1:] if value == "~" or value.startswith("~/") else value
        return re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: environ.get(m[1] or m[2], m[0]), value)

    default_home = os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    hf_home = expanded(environ.get("HF_HOME", os.path.join(environ.get("XDG_CACHE_HOME", default_home), "huggingface")))
    hub = expanded(environ.get("HF_HUB_CACHE", environ.get("HUGGINGFACE_HUB_CACHE", os.path.join(hf_home, "hub"))))
    transformers = environ.get(
        "TRANSFORMERS_CACHE",
        environ.get("PYTORCH_TRANSFORMERS_CACHE", environ.get("PYTORCH_PRETRAINED_BERT_CACHE", hub)),
    )
    folder = "models--" + repo_id.replace("/", "--")
    return [Path(root) / folder for root in dict.fromkeys([transformers, hub])]


FOLDER_STAMP_MAX = 20_000  # entries: a model folder holds configs and shards, not a tree of this size


def _folder_stamp(path: str) -> list:
    """Every entry under the folder (its subfolders too), with its stat and, for a link, the stat of what it
    leads to: the HF cache keeps `config.json` as a link into `blobs/`, rewritten there."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return [f"unreadable: {exc.strerror}"]
    entries: list = [[".", st.st_mode, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]]
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                st = os.lstat(full)
                entry = [os.path.relpath(full, path), st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
                if stat.S_ISLNK(st.st_mode):
                    entry.append(os.readlink(full))
                    try:
                        to = os.stat(full)
                        entry += [to.st_ino, to.st_size, to.st_mtime_ns, to.st_ctime_ns]
                    except OSError:
                        entry.append("dangling")
                entries.append(entry)
            if len(entries) > FOLDER_STAMP_MAX:
                return [*entries, "cut"]
    return entries


@dataclass(frozen=True)
class Recorded:
    """A plan kept in the store's verify cache: `plan` as the controller gets it and what its interpreters
    loaded, when all of that is as it was; else `plan` is None and `moved` says what moved."""

    plan: dict | None
    loaded: list | None = None
    moved: str | None = None


def recorded_plan(env: Path, key: str | None) -> Recorded:
    """The plan recorded under `key`, reusable only while everything its interpreters loaded outside the env is
    as it was (sealed.loaded_changed), as the import checks' outcome is."""
    doc = sealed.load_derived(env, key)
    if not isinstance(doc, dict):
        return Recorded(None)
    moved = sealed.loaded_changed(doc.get("loaded"), "SGLang's planner")
    if moved is not None:
        return Recorded(None, moved=moved)
    return Recorded({k: v for k, v in doc.items() if k != "loaded"}, doc["loaded"])


def record_plan(env: Path, key: str | None, observed: Observation) -> dict:
    """Keep a plan with what its interpreters loaded (recorded_plan checks it); the plan as the controller gets
    it."""
    plan = observed.as_dict()
    sealed.save_derived(env, key, {**plan, "loaded": observed.loaded})
    return plan


def _beside_observations(inenv: dict) -> dict:
    return {k: v for k, v in inenv.items() if k != "observations"}


def _pairs(doc: dict, inenv: dict) -> tuple[list, list] | None:
    requests, found = doc.get("requests"), inenv.get("observations")
    if not isinstance(requests, list) or not isinstance(found, list) or len(requests) != len(found):
        return None
    return list(requests), list(found)


def fold_into(recorded: object, answer: object, own: int) -> dict | None:
    """The recorded plan of a job (`own` requests of its own) with a fix search's answer on the same generation
    added to it (requests and observations it does not hold yet), so that the next verify's fix search finds
    them there and asks nothing. None when the two cannot be one observation: either failed or is malformed, or
    they differ in anything but the requests (device, kernel and feature facts, SGLang's versions and view of
    the device), or the plan would hold more than HINTS_KEPT requests beyond the job's own."""
    if not isinstance(recorded, dict) or not isinstance(answer, dict) or recorded.get("error") or answer.get("error"):
        return None
    inenv, more = recorded.get("inenv"), answer.get("inenv")
    if not isinstance(inenv, dict) or not isinstance(more, dict) or inenv.get("error") or more.get("error"):
        return None
    outer = ("schema", "device", "kernels", "features")
    if any(recorded.get(k) != answer.get(k) for k in outer):
        return None
    if _beside_observations(inenv) != _beside_observations(more):
        return None
    held_pairs, new_pairs = _pairs(recorded, inenv), _pairs(answer, more)
    if held_pairs is None or new_pairs is None:
        return None
    requests, found = held_pairs
    held = [_without_id(r) for r in requests if isinstance(r, dict)]
    for request, observed in zip(*new_pairs, strict=True):
        if isinstance(request, dict) and _without_id(request) not in held:
            held.append(_without_id(request))
            requests.append(request)
            found.append(observed)
    if len(requests) > own + HINTS_KEPT:
        return None
    # Both interpreters' loaded files: the folded plan holds only while what either loaded is as it was.
    loaded = sealed.union_loaded(_loaded_list(recorded), _loaded_list(answer))
    return {**recorded, "requests": requests, "inenv": {**inenv, "observations": found}, "loaded": loaded}


def keep_asked(recorded: object, asked: list, own: int) -> dict | None:
    """The recorded plan of a job with its `own` requests, those planned beside them as hints, and of those it
    planned early (speculated) only the ones a fix search asked for (`asked`, what the node remembers), renamed
    as asked. None when the plan is malformed or holds nothing planned early."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("inenv"), dict):
        return None
    pairs = _pairs(recorded, recorded["inenv"])
    if pairs is None or not any(_speculated(r) for r in pairs[0]):
        return None
    wanted = [_normal(r) for r in asked if isinstance(r, dict)]
    requests, found = [], []
    for index, (request, observed) in enumerate(zip(*pairs, strict=True)):
        if index >= own and _speculated(request):
            if _normal(request) not in wanted:
                continue
            request = {**request, "id": f"asked-{len(requests)}"}
        requests.append(request)
        found.append(observed)
    return {**recorded, "requests": requests, "inenv": {**recorded["inenv"], "observations": found}}


def _speculated(request: object) -> bool:
    return isinstance(request, dict) and str(request.get("id", "")).startswith(SPECULATED_PREFIX)


def recorded_plan_for(env: Path, key: str | None, job: dict) -> Recorded:
    """recorded_plan(), less what it planned early (speculated) that no fix search asked for since (keep_asked),
    and recorded so: the plans made early serve the first verify's fix search; a later verify of the unchanged
    generation reads and sends only what fix searches use."""
    recorded = recorded_plan(env, key)
    kept = keep_asked(recorded.plan, sealed.load_derived(env, _asked_key(env, job)) or [], len(job["requests"]))
    if kept is None:
        return recorded
    sealed.save_derived(env, key, {**kept, "loaded": recorded.loaded})
    return Recorded(kept, recorded.loaded)


def _loaded_list(doc: dict) -> list | None:
    found = doc.get("loaded")
    return found if isinstance(found, list) else None


def remember_asked(env: Path, job: dict, requests: list[dict]) -> list[dict]:
    """Remember the requests a fix search asked for after `job` (best effort, the store's owner only); returns
    every request remembered for it now."""
    key = _asked_key(env, job)
    known = sealed.load_derived(env, key)
    known = [r for r in known if isinstance(r, dict)] if isinstance(known, list) else []
    for request in requests:
        if isinstance(request, dict) and _without_id(request) not in known:
            known.append(_without_id(request))
    sealed.save_derived(env, key, known[-HINTS_KEPT:])
    return known[-HINTS_KEPT:]


# ------------------------------------------------------------------------------------------------ entry


def observe(
    env: Path,
    device: Device,
    requests: list[Request],
    *,
    cuda: dict | None = None,
    stand_in: probe.StandInLibcuda | None = None,
    speculate: list[list[dict]] | None = None,
) -> Observation:
    """SGLang's choices for each request (one interpreter for all of them) and the env's kernel facts.
    `speculate` (speculation_groups): each request is also planned with those changes, in the same interpreter;
    those requests follow the given ones in the observation."""
    env = Path(env)
    result = Observation(device=device, requests=list(requests))
    if not (env / "bin" / "python").exists():
        result.error = f"no env at {env}: no bin/python"
        return result
    sp = envinspect.site_packages(env)
    # The env's files are read beside the planner's interpreter (seconds of SGLang's imports), not after it.
    with ThreadPoolExecutor(max_workers=1) as beside:
        files = beside.submit(interp.yielding, file_kernel_facts, env, device.capability, cuda)
        feats = beside.submit(interp.yielding, features.report, sp, device.capability)
        inenv = run_inenv(env, device, list(requests), stand_in=stand_in, speculate=speculate)
        result.requests.extend(inenv.pop("speculated_requests", None) or [])
        result.loaded = inenv.pop("loaded", None)
        result.inenv = inenv
        if inenv.get("error"):
            result.error = inenv["error"]
        result.kernels = with_loaded_ops(files.result(), env, device.capability, inenv.get("sgl_kernel_ops"))
        result.features = feats.result()
    return result


def resolve_device(spec: dict, env: Path) -> Device:
    """The device a job names: `real` (this host's GPU), `simulated` (the target described by spec) or `auto`
    (the real GPU when this host has the target's capability, the simulated target otherwise)."""
    mode = spec.get("mode", "auto")
    simulated = Device(
        SIMULATED, spec["capability"], int(spec["count"]), int(spec["memory_mib"]), spec["name"], spec["interconnect"]
    )
    if mode == SIMULATED:
        return simulated
    gpus = probe.gpu_facts()
    if mode == "auto" and not (gpus["present"] and {g["capability"] for g in gpus["gpus"]} == {spec["capability"]}):
        return simulated
    real = real_device(env, spec["interconnect"]) if gpus["present"] else None
    if real is None:
        if mode == REAL:
            raise RuntimeError(f"no GPU visible to the env's torch on this host: {gpus.get('reason')}")
        return simulated
    return real


def main(argv: list[str]) -> int:
    """`probe.pyz serve-plan --env ENV JOB_JSON`: the observation of a job, as one JSON line. A job
    {"remember": [requests], "hint_for": verify job} only records what a fix search asked for (remember_asked)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="bwstack-probe serve-plan")
    parser.add_argument("--env", required=True)
    parser.add_argument("job")
    args = parser.parse_args(argv)
    job = json.loads(args.job)
    env = Path(args.env)
    # A sealed generation that has not changed plans a job as it did before (sealed.py): reuse that result.
    # The verify run's first probe hands its basis (and its GPU and CUDA facts) on, so a fix search's runs
    # skip the walk; run alone, the generation is checked here.
    reuse = job.pop("reuse", None) or {}
    asked_after = job.pop("hint_for", None)  # the verify job whose fix search this is
    if "remember" in job:
        # A fix search answered by what the verify's probe planned early (speculated) asks nothing of SGLang here:
        # what it asked for is remembered as a fix search run here would have been, for the next verify's hints.
        asked = job["remember"]
        if isinstance(asked_after, dict) and isinstance(asked, list):
            remember_asked(env, asked_after, [r for r in asked[:HINTS_KEPT] if isinstance(r, dict)])
        sys.stdout.write("{}\n")
        return 0
    key, cuda, gpu, base = None, reuse.get("cuda"), reuse.get("gpu"), None
    if sealed.basis_still_holds(env, reuse.get("basis")) and cuda is not None:
        base = reuse["basis"]
        key = sealed.derived_key(None, "serve-plan-job", job, gpu, cuda, model_folders(job), base=base)
    elif sealed.unchanged_generation(env, host=False) is None:  # the key names the host as it is now
        cuda = probe.cuda_facts(env, str(job["device"].get("capability", "")), reuse=True)
        gpu = probe._gpu_key(probe.gpu_facts())
        key = sealed.derived_key(env, "serve-plan-job", job, gpu, cuda, model_folders(job))
    recorded = recorded_plan(env, key)
    result, loaded = recorded.plan, recorded.loaded
    if result is None:
        observed = observe(env, resolve_device(job["device"], env), job["requests"], cuda=cuda)
        if key is not None and sealed.unchanged_generation(env, host=False) is not None:
            # Changed since the basis was taken (handed on by the verify, or checked above): this plan is of
            # another tree than the sealed one its key names, so it is neither kept nor folded.
            key = None
        result, loaded = record_plan(env, key, observed), observed.loaded
    if isinstance(asked_after, dict):
        remembered = remember_asked(env, asked_after, job["requests"])
        if key is not None and loaded is not None:  # as sealed: the answer holds for the verify job's plan too
            job_key = plan_key(env, asked_after, gpu, cuda, base=base)  # base: the verify's own, when it gave one
            own = asked_after.get("requests")
            answer = {**result, "loaded": loaded}
            count = len(own) if isinstance(own, list) else 0
            held = sealed.load_derived(env, job_key)
            held = keep_asked(held, remembered, count) or held  # what was planned early and not asked: not kept
            folded = fold_into(held, answer, count)
            if folded is not None:
                sealed.save_derived(env, job_key, folded)
    sys.stdout.write(json.dumps(result, default=str) + "\n")
    return 0


def real_device(env: Path, interconnect: str) -> Device | None:
    """The first GPU of this host as torch in the env sees it (None without one)."""
    code = (
        "import json, torch\n"
        "if not torch.cuda.is_available(): print('{}')\n"
        "else:\n"
        "    p = torch.cuda.get_device_properties(0); c = torch.cuda.get_device_capability(0)\n"
        "    print(json.dumps({'capability': '%d.%d' % c, 'count': torch.cuda.device_count(),\n"
        "                      'memory_mib': p.total_memory // 2**20, 'name': torch.cuda.get_device_name(0)}))\n"
    )
    env_vars = interp.clean_env()
    rc, out, _ = interp.run([str(Path(env) / "bin" / "python"), "-I", "-c", code], env=env_vars)
    info = json.loads(out.strip().splitlines()[-1]) if rc == 0 and out.strip() else {}
    if not info:
        return None
    return Device(REAL, info["capability"], info["count"], info["memory_mib"], info["name"], interconnect)
