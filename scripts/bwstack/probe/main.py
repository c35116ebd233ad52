"""The verify probe: collects facts about a node's env and GPU, statically and by running small things.

Runs on the target host (shipped as a zipapp) with any Python 3.10+; only the standard library and bwstack's
other probe modules (envinspect, elfread, elfscan, fatbin, features, serveplan's node side). It prints one JSON
document; the checks in tests/infra judge it against the lock on the controller.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bwstack.probe import (
    elfread,
    elfscan,
    envinspect,
    fatbin,
    features,
    generation,
    interp,
    osrelease,
    pathtrust,
    schema,
    sealed,
    treecheck,
    waivers,
)

DRIVER_LIBS = {"libcuda.so.1", "libnvidia-ml.so.1"}
TORCH_NEEDED = re.compile(r"^lib(torch|c10)")
SKIP_TOP = {"torch", "nvidia", "triton", "cuda", "numpy", "scipy"}  # not torch extensions (or torch itself)


_run = interp.run


def default_env() -> Path:
    value = os.environ.get("BWSTACK_ML_ENV")
    if value:
        return Path(value)
    return Path("/opt/ml-env") if os.geteuid() == 0 else Path.home() / "ml-env"


# ------------------------------------------------------------------------------------------------ host/gpu


def host_facts() -> dict:
    os_release = osrelease.read()
    return {
        "hostname": socket.gethostname(),
        "os": os_release.get("PRETTY_NAME", platform.platform()),
        # what the lock's system_packages are chosen by (bwstack.lock.model.system_packages_for)
        "os_id": os_release.get("ID"),
        "os_version_id": os_release.get("VERSION_ID"),
        "glibc": platform.libc_ver()[1],
        "probe_python": platform.python_version(),
        "uid": os.geteuid(),
        "free_bytes": shutil.disk_usage("/").free,
    }


def gpu_facts() -> dict:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {"present": False, "reason": "nvidia-smi not found: no NVIDIA driver on this host", "gpus": []}
    code, out, err = _run(
        [smi, "--query-gpu=index,name,compute_cap,driver_version,memory.total", "--format=csv,noheader,nounits"]
    )
    if code != 0:
        return {"present": False, "reason": f"nvidia-smi failed: {(err or out).strip()[:300]}", "gpus": []}
    gpus = []
    driver = None
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 5:
            gpus.append({"index": int(parts[0]), "name": parts[1], "capability": parts[2], "memory_mib": parts[4]})
            driver = parts[3]
    return {"present": bool(gpus), "reason": "" if gpus else "nvidia-smi lists no GPU", "driver": driver, "gpus": gpus}


# ------------------------------------------------------------------------------------------------ env


def _torch_version_py(sp: Path) -> dict:
    text = treecheck.read_text(sp / "torch" / "version.py")
    if text is None:
        return {}
    found = dict(re.findall(r"^(__version__|cuda|git_version)\s*[:=].*?['\"]([^'\"]*)['\"]", text, re.M))
    cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*(None|['\"]([^'\"]*)['\"])", text, re.M)
    return {"version": found.get("__version__"), "cuda": cuda.group(2) if cuda and cuda.group(2) else None}


def _requires(dist: envinspect.Installed) -> list[str]:
    import email.parser

    text = treecheck.read_text(dist.dist_info / "METADATA") or ""
    message = email.parser.Parser().parsestr(text, headersonly=True)
    return [r.strip() for r in message.get_all("Requires-Dist") or []]


def installed_facts(env: Path) -> dict:
    return {
        name: {"version": d.version, "requires": _requires(d), "installer": d.installer}
        for name, d in envinspect.installed(env).items()
    }


def env_facts(env: Path, static: dict | None = None) -> dict:
    """The env's own facts; `static` (a sealed generation's recorded facts) replaces reading its files."""
    real = env.resolve()
    facts: dict = {"path": str(env), "real": str(real), "exists": env.exists()}
    if not env.exists():
        return facts
    sp = envinspect.site_packages(env)
    facts["site_packages"] = str(sp)
    facts["python"] = envinspect.env_python_version(env)
    facts["installed"] = static["installed"] if static else installed_facts(env)
    gen = generation.read(real.parent)
    if gen is not None:
        # Whether what the record says (its lock digest, its profile) is what was sealed with the generation.
        facts["generation"] = {**gen.as_dict(), "record_sealed": sealed.record_as_sealed(real.parent)}
    facts["torch_version_py"] = static["torch_version_py"] if static else _torch_version_py(sp)
    facts["store"] = store_facts(env)
    return facts


def store_facts(env: Path) -> dict:
    """The store the env belongs to and the waivers it remembers (what provisioning was told to waive)."""
    root = waivers.store_of_env(env)
    if root is None:
        return {"root": None, "waivers": []}
    try:
        remembered = waivers.load(root)
    except ValueError as exc:
        return {"root": str(root), "waivers": [], "waivers_error": str(exc)}
    return {"root": str(root), "waivers": [{"check": w.check, "reason": w.reason} for w in remembered]}


# ------------------------------------------------------------------------------------------------ CUDA


TOOLKIT_MAX_PATHS = 20_000  # NVIDIA's CUDA 13.0 wheels: 2,166 paths (0.03 s); /usr: 140,000 (0.4 s, a compile's worth)
COMPILE_SOURCE = "__global__ void k(float *x) { x[threadIdx.x] *= 2.0f; }\n"


def _compile_for(nvcc: str, arch: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bwstack-nvcc-") as tmp:
        src = Path(tmp, "k.cu")
        src.write_text(COMPILE_SOURCE)
        rc, out, err = _run([nvcc, f"-arch={arch}", "-cubin", "-o", str(Path(tmp, "k.cubin")), str(src)], timeout=300)
    return {"arch": arch, "ok": rc == 0, "error": (err or out).strip()[-600:] if rc else ""}


# What nvcc's run depends on besides the toolkit's own files: its settings from the environment (NVCC_*, and every
# variable its nvcc.profile adds to, such as INCLUDES and PTXAS_FLAGS), the search paths and settings it and the
# host compiler's preprocessor read, its temporary directory, and the host compilers it finds on PATH (or is
# pointed at). PATH itself is not part of it (verify puts a directory of its own on it each run): what PATH leads
# to is.
NVCC_ENVIRONMENT = (
    "INCLUDES", "SYSTEM_INCLUDES", "LIBRARIES", "CUDAFE_FLAGS", "PTXAS_FLAGS", "TMPDIR",
    "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "LD_LIBRARY_PATH",
    "GCC_EXEC_PREFIX", "COMPILER_PATH", "DEPENDENCIES_OUTPUT", "SUNPRO_DEPENDENCIES",
)  # fmt: skip
HOST_COMPILERS = ("gcc", "g++", "cc", "c++", "cpp")
_PROFILE_NAME = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\+?=", re.M)


def _profile_names(home: Path) -> set[str]:
    """The variables the toolkit's bin/nvcc.profile sets or adds to: nvcc takes each from the environment too."""
    return set(_PROFILE_NAME.findall(treecheck.read_text(home / "bin" / "nvcc.profile", 1 << 16) or ""))


