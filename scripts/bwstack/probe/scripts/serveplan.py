"""Runs INSIDE the env's own interpreter: SGLang's server-argument resolution and the load-time choices it makes
for one model, observed while SGLang's code runs.

This file is shipped as a script (never imported by bwstack itself): it imports only the standard library at
module level and the env's own packages (torch, sglang, flashinfer, ...) inside functions. It prints one line
`BWSTACK-SERVEPLAN <json>` with what it observed; the controller turns that into a plan.

Nothing here decides anything SGLang decides. Where the target GPU is absent the device is *simulated*: the
answers torch.cuda, NVML and nvidia-smi would give on the target (capability, count, memory, name, NVLink or
not) are installed before SGLang is imported, and SGLang's own code then makes its choices. The decision site of
each choice is recorded as it happens (the caller frame when a tracked ServerArgs attribute is set, the `return`
a dispatch function takes, the frame an error is raised in). A choice that needs a GPU or a process group to be
observed is reported as not observed, with the reason. One shortcut, with the same answers: SGLang's model
registry is first imported with only the model modules that can register the requests' architectures (see
_import_registry_narrowed); any question it cannot answer exactly reads the rest first.

Request (argv[1], JSON): {"device": {"mode": "simulated"|"real", "capability", "count", "memory_mib", "name",
"interconnect"}, "requests": [{"id", "model_path", "draft_path", "tp", "speculative_algorithm", "quantization",
"attention_backend", "moe_runner_backend", "server_args": {...}}], "inside": [folders whose files the loaded
list leaves out], "speculate": [[{server args}, ...] by component: planned beside each request, _speculate]};
the caller sets the environment.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import re
import stat
import sys
import traceback
from types import SimpleNamespace

# bwstack-include: loaded

MARKER = "BWSTACK-SERVEPLAN "
SCHEMA = 1
PACKAGES = ("sglang", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "sgl-kernel", "torch", "triton")

# ServerArgs attributes whose final value (and who set it) the plan shows.
TRACKED = (
    "attention_backend", "prefill_attention_backend", "decode_attention_backend", "sampling_backend",
    "moe_runner_backend", "moe_a2a_backend", "speculative_algorithm", "speculative_num_steps",
    "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_draft_attention_backend",
    "speculative_attention_mode", "quantization", "kv_cache_dtype", "page_size", "dtype",
    "enable_flashinfer_allreduce_fusion", "disable_custom_all_reduce", "enable_torch_symm_mem", "enable_mscclpp",
    "enable_symm_mem", "fp8_gemm_runner_backend", "fp4_gemm_runner_backend", "disable_overlap_schedule",
    "disable_cuda_graph", "disable_shared_experts_fusion", "chunked_prefill_size", "cuda_graph_max_bs",
    "mem_fraction_static", "max_running_requests", "tp_size",
)  # fmt: skip


# ------------------------------------------------------------------------------------------------ sites


def _site_packages_of(path: str) -> str:
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


def _site(filename: str, lineno: int) -> str:
    return f"{_site_packages_of(filename)}:{lineno}"


def _frame_site(frame) -> str:
    return _site(frame.f_code.co_filename, frame.f_lineno)


def _source_line(filename: str, lineno: int) -> str:
    try:
        with open(filename, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, 1):
                if number == lineno:
                    return line.strip()
    except OSError:
        pass
    return ""


def _is_package_frame(filename: str, packages: tuple[str, ...] = ("sglang", "flashinfer", "sgl_kernel")) -> bool:
    rel = _site_packages_of(filename)
    return rel != filename and rel.split(os.sep, 1)[0] in packages


def _error(exc: BaseException) -> dict:
    """Type, message and where in the env's packages it was raised (innermost package frame)."""
    site, code = None, ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if _is_package_frame(frame.f_code.co_filename):
            site = _site(frame.f_code.co_filename, lineno)
            code = _source_line(frame.f_code.co_filename, lineno)
    message = str(exc).strip() or repr(exc)
    return {"type": type(exc).__name__, "message": message[:1200], "site": site, "code": code}


_SOURCES: dict[int, tuple[object, tuple[str | None, list[str], int] | None]] = {}


def _source_of(obj) -> tuple[str | None, list[str], int] | None:
    """(file, lines, first line) of a class or function's source, or None. Kept for the process (keyed by the
    object's identity, the object held so the key stays its own): inspect tokenizes the whole definition each
    time, and ServerArgs (thousands of lines) is asked about once per field and request."""
    obj = getattr(obj, "__func__", obj)  # a bound method's source is its function's; its instance is not kept
    held = _SOURCES.get(id(obj))
    if held is not None and held[0] is obj:
        return held[1]
    try:
        lines, start = inspect.getsourcelines(obj)
        source = (inspect.getsourcefile(obj), lines, start)
    except (OSError, TypeError):
        source = None
    _SOURCES[id(obj)] = (obj, source)
    return source


def _definition_site(obj) -> str | None:
    source = _source_of(obj)
    if source is None or not source[0]:
        return None
    return _site(source[0], source[2])


def _assignment_site(cls, attr: str) -> str | None:
    """file:line of `self.<attr> =` in a class's __init__ (where a method object records a choice)."""
    source = _source_of(cls.__init__)
    if source is None:
        return None
    filename, lines, start = source
    pattern = re.compile(rf"^\s*self\.{re.escape(attr)}\s*=")
    for offset, line in enumerate(lines):
        if pattern.match(line):
            return _site(filename, start + offset)
    return None