def _program_key(label: str, value: str) -> list:
    """A host compiler as nvcc would start it: a bare name is looked up on PATH; a directory holds gcc and g++."""
    found = shutil.which(value) if "/" not in value else value
    if found is None:
        return [label, value, None]
    if os.path.isdir(found):
        return [label, value, *(_program_key(f"{label}/{n}", os.path.join(found, n)) for n in ("gcc", "g++"))]
    return [label, value, sealed.stat_key(found), sealed.stat_key(os.path.realpath(found))]


def _compile_inputs(nvcc: str, home: str) -> list | None:
    """What decides whether nvcc compiles, besides the generation and the host (sealed.basis): the toolkit's
    whole tree as nvcc reaches it (links followed, so a toolkit assembled from links elsewhere counts whole;
    inode changes included, so a file rewritten in place with its size and mtime kept counts too), the
    environment nvcc reads, and the host compilers it would start. None where that cannot be pinned down: nvcc
    that is not an ELF program (a wrapper starts whatever it names), a host compiler named in nvcc's own flags
    (NVCC_PREPEND_FLAGS, NVCC_APPEND_FLAGS), or a tree too large to stamp for less than a compile costs (a
    CUDA_HOME of /usr, a distribution's nvcc)."""
    try:
        with elfread.open_regular(Path(nvcc)) as handle:
            if handle.read(4) != b"\x7fELF":
                return None
    except (OSError, elfread.CorruptElf):
        return None
    flags = os.environ.get("NVCC_PREPEND_FLAGS", "") + " " + os.environ.get("NVCC_APPEND_FLAGS", "")
    if "ccbin" in flags or "compiler-bindir" in flags:
        return None
    try:
        root = Path(home).resolve()
    except (OSError, RuntimeError):  # a link loop
        return None
    method, stamp = sealed.tree_stamp(root, max_paths=TOOLKIT_MAX_PATHS, follow_links=True)
    if stamp == sealed.UNREADABLE:
        return None
    names = (set(NVCC_ENVIRONMENT) | _profile_names(root)) - {"PATH"}  # CUDA's nvcc.profile adds to PATH
    environment = sorted((k, v) for k, v in os.environ.items() if k.startswith("NVCC_") or k in names)
    compilers = [_program_key(name, name) for name in HOST_COMPILERS]
    ccbin = os.environ.get("NVCC_CCBIN")
    if ccbin:
        compilers.append(_program_key("NVCC_CCBIN", ccbin))
    return [nvcc, method, stamp, environment, compilers]