class _ReturnWatch:
    """Runs a call under sys.settrace and finds the innermost `return` that produced the call's result: the
    line where a dispatch function made its choice."""

    def __init__(self) -> None:
        self.returns: list[tuple[object, str, str]] = []

    def _tracer(self, frame, event, arg):
        if event == "call":
            return self._local if _is_package_frame(frame.f_code.co_filename) else None
        return None

    def _local(self, frame, event, arg):
        if event == "return":
            self.returns.append((arg, _frame_site(frame), frame.f_code.co_name))
        return self._local

    def run(self, fn, *args, **kwargs):
        old = sys.gettrace()
        sys.settrace(self._tracer)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.settrace(old)

    def site_of(self, value) -> tuple[str | None, str | None]:
        for returned, site, function in self.returns:
            if returned is value:
                return site, function
        return None, None


# ------------------------------------------------------------------------------------------------ device


def _simulate_device(device: dict) -> None:
    """Make torch.cuda and NVML answer as the target GPU would, before SGLang (which reads them at import) loads.
    nvidia-smi is answered by the stand-in the caller put on PATH."""
    import torch

    major, minor = (int(x) for x in device["capability"].split("."))
    count = int(device["count"])
    total = int(device["memory_mib"]) * 1024 * 1024

    class _Properties:
        def __init__(self, index: int) -> None:
            self.name = device["name"]
            self.major, self.minor = major, minor
            self.total_memory = total
            self.multi_processor_count = int(device.get("sm_count") or 0)
            self.index = index

    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: count
    cuda.get_device_capability = lambda device=None: (major, minor)
    cuda.get_device_name = lambda device=None: device_name
    cuda.get_device_properties = lambda device=None: _Properties(0)
    cuda.mem_get_info = lambda device=None: (total, total)
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.can_device_access_peer = lambda a, b: device_info["interconnect"] == "nvlink"
    device_name, device_info = device["name"], device

    try:
        import pynvml
    except ImportError:
        return
    nvlink = device["interconnect"] == "nvlink"
    pynvml.nvmlInit = lambda *a, **k: None
    pynvml.nvmlShutdown = lambda *a, **k: None
    pynvml.nvmlDeviceGetCount = lambda: count
    pynvml.nvmlDeviceGetHandleByIndex = lambda index: ("simulated-gpu", int(index))
    pynvml.nvmlDeviceGetName = lambda handle: device_name
    pynvml.nvmlDeviceGetCudaComputeCapability = lambda handle: (major, minor)

    def p2p_status(a, b, index):
        if index == getattr(pynvml, "NVML_P2P_CAPS_INDEX_NVLINK", None):
            return pynvml.NVML_P2P_STATUS_OK if nvlink else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        return pynvml.NVML_P2P_STATUS_OK

    pynvml.nvmlDeviceGetP2PStatus = p2p_status


def _real_device() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"present": False}
    major, minor = torch.cuda.get_device_capability(0)
    return {
        "present": True,
        "capability": f"{major}.{minor}",
        "count": torch.cuda.device_count(),
        "name": torch.cuda.get_device_name(0),
        "memory_mib": torch.cuda.get_device_properties(0).total_memory // (1024 * 1024),
    }


# ------------------------------------------------------------------------------------------------ logging