def compile_facts(env: Path, nvcc: str, home: str, arch: str, reuse: bool) -> tuple[dict, bool]:
    """(whether nvcc compiles a kernel for `arch`, whether that answer is an earlier run's). nvcc starts its
    host compiler, front end and assembler: half a second of every verify on a node with a toolkit. With `reuse`
    (a sealed generation found unchanged), a compile that succeeded is reused while the generation, the host
    (loader, system libraries) and everything _compile_inputs names are what they were; a failure is tried
    again each time."""
    inputs = _compile_inputs(nvcc, home) if reuse else None
    # One entry per generation and architecture, holding the inputs it was compiled with: a toolkit or setting
    # that changes often replaces it instead of crowding the imports and plans out of the cache.
    key = sealed.derived_key(env, "nvcc-compile", arch) if inputs is not None else None
    inputs = json.loads(json.dumps(inputs, default=str))  # as the cache gives it back
    known = sealed.load_derived(env, key)
    same = isinstance(known, dict) and (known.get("arch"), known.get("inputs")) == (arch, inputs)
    if same and known.get("ok") is True:
        return {"arch": arch, "ok": True, "error": ""}, True
    result = _compile_for(nvcc, arch)
    if result["ok"]:
        sealed.save_derived(env, key, {**result, "inputs": inputs})
    return result, False


def cuda_facts(env: Path, capability: str, reuse: bool = False, sources: dict | None = None) -> dict:
    """The CUDA toolkit as the env sees it (CUDA_HOME, nvcc) and whether its nvcc compiles for `capability`;
    `reuse`: see compile_facts. `sources` (the probe's facts_source) is told whether the compile ran now: not
    these facts, which key the serve-plan results and must read the same either way."""
    python = env / "bin" / "python"
    facts: dict = {}
    code = "import os, shutil; print(os.environ.get('CUDA_HOME') or ''); print(shutil.which('nvcc') or '')"
    rc, out, _err = _run([str(python), "-c", code], env=interp.clean_env())
    lines = ([*out.splitlines(), "", ""])[:2] if rc == 0 else ["", ""]
    facts["cuda_home_env"] = lines[0] or None
    facts["nvcc_on_path"] = lines[1] or None
    nvcc_found = _resolved(lines[1]) if lines[1] else None
    home = lines[0] or (str(nvcc_found.parents[1]) if nvcc_found and len(nvcc_found.parents) > 1 else "")
    facts["cuda_home"] = home or None
    real = _resolved(home) if home else None
    facts["cuda_home_real"] = str(real) if real else None
    nvcc = Path(home, "bin", "nvcc") if home else None
    facts["nvcc"] = str(nvcc) if nvcc and nvcc.is_file() else None
    # The probe runs as root on nodes: an nvcc that others could have put in place is not run (the toolkit checks
    # then fail, saying why), whatever CUDA_HOME names.
    refused = pathtrust.toolkit_open_to_others(Path(home)) if facts["nvcc"] and nvcc else None
    if refused:
        facts["nvcc_refused"] = refused
    if facts["nvcc"] and not refused:
        rc, out, _ = _run([facts["nvcc"], "--version"])
        match = re.search(r"release (\d+\.\d+), V([\d.]+)", out)
        facts["nvcc_version"] = match.group(2) if match else None
        major, _, minor = capability.partition(".")
        facts["compile"], reused = compile_facts(env, facts["nvcc"], home, f"sm_{major}{minor}a", reuse)
        if sources is not None:
            sources["nvcc_compile"] = "recorded" if reused else "compiled now"
    marker = Path(home, "bwstack-toolkit.json") if home else None
    if marker and marker.is_file():
        try:  # a FIFO named like it must not hang the probe
            found = json.loads(treecheck.read_regular(marker, 1 << 20, "a toolkit marker").decode("utf-8"))
        except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            found = None
        facts["toolkit_marker"] = found if isinstance(found, dict) else {"note": f"{marker} is unreadable"}
    return facts


def _resolved(path: str) -> Path | None:
    """`path` with its links resolved; None for a link loop."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):
        return None


# ------------------------------------------------------------------------------------------------ ELF


def _so_files(root: Path) -> list[Path]:
    """Regular files named *.so* under `root`; links (to files or folders) are not followed (as rglob did: this
    is its walk without pathlib's cost per entry)."""
    found = []
    for folder, _dirs, names in os.walk(root):
        for name in names:
            if ".so" in name:
                path = os.path.join(folder, name)
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.lstat(path).st_mode):
                        found.append(Path(path))
    return sorted(found)


def extension_files(sp: Path) -> list[Path]:
    """Shared objects outside torch that link against libtorch/libc10: torch extensions (sgl-kernel, ...)."""
    out = []
    for top in sorted(sp.iterdir()):
        if not top.is_dir() or top.name in SKIP_TOP or top.name.endswith(".dist-info") or top.name == "__pycache__":
            continue
        for so in _so_files(top):
            try:
                if any(TORCH_NEEDED.match(n) for n in elfscan.needed(so)):
                    out.append(so)
            except (elfscan.NotElfError, OSError):
                continue
    return out