class _Records(logging.Handler):
    """What SGLang and FlashInfer log while they decide, with the file:line of each message."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.items: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith(("sglang", "flashinfer")):
            return
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        self.items.append(
            {
                "level": record.levelname,
                "logger": record.name,
                "message": message.strip()[:600],
                "site": _site(record.pathname, record.lineno),
            }
        )


# ------------------------------------------------------------------------------------------------ helpers


def _versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "value") and isinstance(getattr(value, "value", None), str):  # enums
        return value.value
    return str(value)


def _attempt(fn, *args, **kwargs) -> tuple[object, dict | None]:
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # the observation is that it raised; report, never hide
        return None, _error(exc)


def _flags(obj) -> dict:
    """The boolean choices a quant-method object records (use_*, enable_*, block_quant)."""
    out = {}
    for key, value in sorted(vars(obj).items()):
        if isinstance(value, bool) and (key.startswith(("use_", "enable_")) or key == "block_quant"):
            out[key] = value
    return out


def _callable_name(fn) -> str | None:
    if fn is None:
        return None
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


# ------------------------------------------------------------------------------------------------ model registry

REGISTRY = "sglang.srt.models.registry"
MODELS = "sglang.srt.models"
CONFIG_MAX_BYTES = 4 << 20


def _architectures(requests: list) -> set[str] | None:
    """The architectures the config.json of every model and draft of these requests names; None when one cannot
    be read (the registry is then imported whole, as SGLang does)."""
    names: set[str] = set()
    for request in requests:
        for key in ("model_path", "draft_path"):
            folder = request.get(key)
            if not folder:
                continue
            path = os.path.join(folder, "config.json")
            try:  # a regular file of a config's size (SGLang reads the same file; a FIFO would hold it too)
                st = os.stat(path)
                if not stat.S_ISREG(st.st_mode) or st.st_size > CONFIG_MAX_BYTES:
                    return None
                with open(path, encoding="utf-8") as f:
                    archs = json.load(f).get("architectures")
            except (OSError, ValueError, AttributeError, RecursionError):
                return None
            if not (isinstance(archs, list) and archs and all(isinstance(a, str) and a.isidentifier() for a in archs)):
                return None
            names.update(archs)
    return names or None


ENTRY = re.compile(r"^[ \t]*EntryClass\b", re.M)
ENTRY_VALUE = re.compile(r"EntryClass[ \t]*=[ \t]*(\[[^\[\]()]*\]|\([^\[\]()]*\)|[\w.]+)[ \t]*(?:#.*)?$", re.M)


def _registers(text: str, names: set[str]) -> bool:
    """Whether a model module's source may register one of `names` with SGLang's registry (which keys each class of
    a module's EntryClass by its __name__): an EntryClass naming one of them, or one whose value is not a plain
    list of names (an alias imported `as` another name, a computed value) and so cannot be read here."""
    for found in ENTRY.finditer(text):
        value = ENTRY_VALUE.match(text, found.end() - len("EntryClass"))
        if value is None:
            return True
        listed = re.sub(r"#[^\n]*", "", value.group(1)).strip("[]() \t\n")
        for item in filter(None, (part.strip() for part in listed.split(","))):
            if not re.fullmatch(r"[A-Za-z_][\w.]*", item):
                return True
            last = item.rsplit(".", 1)[-1]
            if last in names or re.search(rf"\bas[ \t]+{re.escape(last)}\b", text):
                return True
    return False


def _modules_registering(names: set[str]) -> tuple[list[str], list[str]] | None:
    """SGLang's model modules split into those that may register one of `names` (_registers) and the rest; None
    when a module's source cannot be read."""
    import importlib.util

    spec = importlib.util.find_spec(MODELS)
    folders = list(spec.submodule_search_locations or []) if spec else []
    if len(folders) != 1:
        return None
    naming, rest = [], []
    for entry in sorted(os.listdir(folders[0])):
        path = os.path.join(folders[0], entry)
        if entry.startswith("__") or entry == "registry.py" or os.path.isdir(path):
            continue  # the registry itself registers nothing (SGLang's loop finds it half-imported)
        if not entry.endswith(".py"):
            return None  # a module without source here: read the whole registry
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            return None
        (naming if _registers(text, names) else rest).append(entry[:-3])
    return naming, rest


class _Keys:
    """_Registered.keys(): membership asks the registry (a miss reads the whole of it); anything else is the
    whole registry's dict_keys."""

    def __init__(self, registered) -> None:
        self._registered = registered

    def __contains__(self, arch) -> bool:
        return arch in self._registered

    def _all(self):
        self._registered._whole()
        return dict.keys(self._registered)

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return repr(self._all())

    def __getattr__(self, name):
        return getattr(self._all(), name)


class _Registered(dict):
    """SGLang's ModelRegistry.models after a narrowed import: the classes of the modules that name the requests'
    architectures. A question it cannot answer exactly (an architecture it lacks, the list of all) imports every
    other model module first, through SGLang's own import_model_classes, so every answer is the one the whole
    registry gives."""

    def __init__(self, found: dict, complete) -> None:
        super().__init__(found)
        self._complete = complete

    def _whole(self) -> None:
        if self._complete is not None:
            whole = dict(self._complete())  # raises as the registry's import would, again at the next question
            self._complete = None
            dict.clear(self)  # the whole registry's entries in its own order (the narrowed ones are among them)
            dict.update(self, whole)

    def __contains__(self, arch) -> bool:
        if not dict.__contains__(self, arch):
            self._whole()
        return dict.__contains__(self, arch)

    def __getitem__(self, arch):
        if not dict.__contains__(self, arch):
            self._whole()
        return dict.__getitem__(self, arch)

    def get(self, arch, default=None):
        if arch in self:  # a miss reads the whole registry first
            return dict.__getitem__(self, arch)
        return default

    def keys(self):
        return _Keys(self)

    def __iter__(self):
        self._whole()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._whole()
        return dict.__len__(self)

    def items(self):
        self._whole()
        return dict.items(self)

    def values(self):
        self._whole()
        return dict.values(self)


def _import_registry_narrowed(requests: list) -> str | None:
    """Import SGLang's model registry with only the model modules that can hold these requests' architectures.
    Importing every model module (what the registry does when it is first imported) cost about 1 s of the
    planner's 6.6 s here (3 s alone, most of it layers the planner imports anyway), and a plan reads one
    architecture per model. SGLang's own switch, SGLANG_DISABLED_MODEL_ARCHS, leaves the others out for that
    import; the registry's answers stay the whole registry's (_Registered). Nothing is narrowed when the registry
    is already imported, when another package adds models (SGLANG_EXTERNAL_MODEL_PACKAGE), or when an
    architecture or a module's source cannot be read. Returns what was narrowed (None: nothing)."""
    if REGISTRY in sys.modules or os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE"):
        return None
    names = _architectures(requests)
    split = _modules_registering(names) if names else None
    if split is None:
        return None
    naming, rest = split
    variable = "SGLANG_DISABLED_MODEL_ARCHS"
    before = os.environ.get(variable)
    own = [s.strip() for s in (before or "").split(",") if s.strip()]
    os.environ[variable] = ",".join([*own, *rest])
    try:
        registry = importlib.import_module(REGISTRY)
    finally:
        if before is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before
    registry.import_model_classes.cache_clear()  # the whole registry is read under the operator's own switch
    found = dict(registry.ModelRegistry.models)
    registry.ModelRegistry.models = _Registered(found, lambda: registry.import_model_classes(MODELS))
    return f"{len(naming)} of {len(naming) + len(rest)} model modules imported first ({', '.join(naming)})"


# ------------------------------------------------------------------------------------------------ speculated

SPECULATED_MAX = 64  # variants planned per request: a plan in a started interpreter costs about 15 ms here


def _variants(groups: list, values: dict) -> list[dict]:
    """The server-argument changes a fix search would ask to plan for a request whose resolved arguments are
    `values`, given the catalogue's changes by component (`groups`, the controller's assemble.speculation): per
    component, the changes that are not already what the plan runs (the first of them is the one a fix search
    tries first); each change alone, then every combination of the firsts, smallest first (at most
    SPECULATED_MAX, counted as they are made)."""
    import itertools

    firsts: list[dict] = []
    others: list[dict] = []
    for group in groups:
        live = [alt for alt in group if not all(values.get(k) == v for k, v in alt.items())]
        if live:
            firsts.append(live[0])
            others.extend(live[1:])
    singles = ([alt] for alt in [*firsts, *others])
    combined = (
        combination for size in range(2, len(firsts) + 1) for combination in itertools.combinations(firsts, size)
    )
    unique: list[dict] = []
    seen: set[str] = set()
    for parts in itertools.chain(singles, combined):
        merged: dict = {}
        for alt in parts:
            merged.update(alt)
        key = json.dumps(merged, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            unique.append(merged)
            if len(unique) == SPECULATED_MAX:
                break
    return unique


def _speculate(observer, requests: list, observations: list, groups: list) -> list[dict]:
    """Each request planned again with the changes _variants names, in this interpreter: SGLang's imports are
    paid once. Returns [{"of": index of the request, "server_args": the change, "observation": ...}]."""
    out = []
    for index, (request, observation) in enumerate(zip(requests, observations, strict=True)):
        server = (observation.get("steps") or {}).get("server_args") or {}
        if not server.get("ok"):
            continue
        for args in _variants(groups, server.get("values") or {}):
            variant = {**request, "server_args": {**(request.get("server_args") or {}), **args}}
            try:
                seen = observer.observe(variant)
            except Exception as exc:  # as for the requests themselves
                seen = {"id": request.get("id"), "crashed": _error(exc), "steps": {}}
            out.append({"of": index, "server_args": args, "observation": seen})
    return out


# ------------------------------------------------------------------------------------------------ observe


class Observer:
    def __init__(self, device: dict, requests: list) -> None:
        self.device = device
        self.requests = requests  # every request this interpreter plans: the model registry is imported once
        self.registry: str | None = None
        self.records = _Records()
        logging.getLogger().addHandler(self.records)
        for name in ("sglang", "flashinfer"):
            logging.getLogger(name).setLevel(logging.INFO)
        self.decisions: dict[str, dict] = {}
        self.history: list[dict] = []
        self._server_args_cls = None

    # -- ServerArgs decision sites

    def _install_setattr_hook(self) -> None:
        from sglang.srt.server_args import ServerArgs

        observer = self
        original = ServerArgs.__setattr__

        def hooked(self, name, value):
            if name in TRACKED:
                frame = sys._getframe(1)
                if frame.f_code.co_filename != "<string>":  # not the dataclass __init__ filling the fields
                    old = self.__dict__.get(name, hooked)
                    if old is hooked or old != value:
                        entry = {
                            "name": name,
                            "value": _plain(value),
                            "site": _frame_site(frame),
                            "function": frame.f_code.co_name,
                            "code": _source_line(frame.f_code.co_filename, frame.f_lineno),
                        }
                        observer.history.append(entry)
                        observer.decisions[name] = entry
            original(self, name, value)

        ServerArgs.__setattr__ = hooked
        self._server_args_cls = ServerArgs

    def _default_site(self, name: str) -> str | None:
        source = _source_of(self._server_args_cls)
        if source is None:
            return None
        filename, lines, start = source
        pattern = re.compile(rf"^\s+{re.escape(name)}\s*:")
        for offset, line in enumerate(lines):
            if pattern.match(line):
                return _site(filename, start + offset)
        return None

    # -- one request

    def observe(self, request: dict) -> dict:
        """One model; the environment is the process's own (set before SGLang was imported: it reads most of its
        variables at import)."""
        self.decisions, self.history = {}, []
        self.records.items = []
        out: dict = {"id": request.get("id"), "steps": {}}
        self._observe(request, out)
        out["log"] = self.records.items
        return out

    def _observe(self, request: dict, out: dict) -> None:
        steps = out["steps"]
        from sglang.srt.server_args import ServerArgs

        if self._server_args_cls is None:
            self._install_setattr_hook()
        kwargs = {"model_path": request["model_path"], "tp_size": int(request.get("tp") or 1)}
        for key in ("quantization", "attention_backend", "moe_runner_backend", "speculative_algorithm"):
            if request.get(key):
                kwargs[key] = request[key]
        if request.get("draft_path"):
            kwargs["speculative_draft_model_path"] = request["draft_path"]
        kwargs.update(request.get("server_args") or {})  # further ServerArgs fields (the suggested fixes)
        out["server_args_input"] = kwargs
        sa, error = _attempt(ServerArgs, **kwargs)
        values = {}
        if sa is not None:
            for name in TRACKED:
                if hasattr(sa, name):
                    values[name] = _plain(getattr(sa, name))
        sites = {}
        for name in values:
            if name in self.decisions:
                sites[name] = {k: self.decisions[name][k] for k in ("site", "function", "code")}
            elif name in kwargs:
                sites[name] = {"site": None, "function": "given", "code": f"{name}={kwargs[name]!r}"}
            else:
                sites[name] = {"site": self._default_site(name), "function": "default", "code": ""}
        steps["server_args"] = {
            "ok": sa is not None,
            "error": error,
            "values": values,
            "sites": sites,
            "history": self.history,
        }
        if sa is None:
            return
        # Each later step imports more of SGLang (and sgl-kernel, FlashInfer): one that cannot run here (a
        # package absent from a minimal env) is reported as not observed and the others still run.
        self._qc = None
        self._model_config = None
        for name, step in (
            ("model", lambda: self._model(sa, steps)),
            ("scheduler_init", lambda: self._scheduler_init(sa, steps)),
            ("quant_config", lambda: self._quant_config(sa, steps)),
            ("parallel_groups", lambda: self._simulate_parallel_groups(sa)),
            ("linear", lambda: self._linear(sa, self._qc, steps)),
            ("moe", lambda: self._moe(sa, self._qc, steps)),
            ("deep_gemm", lambda: self._deep_gemm(steps)),
            ("attention", lambda: self._attention(sa, steps)),
            ("speculative", lambda: self._speculative(sa, steps)),
            ("all_reduce", lambda: self._all_reduce(sa, steps)),
            ("flashinfer_jit", lambda: self._flashinfer_jit(steps)),
        ):
            try:
                result = step()
            except Exception as exc:  # reported as this step's observation
                steps[name] = {**steps.get(name, {}), "ok": False, "not_observed": _error(exc)}
                continue
            if name == "quant_config":
                self._qc = result

    def _model(self, sa, steps: dict) -> None:
        mc, error = _attempt(sa.get_model_config)
        if mc is None:
            steps["model"] = {"ok": False, "error": error}
            return
        hf = mc.hf_text_config
        experts = None
        for key in ("num_experts", "n_routed_experts", "num_local_experts"):
            if getattr(hf, key, None):
                experts = int(getattr(hf, key))
                break
        from sglang.srt.model_loader.utils import get_model_architecture

        if self.registry is None:  # where SGLang itself imports the registry: the first model resolved
            try:
                self.registry = _import_registry_narrowed(self.requests) or ""
            except Exception:  # SGLang's own import, in get_model_architecture, then says what is wrong
                self.registry = ""
        arch_cls, arch_error = _attempt(lambda: get_model_architecture(mc)[0])
        steps["model"] = {
            "ok": True,
            "architecture": (mc.hf_config.architectures or [None])[0],
            "model_class": getattr(arch_cls, "__name__", None),
            "model_class_site": _definition_site(arch_cls) if arch_cls is not None else None,
            "model_class_error": arch_error,
            "quantization": mc.quantization,
            "attention_arch": _plain(getattr(mc, "attention_arch", None)),
            "use_mla_backend": bool(_attempt(sa.use_mla_backend)[0]),
            "dtype": _plain(mc.dtype),
            "experts": experts,
            "supports_eagle3_capture": (
                hasattr(arch_cls, "set_eagle3_layers_to_capture") if arch_cls is not None else None
            ),
        }
        self._model_config = mc

    def _scheduler_init(self, sa, steps: dict) -> None:
        """What the scheduler runs before the model loads (managers/scheduler.py: set the global server args,
        initialize_moe_config, initialize_fp8_gemm_config, initialize_fp4_gemm_config)."""
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(sa)
        errors = {}
        for module, name in (
            ("sglang.srt.layers.moe", "initialize_moe_config"),
            ("sglang.srt.layers.quantization.fp8_utils", "initialize_fp8_gemm_config"),
            ("sglang.srt.layers.quantization.fp4_utils", "initialize_fp4_gemm_config"),
        ):
            fn = getattr(importlib.import_module(module), name, None)
            if fn is None:
                errors[name] = {"type": "Missing", "message": f"{module}.{name} not found in this sglang"}
                continue
            _, error = _attempt(fn, sa)
            if error:
                errors[name] = error
        steps["scheduler_init"] = {"ok": not errors, "errors": errors}

    def _quant_config(self, sa, steps: dict):
        mc = getattr(self, "_model_config", None)
        if mc is None:
            return None
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import _get_quantization_config

        qc, error = _attempt(_get_quantization_config, mc, LoadConfig(load_format=sa.load_format))
        steps["quant_config"] = {
            "ok": error is None,
            "error": error,
            "class": type(qc).__name__ if qc is not None else None,
            "name": _attempt(qc.get_name)[0] if qc is not None else None,
            "min_capability": _attempt(qc.get_min_capability)[0] if qc is not None else None,
            "check_site": _definition_site(_get_quantization_config),
        }
        return qc

    def _simulate_parallel_groups(self, sa) -> None:
        """Rank 0 of the TP group (world size tp, no expert parallelism unless asked): the layers read only the
        sizes and ranks at construction. These stand-ins have no collectives."""
        import sglang.srt.distributed.parallel_state as ps

        tp, ep = int(sa.tp_size), int(getattr(sa, "ep_size", 1) or 1)

        def group(size: int) -> SimpleNamespace:
            return SimpleNamespace(world_size=size, rank_in_group=0, rank=0, local_rank=0, ranks=list(range(size)))

        for attr, size in (("_TP", tp), ("_MOE_EP", ep), ("_MOE_TP", tp // ep), ("_ATTN_TP", tp), ("_PP", 1)):
            if hasattr(ps, attr):
                setattr(ps, attr, group(size))

    def _linear(self, sa, qc, steps: dict) -> None:
        mc = getattr(self, "_model_config", None)
        if mc is None:
            return
        import torch
        from sglang.srt.layers.linear import RowParallelLinear

        hf = mc.hf_text_config
        hidden = int(hf.hidden_size)
        prefix = "model.layers.0.self_attn.o_proj"
        watch = _ReturnWatch()
        with torch.device("meta"):
            layer, error = _attempt(
                watch.run, RowParallelLinear, hidden, hidden, bias=False, quant_config=qc, prefix=prefix,
                params_dtype=torch.bfloat16,
            )  # fmt: skip
        method = getattr(layer, "quant_method", None)
        info: dict = {
            "ok": method is not None,
            "error": error,
            "layer": f"RowParallelLinear({hidden}, {hidden}) {prefix}",
            "method": type(method).__name__ if method is not None else None,
            "method_site": _definition_site(type(method)) if method is not None else None,
            "flags": _flags(method) if method is not None else {},
        }
        block_fn = getattr(method, "w8a8_block_fp8_linear", None)
        if block_fn is not None and info["flags"].get("block_quant"):
            site, function = watch.site_of(block_fn)
            info["block_fp8_gemm"] = {"function": _callable_name(block_fn), "site": site, "decided_in": function}
        if method is not None and type(method).__name__ == "ModelOptFp4LinearMethod":
            info["fp4_gemm"] = self._fp4_gemm()
        steps["linear"] = info

    def _fp4_gemm(self) -> dict:
        import sglang.srt.layers.quantization.modelopt_quant as mq
        from sglang.srt.layers.quantization.fp4_utils import get_fp4_gemm_runner_backend

        backend = get_fp4_gemm_runner_backend()
        use_flashinfer = bool(getattr(mq, "enable_flashinfer_fp4_gemm", False))
        out = {
            "flashinfer_mm_fp4": use_flashinfer,
            "flashinfer_mm_fp4_site": _assignment_site_module(mq, "enable_flashinfer_fp4_gemm"),
            "runner_backend": _plain(backend),
            "flashinfer_backend": backend.get_flashinfer_backend() if use_flashinfer else None,
            "fp4_quantize": getattr(getattr(mq, "fp4_quantize", None), "__module__", None),
            "call_site": _definition_site(getattr(mq, "fp4_gemm", None)),
        }
        if use_flashinfer:
            import flashinfer

            mm_fp4 = flashinfer.mm_fp4
            cc = self._cc()
            supported = {}
            for name in ("cutlass", "cudnn", "trtllm"):
                ok, err = _attempt(getattr(mm_fp4, "is_backend_supported", lambda *a, **k: None), name, cc)
                supported[name] = ok if err is None else f"unknown: {err['message']}"
            out["flashinfer_declares"] = {"capability": cc, "backends": supported}
        return out

    def _cc(self) -> int:
        import torch

        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor

    def _moe(self, sa, qc, steps: dict) -> None:
        model = steps.get("model") or {}
        if not model.get("experts"):
            steps["moe"] = {"applies": False}
            return
        import sglang.srt.layers.moe.fused_moe_triton.layer as moe_layer
        import sglang.srt.layers.moe.moe_runner.runner as runner_mod
        import torch

        hf = self._model_config.hf_text_config
        runners: list[dict] = []
        original_init = runner_mod.MoeRunner.__init__

        def recording_init(runner_self, runner_backend, config):
            frame = sys._getframe(1)
            runners.append(
                {
                    "backend": _plain(runner_backend),
                    "site": _frame_site(frame),
                    "code": _source_line(frame.f_code.co_filename, frame.f_lineno),
                }
            )
            return original_init(runner_self, runner_backend, config)

        runner_mod.MoeRunner.__init__ = recording_init
        try:
            with torch.device("meta"):
                layer, error = _attempt(
                    moe_layer.FusedMoE,
                    num_experts=model["experts"],
                    hidden_size=int(hf.hidden_size),
                    intermediate_size=int(getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size),
                    layer_id=int(getattr(hf, "first_k_dense_replace", 0) or 0),
                    top_k=int(getattr(hf, "num_experts_per_tok", 0) or getattr(hf, "experts_per_token", 1)),
                    quant_config=qc,
                    prefix="model.layers.3.mlp.experts",
                    params_dtype=torch.bfloat16,
                    with_bias=bool(getattr(hf, "model_type", "") == "gpt_oss"),
                )
        finally:
            runner_mod.MoeRunner.__init__ = original_init
        method = getattr(layer, "quant_method", None)
        flags = _flags(method) if method is not None else {}
        steps["moe"] = {
            "applies": True,
            "ok": method is not None,
            "error": error,
            "method": type(method).__name__ if method is not None else None,
            "method_site": _definition_site(type(method)) if method is not None else None,
            "flags": flags,
            "flag_sites": {k: _assignment_site(type(method), k) for k in flags} if method is not None else {},
            "runner": runners[-1] if runners else None,
            "layer_site": _definition_site(moe_layer.FusedMoE),
        }

    def _deep_gemm(self, steps: dict) -> None:
        from sglang.srt.layers import deep_gemm_wrapper

        wrapper_file = getattr(deep_gemm_wrapper, "__file__", "")
        configurer = importlib.import_module("sglang.srt.layers.deep_gemm_wrapper.configurer")
        steps["deep_gemm"] = {
            "enabled": bool(getattr(deep_gemm_wrapper, "ENABLE_JIT_DEEPGEMM", False)),
            "blackwell": bool(getattr(deep_gemm_wrapper, "DEEPGEMM_BLACKWELL", False)),
            "site": _definition_site(getattr(configurer, "_compute_enable_deep_gemm", None))
            or _site_packages_of(wrapper_file),
            "package": _package_dir("deep_gemm"),
        }

    def _attention(self, sa, steps: dict) -> None:
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        prefill, decode = sa.get_attention_backends()
        mc = getattr(self, "_model_config", None)
        runner = SimpleNamespace(
            server_args=sa,
            model_config=mc,
            use_mla_backend=bool((steps.get("model") or {}).get("use_mla_backend")),
            init_new_workspace=False,
            device="cuda",
            is_draft_worker=False,
        )
        gates = {}
        for name in dict.fromkeys([prefill, decode]):
            gates[name] = self._gate(ATTENTION_BACKENDS, name, runner, "attention_registry.py")
        steps["attention"] = {"prefill": prefill, "decode": decode, "gates": gates}

    def _gate(self, registry: dict, name: str, runner, gate_file: str) -> dict:
        """Run SGLang's backend factory; an error raised inside the factory itself is the start-up error the
        server gives, anything later (the backend's own construction, which needs the GPU) is not observed."""
        if name not in registry:
            return {"passed": False, "error": {"type": "ValueError", "message": f"Invalid attention backend: {name}"}}
        factory = registry[name]
        try:
            factory(runner)
        except Exception as exc:
            frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
            raised_in_factory = bool(frames) and frames[-1].f_code is factory.__code__
            if raised_in_factory:
                return {"passed": False, "error": _error(exc), "factory_site": _definition_site(factory)}
            return {
                "passed": True,
                "factory_site": _definition_site(factory),
                "construction": f"not observed: the backend's constructor needs the GPU ({type(exc).__name__})",
            }
        return {"passed": True, "factory_site": _definition_site(factory), "construction": "constructed"}

    def _speculative(self, sa, steps: dict) -> None:
        if not getattr(sa, "speculative_algorithm", None):
            steps["speculative"] = {"applies": False}
            return
        info: dict = {"applies": True, "algorithm": _plain(sa.speculative_algorithm)}
        draft = getattr(sa, "speculative_draft_model_path", None)
        if draft:
            from sglang.srt.configs.model_config import ModelConfig
            from sglang.srt.model_loader.utils import get_model_architecture

            dmc, error = _attempt(ModelConfig, draft, is_draft_model=True)
            if dmc is None:
                info["draft"] = {"ok": False, "error": error}
            else:
                cls, cls_error = _attempt(lambda: get_model_architecture(dmc)[0])
                info["draft"] = {
                    "ok": cls is not None,
                    "architecture": (dmc.hf_config.architectures or [None])[0],
                    "model_class": getattr(cls, "__name__", None),
                    "model_class_site": _definition_site(cls) if cls is not None else None,
                    "error": cls_error,
                }
        from sglang.srt.speculative import draft_utils

        factory_cls = getattr(draft_utils, "DraftBackendFactory", None)
        if factory_cls is not None:
            runner = SimpleNamespace(server_args=sa, model_config=getattr(self, "_model_config", None), device="cuda")
            factory = factory_cls(sa, runner, sa.speculative_eagle_topk or 1, sa.speculative_num_steps or 1)
            info["draft_backends"] = {
                "decode": self._draft_backend(factory, "create_decode_backend"),
                "draft_extend": self._draft_backend(factory, "create_draft_extend_backend"),
            }
        steps["speculative"] = info

    def _draft_backend(self, factory, method: str) -> dict:
        chosen: list[str] = []

        def tracer(frame, event, arg):
            name = frame.f_code.co_name
            if (
                event == "call"
                and name.startswith("_create_")
                and name.endswith("_backend")
                and name != "_create_backend"
            ):
                chosen.append(name)
            return None

        old = sys.gettrace()
        sys.settrace(tracer)
        try:
            result = getattr(factory, method)()
            error = None
        except Exception as exc:
            result, error = None, _error(exc)
        finally:
            sys.settrace(old)
        creator = chosen[0] if chosen else None
        backend = creator.removeprefix("_create_").rsplit("_", 2)[0] if creator else None
        if creator is None and error is None and result is None:
            return {"backend": None, "note": "no draft backend for this step (SGLang returns None)"}
        out = {"creator": creator, "backend": backend, "site": _definition_site(getattr(factory, method))}
        if creator is None and error is not None:
            out["error"] = error  # raised in the factory's own selection: the start-up error
        elif error is not None:
            out["construction"] = f"not observed: the backend's constructor needs the GPU ({error['type']})"
        return out

    def _all_reduce(self, sa, steps: dict) -> None:
        tp = int(sa.tp_size)
        info: dict = {
            "tp": tp,
            "disable_custom_all_reduce": bool(sa.disable_custom_all_reduce),
            "enable_torch_symm_mem": bool(getattr(sa, "enable_torch_symm_mem", False)),
            "enable_mscclpp": bool(getattr(sa, "enable_mscclpp", False)),
            "enable_flashinfer_allreduce_fusion": bool(getattr(sa, "enable_flashinfer_allreduce_fusion", False)),
        }
        import sglang.srt.distributed.parallel_state as ps

        dispatch = getattr(ps.GroupCoordinator, "all_reduce", None)
        info["dispatch_site"] = _definition_site(dispatch) if dispatch else None
        if tp > 1 and not sa.disable_custom_all_reduce:
            info["custom"] = self._custom_all_reduce(tp)
        steps["all_reduce"] = info
        pynccl = importlib.import_module("sglang.srt.distributed.device_communicators.pynccl_wrapper")
        library = getattr(pynccl, "find_nccl_library", None)
        found, error = _attempt(library) if library else (None, None)
        info["nccl_library"] = found if found else None
        if error:
            info["nccl_library_error"] = error

    def _custom_all_reduce(self, tp: int) -> dict:
        """CustomAllreduce.__init__ as SGLang runs it on rank 0, against a fake process group of `tp` ranks (torch's
        own test backend: collectives are no-ops) on one node. It stops at its first self-disabling check, or
        needs the GPUs (the P2P test) and is then not observed further."""
        import torch.distributed as dist

        ca_module = importlib.import_module("sglang.srt.distributed.device_communicators.custom_all_reduce")
        cls = ca_module.dispatch_custom_allreduce()
        if not dist.is_initialized():
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
        group = dist.new_group(list(range(tp)), backend="fake") if dist.get_world_size() != tp else dist.group.WORLD
        ca_module.in_the_same_node_as = lambda pg, source_rank=0: [True] * dist.get_world_size(pg)
        before = len(self.records.items)
        obj, error = _attempt(cls, group=group, device=0)
        said = [r for r in self.records.items[before:] if "llreduce" in r["message"] or "all_reduce" in r["message"]]
        out = {"class": cls.__name__, "class_site": _definition_site(cls)}
        if obj is not None:
            out["disabled"] = bool(getattr(obj, "disabled", True))
            out["log"] = said
            if out["disabled"] and said:
                out["why"] = said[-1]["message"]
                out["site"] = said[-1]["site"]
            elif out["disabled"]:
                out["why"] = "disabled without a message (custom all-reduce ops unavailable or world size 1)"
                out["site"] = out["class_site"]
        else:
            out["disabled"] = None
            out["not_observed"] = (
                "the NVLink check passed; the next step (the P2P access test) needs the GPUs"
                if error and error.get("site") and "custom_all_reduce" in (error.get("site") or "")
                else "construction needs the GPUs"
            )
            out["error"] = error
        return out

    def _flashinfer_jit(self, steps: dict) -> None:
        """The architectures FlashInfer's JIT compiles for on this device (its own CompilationContext)."""
        try:
            from flashinfer.compilation_context import CompilationContext
        except ImportError as exc:
            steps["flashinfer_jit"] = {"ok": False, "error": _error(exc)}
            return
        ctx, error = _attempt(CompilationContext)
        if ctx is None:
            steps["flashinfer_jit"] = {"ok": False, "error": error}
            return
        archs = sorted(f"{major}.{minor}" for major, minor in getattr(ctx, "TARGET_CUDA_ARCHS", set()))
        flags, flags_error = _attempt(ctx.get_nvcc_flags_list)
        steps["flashinfer_jit"] = {
            "ok": True,
            "target_archs": archs,
            "nvcc_flags": flags,
            "error": flags_error,
            "site": _definition_site(CompilationContext),
        }


def _assignment_site_module(module, name: str) -> str | None:
    filename = getattr(module, "__file__", None)
    if not filename:
        return None
    pattern = re.compile(rf"^\s*{re.escape(name)}\s*=")
    try:
        with open(filename, encoding="utf-8", errors="replace") as handle:
            sites = [n for n, line in enumerate(handle, 1) if pattern.match(line)]
    except OSError:
        return None
    return ", ".join(_site(filename, n) for n in sites) or None


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


# ------------------------------------------------------------------------------------------------ device view

DEVICE_PROBES = (
    "is_cuda", "is_hip", "get_device", "get_device_name", "get_device_sm", "get_device_memory_capacity",
    "is_hopper_with_cuda_12_3", "is_sm90_supported", "is_sm100_supported", "is_sm120_supported",
    "is_blackwell_supported", "is_flashinfer_available", "is_triton_kernels_available",
)  # fmt: skip


def _device_view() -> dict:
    """The device as SGLang's own probes see it (sglang/srt/utils/common.py): every capability decision in
    ServerArgs reads these, so equal answers mean equal choices."""
    import torch

    view: dict = {"torch.version.cuda": torch.version.cuda}
    try:
        view["torch.cuda.get_device_capability"] = list(torch.cuda.get_device_capability())
    except Exception as exc:
        view["torch.cuda.get_device_capability"] = {"error": _error(exc)}
    try:
        common = importlib.import_module("sglang.srt.utils.common")
    except Exception as exc:
        view["sglang.srt.utils.common"] = {"error": _error(exc)}
        return view
    for name in DEVICE_PROBES:
        fn = getattr(common, name, None)
        if fn is None:
            continue
        value, error = _attempt(fn)
        view[name] = _plain(value) if error is None else {"error": error}
    return view


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str]) -> int:
    job = json.loads(argv[1])
    device = job["device"]
    if device["mode"] == "simulated":
        _simulate_device(device)
    observer = Observer(device, job["requests"])
    result: dict = {"schema": SCHEMA, "versions": _versions(), "device": device, "observations": []}
    if device["mode"] == "real":
        result["real_device"] = _real_device()
    result["sglang_device_view"] = _device_view()
    try:
        import sgl_kernel

        result["sgl_kernel_ops"] = getattr(getattr(sgl_kernel, "common_ops", None), "__file__", None)
    except Exception as exc:  # reported: the plan says sgl-kernel cannot load
        result["sgl_kernel_error"] = _error(exc)
    for request in job["requests"]:
        try:
            result["observations"].append(observer.observe(request))
        except Exception as exc:  # one model's failure must not hide the others
            result["observations"].append({"id": request.get("id"), "crashed": _error(exc), "steps": {}})
    if job.get("speculate"):
        result["speculated"] = _speculate(observer, job["requests"], result["observations"], job["speculate"])
    # What the plans depended on outside the env (and the run's own folders): a verify reuses them only while
    # all of it is as it was, as it does the import checks' outcome.
    inside = [p for p in job.get("inside") or [] if isinstance(p, str) and p]
    result["loaded"] = loaded(inside)  # noqa: F821 (included)
    sys.stdout.write(MARKER + json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    return 0


def _leave(code: int) -> None:
    """Exit without the interpreter's teardown, ending the daemonic multiprocessing children a normal exit ends
    (they hold our stdout open, and the probe reads it to its end)."""
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is not None:
        for child in multiprocessing.active_children():
            if child.daemon:
                child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main(sys.argv)
    # The result is written; what is left is the interpreter's teardown, where torch.library's finalizers
    # unregister every op SGLang and its kernels registered (about 2 s on 2 cores), which the plan does not need.
    _leave(code)