def torch_preloads(sp: Path, torch_cuda: str | None) -> dict[str, str]:
    """Libraries `import torch` loads by hand (`_preload_cuda_deps` in _load_global_deps, read from the
    installed torch/__init__.py): nvrtc and nvJitLink, which extensions such as sgl-kernel then rely on."""
    text = treecheck.read_text(sp / "torch" / "__init__.py")
    if text is None:
        return {}
    body = text.split("def _load_global_deps", 1)[-1].split("except OSError", 1)[0]
    found: dict[str, str] = {}
    major = (torch_cuda or "").split(".")[0]
    for folder, pattern in re.findall(r'_preload_cuda_deps\(\s*"([^"]+)",\s*"([^"]+)"', body):
        dirs = [sp / "nvidia" / folder / "lib"] + ([sp / "nvidia" / f"cu{major}" / "lib"] if major else [])
        for directory in dirs:
            hits = sorted(directory.glob(pattern)) if directory.is_dir() else []
            if hits:
                found[hits[0].name] = str(hits[0])
                break
    return found


# Libraries a package loads one of at run time, chosen by the release of what the host has or runs: torchcodec's
# libtorchcodec_{core,custom_ops,pybind_ops}<N> for FFmpeg N, bitsandbytes' libbitsandbytes_cuda<NNN> for the CUDA
# release torch was built with, torch_c_dlpack_ext's addon_torch<NN> per torch release. Named one by one: a rule
# over names in general ("a trailing number") also groups builds that must each load (flash_attn2 and 3, ops for
# sm90 and sm100 however spelled).
_CHOSEN_AT_RUN_TIME = re.compile(
    r"(?P<stem>libtorchcodec_(?:core|custom_ops|pybind_ops)|libbitsandbytes_cuda|addon_torch)\d+"
)


def _alternative_key(path: Path) -> str:
    """Files a package chooses between at run time (a group works when one member loads) share this key: their
    folder and name with the release number masked. Every other file is its own group, and must load."""
    return str(path.parent / _CHOSEN_AT_RUN_TIME.sub(r"\g<stem>#", path.name, count=1))


def elf_facts(env: Path, sp: Path, torch_version: dict) -> dict:
    torch_lib = sp / "torch" / "lib"
    facts: dict = {"torch_lib": str(torch_lib) if torch_lib.is_dir() else None, "extensions": [], "torch_libs": []}
    if not torch_lib.is_dir():
        return facts
    system = elfscan.system_library_dirs()
    preloaded = dict(elfscan.torch_loaded(str(torch_lib), system))
    preloaded.update(torch_preloads(sp, torch_version.get("cuda")))
    interpreter = (env / "bin" / "python").resolve()
    with contextlib.suppress(elfscan.NotElfError, OSError):
        preloaded.update({k: v for k, v in elfscan.load_closure([interpreter], system).items() if v})
    facts["preloaded"] = sorted(k for k, v in preloaded.items() if v)
    cpu = torch_lib / "libtorch_cpu.so"
    facts["torch_cxx11_abi"] = elfscan.cxx11_abi(cpu) if cpu.exists() else None
    for lib in sorted(torch_lib.glob("lib*.so*")):
        try:
            needed = elfscan.needed(lib)
        except (elfscan.NotElfError, OSError):
            continue
        cudart = sorted(n for n in needed if n.startswith("libcudart.so"))
        facts["torch_libs"].append({"path": str(lib.relative_to(sp)), "cudart": cudart})
    version = re.match(r"(\d+)\.(\d+)", torch_version.get("version") or "")
    torch_tag = f"torch{version.group(1)}{version.group(2)}" if version else None
    for so in extension_files(sp):
        rel = str(so.relative_to(sp))
        if torch_tag and re.search(r"torch\d\d", so.name) and torch_tag not in so.name:
            continue  # an addon for another torch release: never loaded with this torch
        # Packages load their own helper libraries by path before their extensions (torchaudio's
        # libtorchaudio.so, torchcodec's libtorchcodec_core*.so): a NEEDED name that is a file of the same
        # package counts as loaded, and its exports count as providers.
        package_dir = sp / so.relative_to(sp).parts[0]
        local = {p.name: str(p) for p in _so_files(package_dir)}
        scope = {**preloaded, **{n: local[n] for n in elfscan.needed(so) if n in local}}
        resolved = elfscan.resolve_needed(so, system, preloaded=scope)
        unresolved = sorted(n for n, p in resolved.items() if p is None)
        siblings: list[str] = []
        queue = [n for n in elfscan.needed(so) if n in local]
        while queue:
            name = queue.pop()
            if local[name] not in siblings:
                siblings.append(local[name])
                queue += [n for n in elfscan.needed(local[name]) if n in local]
        try:
            report = elfscan.abi_report(so, torch_lib, extra_providers=siblings)
            missing = report.missing + [f"(library {n} is not in torch/lib)" for n in report.missing_libraries]
            checked = report.checked
        except Exception as exc:  # report it as a finding; one unreadable file must not hide the others
            missing, checked = [f"(ABI check failed: {exc})"], None
        needed = elfscan.needed(so)
        facts["extensions"].append(
            {
                "path": rel,
                "package": so.relative_to(sp).parts[0],
                "alternatives": _alternative_key(so.relative_to(sp)),
                "needed": needed,
                "cudart": sorted(n for n in needed if n.startswith("libcudart.so")),
                "unresolved": [n for n in unresolved if n not in DRIVER_LIBS],
                "unresolved_driver_libs": [n for n in unresolved if n in DRIVER_LIBS],
                "missing_torch_symbols": missing,
                "torch_symbols_checked": checked,
                "cxx11_abi": elfscan.cxx11_abi(so),
            }
        )
    return facts


# ------------------------------------------------------------------------------------------------ fatbins


def _cubin_arch(path: Path) -> str | None:
    """sm_XY of a standalone cubin (ELF e_flags bits 8-15 hold the SM number)."""
    try:
        with elfread.open_regular(path) as handle:  # a FIFO named *.cubin must not hang the probe
            head = handle.read(64)
    except (OSError, elfread.CorruptElf):
        return None
    if head[:4] != b"\x7fELF" or len(head) < 52:
        return None
    flags = int.from_bytes(head[48:52], "little")
    return f"sm_{(flags >> 8) & 0xFF}"


def fatbin_facts(sp: Path, capability: str) -> dict:
    facts: dict = {}
    torch_lib = sp / "torch" / "lib"
    if torch_lib.is_dir():
        facts["torch"] = [fatbin.coverage(p, capability) for p in sorted(torch_lib.glob("libtorch_cuda*.so"))]
    sgl = sp / "sgl_kernel"
    if sgl.is_dir():
        # sgl_kernel/__init__ loads sm90/common_ops only on capability 9.0; SM120 (and no GPU) gets sm100/
        variant = "sm90" if capability == "9.0" else "sm100"
        facts["sgl_kernel_variant"] = variant
        facts["sgl_kernel"] = [fatbin.coverage(p, capability) for p in sorted((sgl / variant).glob("common_ops*.so"))]
        facts["sgl_kernel_other"] = [fatbin.coverage(p, capability) for p in sorted(sgl.glob("*.so"))]
    cubin_dir = sp / "flashinfer_cubin"
    if cubin_dir.is_dir():
        archs: dict[str, int] = {}
        for path in cubin_dir.rglob("*.cubin"):
            arch = _cubin_arch(path) or "unknown"
            archs[arch] = archs.get(arch, 0) + 1
        facts["flashinfer_cubin"] = {"cubins": sum(archs.values()), "archs": dict(sorted(archs.items()))}
    jit = sp / "flashinfer_jit_cache"
    if jit.is_dir():
        summaries = [fatbin.coverage(p, capability) for p in _so_files(jit)]
        facts["flashinfer_jit_cache"] = {
            "files": len(summaries),
            "covering": sum(1 for s in summaries if s.get("covers")),
            "with_device_code": sum(1 for s in summaries if s.get("has_device_code")),
        }
    return facts


# ------------------------------------------------------------------------------------------------ imports


IMPORTS = {
    "torch": "import torch",
    "sgl_kernel": "import sgl_kernel",
    "flashinfer": "import flashinfer",
    "sglang": "import sglang, sglang.srt.distributed.device_communicators.torch_symm_mem",
}


def _stub_libcuda(sp: Path, out_dir: Path) -> Path | None:
    """A stand-in libcuda.so.1 exporting the driver symbols the extensions import, so their other links can be
    exercised on a host with no NVIDIA driver. Needs gcc; returns None without it."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if not gcc:
        return None
    names: set[str] = set()
    for so in extension_files(sp):
        if "libcuda.so.1" in elfscan.needed(so):
            names.update(s.name for s in elfscan.undefined_symbols(so) if s.name.startswith("cu"))
    if not names:
        return None
    src = out_dir / "stub.c"
    src.write_text("".join(f"int {n}(void) {{ return 34; }}\n" for n in sorted(names)))  # 34: CUDA_ERROR_STUB_LIBRARY
    lib = out_dir / "libcuda.so.1"
    rc, _, _err = _run([gcc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)])
    return lib if rc == 0 else None


class StandInLibcuda:
    """The stand-in libcuda.so.1 of one probe run, built on first use (scanning every extension's undefined
    symbols and compiling takes most of a second) and shared by the import checks and SGLang's planner, which
    run beside each other. `folder()` is the directory holding it, or None where it cannot be built."""

    def __init__(self, sp: Path) -> None:
        self._sp = sp
        self._lock = threading.Lock()
        self._dir: Path | None = None
        self._built = False
        self._lib: Path | None = None
        self._closed = False

    def folder(self) -> Path | None:
        with self._lock:
            if self._closed:  # asked after the probe run ended (an error path): nothing is built any more
                return None
            if not self._built:
                self._built = True
                self._dir = Path(tempfile.mkdtemp(prefix="bwstack-stub-"))
                self._lib = _stub_libcuda(self._sp, self._dir)
            return self._dir if self._lib is not None else None

    def __enter__(self) -> StandInLibcuda:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


@dataclass(frozen=True)
class ImportRun:
    """The import checks' outcome per module, and the files their interpreters loaded from outside the env (None:
    not known, e.g. an interpreter that died): what a later verify must find unchanged to reuse the outcome."""

    results: dict[str, dict]
    loaded: list | None


def _import_all(python: str, statements: dict[str, str], env: dict, inside: list[str] | None = None) -> ImportRun:
    """Import the modules in one interpreter (torch loads once: ~4x faster than one process each); if that
    interpreter dies (a segfault in an extension), fall back to one process per module. `inside`: folders whose
    files the loaded list leaves out (the env, which its manifest covers)."""
    rc, out, err = interp.run_script(
        python, "imports", json.dumps(statements), json.dumps(inside or []), timeout=900, env=env
    )
    loaded: list | None = None
    for line in out.splitlines():
        if line.startswith("BWSTACK-LOADED "):
            found = json.loads(line.split(" ", 1)[1])
            loaded = found if isinstance(found, list) else None
        if line.startswith("BWSTACK-IMPORTS "):
            return ImportRun(json.loads(line.split(" ", 1)[1]), loaded)
    results = {}
    for name, statement in statements.items():
        rc, _out, err = _run([python, "-c", statement], timeout=600, env=env)
        results[name] = {"ok": rc == 0, "error": err if rc else ""}
    return ImportRun(results, None)


def import_facts(env: Path, sp: Path, gpu_present: bool, stand_in: StandInLibcuda | None = None) -> ImportRun:
    with tempfile.TemporaryDirectory(prefix="bwstack-imports-") as folder:
        # The interpreters' TMPDIR: torch writes a module into a new folder of it on import, which their skipped
        # teardown would leave in /tmp on every run. It goes with this folder, and is not what results depend on.
        base = interp.clean_env({"TMPDIR": interp.private_folder(Path(folder))})
        inside = sorted({str(env), os.path.realpath(env), folder, os.path.realpath(folder)})
        return _import_facts(env, sp, gpu_present, stand_in, base, inside)


def _import_facts(
    env: Path, sp: Path, gpu_present: bool, stand_in: StandInLibcuda | None, base: dict, inside: list[str]
) -> ImportRun:
    python = str(env / "bin" / "python")
    results: dict = {m: {"installed": False} for m in IMPORTS if not (sp / m).is_dir()}
    wanted = {m: stmt for m, stmt in IMPORTS.items() if m not in results}
    first = _import_all(python, wanted, base, inside) if wanted else ImportRun({}, [])
    loaded = first.loaded
    blocked = []
    for module, outcome in first.results.items():
        results[module] = {"installed": True, "ok": outcome["ok"], "error": _last_error(outcome["error"])}
        if not outcome["ok"] and "libcuda.so.1" in outcome["error"] and not gpu_present:
            results[module]["blocked_by_missing_driver"] = True
            blocked.append(module)
    if blocked:
        with contextlib.ExitStack() as stack:
            if stand_in is None:
                stand_in = stack.enter_context(StandInLibcuda(sp))
            stub_dir = stand_in.folder()
            if stub_dir is None:
                for module in blocked:
                    results[module]["with_stub_libcuda"] = {
                        "ok": None,
                        "error": "no stand-in libcuda.so.1 could be built here (no C compiler, or nothing links it)",
                    }
            else:
                env_stub = interp.with_library_dir(base, stub_dir)
                # The stand-in is built afresh each run (from the compiler, which the results' key names).
                stub = [str(stub_dir), os.path.realpath(stub_dir)]
                again = _import_all(python, {m: IMPORTS[m] for m in blocked}, env_stub, [*inside, *stub])
                loaded = sealed.union_loaded(loaded, again.loaded)
                for module, outcome in again.results.items():
                    results[module]["with_stub_libcuda"] = {
                        "ok": outcome["ok"],
                        "error": _last_error(outcome["error"]) if not outcome["ok"] else "",
                    }
    return ImportRun(results, loaded)


ROOT_CAUSES = ("undefined symbol", "cannot open shared object file", "version `GLIBC", "no kernel image")


def _last_error(stderr: str) -> str:
    """The line that says why: a loader error buried in a wrapper message (sgl_kernel's "Could not load any
    common_ops library" lists them below), else the last exception line."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    for cause in ROOT_CAUSES:
        for line in lines:
            if cause in line:
                return line.strip().lstrip("- ")[:600]
    for line in reversed(lines):
        if re.match(r"^\w*(Error|Exception)\b", line) or "Error:" in line:
            return line.strip()[:600]
    return (lines[-1] if lines else "").strip()[:600]


# ------------------------------------------------------------------------------------------------ runtime


def runtime_facts(env: Path) -> dict:
    python = str(env / "bin" / "python")
    base = interp.clean_env()
    rc, out, err = interp.run_script(python, "runtime", timeout=900, env=base)
    facts = json.loads(out.strip().splitlines()[-1]) if rc == 0 and out.strip() else {"error": _last_error(err)}
    rc, out, err = interp.run_script(python, "nccl_allreduce", timeout=900, env=base, as_file=True)
    facts["nccl_allreduce"] = (
        json.loads(out.strip().splitlines()[-1])
        if rc == 0 and out.strip()
        else {"ok": False, "error": _last_error(err) or err[-400:]}
    )
    return facts


# ------------------------------------------------------------------------------------------------ main


def _gpu_key(gpu: dict) -> list:
    return [gpu.get("present"), gpu.get("driver"), [[g.get("name"), g.get("capability")] for g in gpu.get("gpus", [])]]


def static_facts(env: Path, sp: Path, capability: str, torch_version: dict) -> dict:
    """The facts read from the env's own files (what a sealed generation records in its facts.json)."""
    return {
        "elf": elf_facts(env, sp, torch_version),
        "fatbin": fatbin_facts(sp, capability),
        "features": features.report(sp, capability),
    }


def record_static(gen_dir: Path, env: Path, capability: str) -> Path:
    """Write a generation's facts.json (at build time, before its manifest)."""
    sp = envinspect.site_packages(env)
    torch_version = _torch_version_py(sp)
    facts = {"installed": installed_facts(env), "torch_version_py": torch_version}
    facts.update(static_facts(env, sp, capability, torch_version))
    return sealed.write_static(gen_dir, env, capability, facts)


def job_for_env(serve_plan: dict | None, generation: dict | None) -> tuple[dict | None, str | None]:
    """The serve-plan job for this env and the profile it is for. A job per profile (`by_profile`, null for a
    profile that names no models): the one of the profile the env's generation was built from (or, adopted, is
    nearest to), else the lock's default profile's, as the checks judge the env. A plain job is used as given."""
    if not isinstance(serve_plan, dict) or not isinstance(serve_plan.get("by_profile"), dict):
        return serve_plan, None
    jobs = serve_plan["by_profile"]
    gen = generation if isinstance(generation, dict) else {}
    name = gen.get("profile") or gen.get("nearest_profile")
    if name not in jobs:
        name = serve_plan.get("default")
    job = jobs.get(name) if isinstance(name, str) else None
    return (job if isinstance(job, dict) else None), (name if isinstance(name, str) else None)


def collect(
    env: Path,
    capability: str = "12.0",
    runtime: bool = True,
    imports: bool = True,
    serve_plan: dict | None = None,
    cached: bool = True,
) -> schema.Facts:
    import time

    facts: schema.Facts = {schema.SCHEMA_KEY: schema.SCHEMA_VERSION, "capability": capability, "timings": {}}
    started = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal started
        now = time.perf_counter()
        facts["timings"][name] = round(now - started, 3)
        started = now

    facts["host"] = host_facts()
    facts["gpu"] = gpu_facts()
    static, why = sealed.load_static(env, capability) if cached and env.exists() else (None, "not asked to reuse")
    facts["facts_source"] = {"static": "recorded" if static else "read", "why": why}
    facts["env"] = env_facts(env, static)
    lap("env")
    serve_plan, chosen = job_for_env(serve_plan, facts["env"].get("generation"))
    if chosen is not None:
        facts["serve_plan_profile"] = chosen
    if not facts["env"]["exists"]:
        return facts
    sp = Path(facts["env"]["site_packages"])
    # The import checks are other processes: let them run while this one reads the ELF files. A sealed,
    # unchanged generation on an unchanged host reuses the results of the last run (sealed.py says why).
    gpu_key = _gpu_key(facts["gpu"])
    # The generation is as sealed whenever its facts loaded, and also when only the host moved since (every result
    # of running it is keyed by the host as it is now): its results are reused and kept either way.
    reusable = static is not None or why in sealed.READ_AGAIN
    import_key = sealed.derived_key(env, "imports", gpu_key) if reusable else None
    reused = None
    if imports and reusable:
        recorded = sealed.load_derived(env, import_key)
        if isinstance(recorded, dict) and isinstance(recorded.get("results"), dict):
            moved = sealed.loaded_changed(recorded.get("loaded"))
            if moved is None:
                reused = recorded["results"]
            else:  # a system library copied over in place, a new interpreter: the imports run again
                facts["facts_source"]["imports_again"] = moved
    if reused is not None:
        facts["imports"] = reused
        facts["facts_source"]["imports"] = "recorded"
    # One stand-in libcuda.so.1 for the import checks and the planner (built by whichever needs it first).
    stand_in = StandInLibcuda(sp)
    try:
        # Leaving the pools waits for their workers, even on an error here: none still uses the stand-in when it goes.
        # The planner has a pool of its own: a thread that ran yielding work (interp.yielding) stays lowered.
        with ThreadPoolExecutor(max_workers=2) as pool, ThreadPoolExecutor(max_workers=1) as planner:
            pending = (
                pool.submit(interp.yielding, import_facts, env, sp, facts["gpu"]["present"], stand_in)
                if imports and reused is None
                else None
            )
            facts["cuda"] = cuda_facts(env, capability, reuse=reusable, sources=facts["facts_source"])
            lap("cuda")
            if reusable:  # what a fix search's serve-plan runs of this verify hand back to skip the unchanged check
                facts["facts_source"]["reuse"] = {"basis": sealed.basis(env), "gpu": gpu_key, "cuda": facts["cuda"]}
            # SGLang's planner is another process too: it starts before the ELF files are read, beside the imports.
            planning, plan_key = None, None
            if serve_plan and serve_plan.get("requests"):
                from bwstack.probe.serveplan import node

                plan_key = node.plan_key(env, serve_plan, gpu_key, facts["cuda"]) if reusable else None
                recorded = node.recorded_plan_for(env, plan_key, serve_plan)
                facts["serve_plan"] = recorded.plan
                if recorded.moved is not None:  # a library or module SGLang loaded changed: it plans again
                    facts["facts_source"]["serve_plan_again"] = recorded.moved
                if facts["serve_plan"] is None:
                    device = node.resolve_device(serve_plan["device"], env)
                    if node.needs_stand_in(device):
                        # Built here, before the ELF scan: built beside the scan (both Python, one GIL) it held the
                        # planner's interpreter back by a second. (On 2 cores the total stays bound by the CPU.)
                        stand_in.folder()
                    planning = planner.submit(
                        node.observe_job, env, device, serve_plan, cuda=facts["cuda"], stand_in=stand_in
                    )
                else:
                    facts["facts_source"]["serve_plan"] = "recorded"
            if static:
                facts["elf"], facts["fatbin"], facts["features"] = static["elf"], static["fatbin"], static["features"]
                lap("static facts (recorded)")
            else:
                torch_version = facts["env"].get("torch_version_py") or {}
                if planning is not None:  # beside the planner's interpreter, which is the longer path
                    reading = pool.submit(interp.yielding, static_facts, env, sp, capability, torch_version)
                    facts.update(reading.result())
                else:
                    facts.update(static_facts(env, sp, capability, torch_version))
                lap("elf, fatbin, features")
                if reusable:
                    sealed.save_static_again(env, capability, {**facts["env"], **facts})
            if planning is not None:
                facts["serve_plan"] = node.record_plan(env, plan_key, planning.result())
                lap("serve-plan (rest)")
            if pending is not None:
                run = pending.result()
                facts["imports"] = run.results
                if run.loaded is not None:  # what they loaded unknown: nothing to check a reuse against
                    sealed.save_derived(env, import_key, {"results": run.results, "loaded": run.loaded})
                lap("imports (rest)")
    finally:
        stand_in.close()
    if runtime and facts["gpu"]["present"]:
        facts["runtime"] = runtime_facts(env)
        lap("runtime")
    return facts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["preflight"]:
        from bwstack.probe import preflight

        return preflight.main(argv[1:])
    if argv[:1] == ["serve-plan"]:
        from bwstack.probe.serveplan import node

        return node.main(argv[1:])
    parser = argparse.ArgumentParser(prog="bwstack-probe")
    parser.add_argument("--env", help="the env to inspect (default: BWSTACK_ML_ENV, /opt/ml-env as root, ~/ml-env)")
    parser.add_argument("--capability", default="12.0")
    parser.add_argument("--no-runtime", action="store_true")
    parser.add_argument("--no-imports", action="store_true")
    parser.add_argument("--serve-plan", help="JSON job: plan these models with SGLang's own code (bwstack.serveplan)")
    parser.add_argument("--cold", action="store_true", help="read the env's files even if its generation recorded them")
    args = parser.parse_args(argv)
    env = Path(args.env) if args.env else default_env()
    job = json.loads(args.serve_plan) if args.serve_plan else None
    runtime, imports, cached = not args.no_runtime, not args.no_imports, not args.cold
    facts = collect(env, args.capability, runtime=runtime, imports=imports, serve_plan=job, cached=cached)
    json.dump(facts, sys.stdout, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
