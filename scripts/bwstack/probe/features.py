"""Which SM120 features an installed SGLang + FlashInfer really has, read from the installed source files.

Standard library only: this module also runs on target hosts inside the verify probe. Nothing here imports
sglang, flashinfer or torch, and nothing maps version strings to answers: every answer comes from parsing the
files in site-packages (`ast` for Python, a line scan for one CUDA header) and carries `file:line` evidence,
so a patched, hand-edited or newer release is judged by what its code does.

`report(site_packages)` returns (keys are stable):
  target_capability             "12.0" (the parameter)
  packages                      {name: version or None} from dist-info METADATA
  torch_symm_mem_allreduce      {state, reason, evidence, tables}
                                state: available | unavailable | crashes | not-installed | unknown
  flashinfer_allreduce_fusion   {state, reason, evidence, blocked_by, sglang_gate, flashinfer_comm,
                                 kernel_guards}
                                state: available | unavailable | crashes | broken | not-installed | unknown
"""

from __future__ import annotations

import ast
import email.parser
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from bwstack.probe.treecheck import read_regular, read_text

AVAILABLE = "available"
UNAVAILABLE = "unavailable"
CRASHES = "crashes"
BROKEN = "broken"  # runs, but a kernel it needs is compiled out for the target: wrong results, no error
NOT_INSTALLED = "not-installed"
UNKNOWN = "unknown"  # the code moved and this reader cannot find it: update this module
# Capability majors on which a bwstack run has compared these features' results with a reference on real
# hardware. None yet: every AVAILABLE here is read from code and says so.
VALIDATED_MAJORS: tuple[int, ...] = ()

PACKAGES = ("sglang", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "sgl-kernel", "torch")

SYMM_MEM_FILE = "sglang/srt/distributed/device_communicators/torch_symm_mem.py"
SYMM_MEM_CLASS = "TorchSymmMemCommunicator"
SIZES_TABLE = "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES"
MULTIMEM_TABLE = "_WORLD_SIZES_MULTIMEM"

# The fusion gate moved over time; the reader tries these, then searches sglang/srt/layers for the names.
FUSION_GATES = (
    ("sglang/srt/layers/communicator.py", "apply_flashinfer_allreduce_fusion"),  # 0.5.x .. 0.5.20
    ("sglang/srt/layers/layer_boundary/residual/add_norm.py", "flashinfer_ar_fusion_applies"),  # 0.5.21+
)
SGLANG_UTILS = "sglang/srt/utils/common.py"
# _PLATFORM_PROBES there maps get_platform().is_sm90 to utils.common.is_sm90_supported (0.5.21+)
SGLANG_PLATFORM = "sglang/srt/runtime_context.py"
FLASHINFER_COMM = "flashinfer/jit/comm.py"
FLASHINFER_COMM_FUNC = "gen_trtllm_comm_module"
FLASHINFER_HEADER_DIRS = ("flashinfer/data/include/flashinfer/comm", "flashinfer/include/flashinfer/comm")
FUSION_HEADER = "trtllm_allreduce_fusion.cuh"  # the kernels behind sglang's trtllm_allreduce_fusion
ALLREDUCE_HEADER = "trtllm_allreduce.cuh"  # trtllm_custom_all_reduce and its lamport one-shot kernel


# ------------------------------------------------------------------------------------------------ helpers


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_versions(site_packages: Path, names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Version of each named distribution from its dist-info METADATA (None when absent)."""
    wanted = {_canonical(n): n for n in names}
    found: dict[str, str | None] = dict.fromkeys(names)
    for dist_info in sorted(Path(site_packages).glob("*.dist-info")):
        key = _canonical(dist_info.name.split("-", 1)[0])
        meta = read_text(dist_info / "METADATA") if key in wanted else None
        if meta is None:
            continue
        headers = email.parser.Parser().parsestr(meta, True)
        if _canonical(headers.get("Name", "")) == key:
            found[wanted[key]] = headers.get("Version")
    return found


def dist_version(site_packages: Path, name: str) -> str | None:
    return dist_versions(site_packages, (name,))[name]


class _Source:
    """One parsed Python file of the env: path relative to site-packages, text lines, AST."""

    def __init__(self, site_packages: Path, rel: str) -> None:
        self.rel = rel
        self.text = read_regular(Path(site_packages) / rel).decode("utf-8")
        self.lines = self.text.splitlines()
        self.tree = ast.parse(self.text, filename=rel)

    def at(self, node: ast.AST) -> str:
        line = getattr(node, "lineno", 0)
        return f"{self.rel}:{line}: {self.lines[line - 1].strip()}" if line else self.rel

    def module_value(self, name: str) -> ast.AST | None:
        """The value of a module-level `name = ...` (last assignment wins, as at import time)."""
        value = None
        for stmt in self.tree.body:
            if isinstance(stmt, ast.Assign):
                if any(_assigns(t, name) for t in stmt.targets):
                    value = stmt.value
            elif isinstance(stmt, ast.AnnAssign) and _assigns(stmt.target, name) and stmt.value is not None:
                value = stmt.value
        return value

    def function(self, name: str) -> ast.FunctionDef | None:
        for stmt in self.tree.body:
            if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
                return stmt
        return None

    def imported_from(self, name: str) -> str | None:
        """Path (relative to site-packages) of the module a top-level `from X import name` names."""
        for stmt in self.tree.body:
            if isinstance(stmt, ast.ImportFrom) and any(a.name == name for a in stmt.names):
                parts = (stmt.module or "").split(".") if stmt.module else []
                if stmt.level:
                    base = self.rel.split("/")[: -stmt.level]
                    parts = base + parts
                return "/".join(parts)
        return None


def _assigns(target: ast.AST, name: str) -> bool:
    return isinstance(target, ast.Name) and target.id == name


def _load(site_packages: Path, rel: str) -> _Source | None:
    path = Path(site_packages) / rel
    return _Source(site_packages, rel) if path.is_file() else None


def _module_file(site_packages: Path, module_path: str) -> str | None:
    for rel in (f"{module_path}.py", f"{module_path}/__init__.py"):
        if (Path(site_packages) / rel).is_file():
            return rel
    return None


def _int_keys(node: ast.AST | None) -> list[int] | None:
    if not isinstance(node, ast.Dict):
        return None
    keys = []
    for key in node.keys:
        if isinstance(key, ast.Constant) and isinstance(key.value, int):
            keys.append(key.value)
    return keys


def _parse_capability(target_capability: str) -> tuple[int, int]:
    major, _, minor = target_capability.partition(".")
    return int(major), int(minor or 0)


# ------------------------------------------------------------------------------------------------ symm mem


class _Table:
    def __init__(self, name: str, src: _Source, node: ast.AST) -> None:
        self.name = name
        self.src = src
        self.node = node
        self.keys = _int_keys(node) or []

    def evidence(self) -> str:
        return f"{self.src.rel}:{self.node.lineno}: {self.name} keys {self.keys}"


def _is_table_ref(node: ast.AST, name: str) -> bool:
    return (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute) and node.attr == name)


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _lookup_sites(src: _Source, table: str) -> list[tuple[str, ast.AST, bool]]:
    """(kind, node, guarded): `index` for table[...] (KeyError on a missing key), `get` for table.get(...).

    An index site counts as guarded when its function also tests membership in the table itself
    (`x in table` / `x not in table`); a test on `table[x]` guards nothing.
    """
    sites = []
    for func in _functions(src.tree):
        guarded = any(
            isinstance(n, ast.Compare)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops)
            and any(_is_table_ref(c, table) for c in n.comparators)
            for n in ast.walk(func)
        )
        for node in ast.walk(func):
            if isinstance(node, ast.Subscript) and _is_table_ref(node.value, table):
                if not isinstance(node.slice, ast.Constant):
                    sites.append(("index", node, guarded))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and _is_table_ref(node.func.value, table)
            ):
                sites.append(("get", node, True))
    return sites


def _symm_mem(site_packages: Path, major: int, version: str | None) -> dict:
    base = {"state": NOT_INSTALLED, "reason": "", "evidence": []}
    if version is None:
        return base | {"reason": "sglang is not installed in this env"}
    src = _load(site_packages, SYMM_MEM_FILE)
    if src is None:
        return base | {
            "state": UNAVAILABLE,
            "reason": f"sglang {version} has no TorchSymmMemCommunicator ({SYMM_MEM_FILE} is absent)",
        }
    cls = next((n for n in src.tree.body if isinstance(n, ast.ClassDef) and n.name == SYMM_MEM_CLASS), None)
    multimem = None
    if cls is not None:
        for stmt in cls.body:
            if isinstance(stmt, ast.Assign) and any(_assigns(t, MULTIMEM_TABLE) for t in stmt.targets):
                multimem = _Table(f"{SYMM_MEM_CLASS}.{MULTIMEM_TABLE}", src, stmt.value)
    sizes = None
    value = src.module_value(SIZES_TABLE)
    if value is not None:
        sizes = _Table(SIZES_TABLE, src, value)
    else:
        module = src.imported_from(SIZES_TABLE)
        rel = _module_file(site_packages, module) if module else None
        other = _load(site_packages, rel) if rel else None
        value = other.module_value(SIZES_TABLE) if other else None
        if other is not None and value is not None:
            sizes = _Table(SIZES_TABLE, other, value)
    if sizes is None or multimem is None:
        missing = SIZES_TABLE if sizes is None else f"{SYMM_MEM_CLASS}.{MULTIMEM_TABLE}"
        return base | {
            "state": UNKNOWN,
            "reason": f"cannot find {missing} in sglang {version}; bwstack.probe.features needs updating",
        }

    evidence = [sizes.evidence(), multimem.evidence()]
    crash_sites, get_sites = [], []
    for table in (sizes, multimem):
        for kind, node, guarded in _lookup_sites(src, table.name.rsplit(".", 1)[-1]):
            if kind == "get":
                get_sites.append(src.at(node))
            elif not guarded and major not in table.keys:
                crash_sites.append(node)
    evidence += [src.at(n) for n in crash_sites] + get_sites

    multicast = next(
        (
            n
            for n in ast.walk(src.tree)
            if isinstance(n, ast.Compare)
            and isinstance(n.left, ast.Attribute)
            and n.left.attr == "multicast_ptr"
            and any(isinstance(c, ast.Constant) and c.value == 0 for c in n.comparators)
        ),
        None,
    )
    if multicast is not None:
        evidence.append(src.at(multicast))
        check = src.lines[multicast.lineno - 1].strip()
        pcie = (
            "On PCIe cards without NVLink multicast (e.g. RTX PRO 6000 / RTX 5090) the communicator still "
            f"disables itself at run time: {src.rel}:{multicast.lineno} `{check}`"
            " logs that multicast is not supported and sets disabled = True, so all-reduce falls back to "
            "custom all-reduce / NCCL."
        )
    else:
        pcie = "No multicast_ptr check found: whether PCIe cards without NVLink multicast work is not known."
    reached = "Reached only with --enable-torch-symm-mem and tensor parallelism > 1."

    has_sizes, has_multimem = major in sizes.keys, major in multimem.keys
    if crash_sites:
        where = ", ".join(f"{src.rel}:{n.lineno}" for n in crash_sites)
        missing = [t.name for t in (sizes, multimem) if major not in t.keys]
        state = CRASHES
        reason = (
            f"KeyError: {major} in sglang {version}: {' and '.join(missing)} have no key {major} and are "
            f"indexed with the GPU's capability major at {where}."
        )
    elif has_sizes and has_multimem:
        state = AVAILABLE
        reason = f"capability {major} is in {SIZES_TABLE} and {multimem.name} (sglang {version})."
    elif has_sizes:
        state = AVAILABLE
        reason = (
            f"capability {major} is in {SIZES_TABLE}; {MULTIMEM_TABLE} lacks it and is read with .get(), so "
            f"only the two-shot kernel is used (sglang {version})."
        )
    else:
        state = UNAVAILABLE
        reason = (
            f"sglang {version} has no capability {major} in {SIZES_TABLE} and looks it up with .get(): the "
            f"communicator logs 'Device capability {major} not supported' and disables itself (no crash)."
        )
    return {
        "state": state,
        "reason": f"{reason} {reached} {pcie}",
        "evidence": evidence,
        "tables": {sizes.name: sizes.keys, f"{SYMM_MEM_CLASS}.{MULTIMEM_TABLE}": multimem.keys},
    }


# ------------------------------------------------------------------------------------------------ fusion gate


class _Arch:
    """What one capability check in sglang admits, resolved to its definition where possible."""

    def __init__(self, term: str, probe: str, majors: list[int] | None, where: str) -> None:
        self.term, self.probe, self.majors, self.where = term, probe, majors, where

    def as_dict(self) -> dict:
        return {"term": self.term, "resolves_to": self.probe, "majors": self.majors, "where": self.where}


_SM_NAME = re.compile(r"^_?is_sm(\d+)(?:_supported)?$")


class _GateReader:
    """Evaluates a gate expression in three-valued logic for one capability major.

    Capability checks (`is_smXX_supported()` and what is assigned from it) evaluate to True/False; everything
    else (flags, batch sizes, whether flashinfer imports) is unknown (None). The gate admits the major unless
    the expression is definitely False.
    """

    def __init__(self, site_packages: Path, gate: _Source) -> None:
        self.sp = site_packages
        self.gate = gate
        self.arch: dict[str, _Arch] = {}
        self._utils = _load(site_packages, SGLANG_UTILS)
        self._platform = _load(site_packages, SGLANG_PLATFORM)

    def evaluate(self, node: ast.AST, major: int, depth: int = 0) -> bool | None:
        if depth > 8:
            return None
        if isinstance(node, ast.BoolOp):
            values = [self.evaluate(v, major, depth + 1) for v in node.values]
            if isinstance(node.op, ast.And):
                return False if False in values else (True if all(v is True for v in values) else None)
            return True if True in values else (False if all(v is False for v in values) else None)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            value = self.evaluate(node.operand, major, depth + 1)
            return None if value is None else not value
        if isinstance(node, ast.Constant) and isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name):
            arch = self._resolve_name(node.id)
            if arch is not None:
                return None if arch.majors is None else major in arch.majors
            value = self.gate.module_value(node.id)
            return None if value is None else self.evaluate(value, major, depth + 1)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            arch = self._resolve_probe(node.func.id, node.func.id)
            return None if arch is None or arch.majors is None else major in arch.majors
        if isinstance(node, ast.Attribute) and node.attr.startswith("is_sm"):  # get_platform().is_sm90
            arch = self._resolve_platform(node.attr)
            return None if arch is None or arch.majors is None else major in arch.majors
        return None

    def _resolve_name(self, name: str) -> _Arch | None:
        """A module-level `_is_sm90_supported = ...` is an arch term; record what its value resolves to."""
        if not _SM_NAME.match(name) or not name.startswith("_"):
            return None
        if name in self.arch:
            return self.arch[name]
        value = self.gate.module_value(name)
        probes: list[_Arch] = []
        for sub in ast.walk(value) if value is not None else ():
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and _SM_NAME.match(sub.func.id):
                probes.append(self._resolve_probe(sub.func.id, name))
            elif isinstance(sub, ast.Attribute) and _SM_NAME.match(sub.attr):
                probes.append(self._resolve_platform(sub.attr, name))
        probes = [p for p in probes if p is not None]
        if len(probes) == 1:
            arch = probes[0]
            arch.where = f"{self.gate.at(value)} -> {arch.where}"
        else:
            arch = _Arch(name, name, _majors_from_name(name), f"{self.gate.rel}: inferred from the name")
        self.arch[name] = arch
        return arch

    def _resolve_probe(self, func: str, term: str) -> _Arch | None:
        if not _SM_NAME.match(func):
            return None
        for src in self._probe_sources(func):
            value = src.module_value(func)
            nodes = [value] if value is not None else []
            fdef = src.function(func)
            if fdef is not None:
                nodes.append(fdef)
            for node in nodes:
                for sub in ast.walk(node):
                    if isinstance(sub, ast.keyword) and sub.arg == "device_capability_majors":
                        try:
                            majors = list(ast.literal_eval(sub.value))
                        except ValueError:
                            continue
                        where = f"{src.rel}:{sub.value.lineno}: {func} majors {majors}"
                        return _Arch(term, func, majors, where)
        where = f"{func}: definition not found, inferred from the name"
        return _Arch(term, func, _majors_from_name(func), where)

    def _probe_sources(self, func: str) -> list[_Source]:
        sources = []
        module = self.gate.imported_from(func)
        rel = _module_file(self.sp, module) if module else None
        if rel and rel != SGLANG_UTILS:
            src = _load(self.sp, rel)
            if src is not None:
                sources.append(src)
        if self._utils is not None:
            sources.append(self._utils)
        return sources

    def _resolve_platform(self, attr: str, term: str | None = None) -> _Arch | None:
        probes = self._platform.module_value("_PLATFORM_PROBES") if self._platform else None
        if isinstance(probes, ast.Dict):
            for key, value in zip(probes.keys, probes.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == attr and isinstance(value, ast.Constant):
                    arch = self._resolve_probe(value.value, term or attr)
                    if arch is not None:
                        arch.where = f"{self._platform.at(key)} -> {arch.where}"
                    return arch
        return _Arch(term or attr, attr, _majors_from_name(attr), f"{attr}: platform probe not found")


def _majors_from_name(name: str) -> list[int] | None:
    match = _SM_NAME.match(name)
    return [int(match.group(1)) // 10] if match else None


def _find_gate(site_packages: Path) -> tuple[_Source, ast.FunctionDef] | None:
    def search(rels: list[str]) -> tuple[_Source, ast.FunctionDef] | None:
        for rel in rels:
            src = _load(site_packages, rel)
            for name in names if src is not None else ():
                func = src.function(name)
                if func is not None:
                    return src, func
        return None

    names = [func for _, func in FUSION_GATES]
    found = search([rel for rel, _ in FUSION_GATES])
    layers = Path(site_packages) / "sglang/srt/layers"
    if found is None and layers.is_dir():  # moved again: look for the known names anywhere under layers/
        rels = []
        for path in sorted(layers.rglob("*.py")):
            text = read_text(path) or ""
            if any(f"def {name}(" in text for name in names):
                rels.append(path.relative_to(site_packages).as_posix())
        found = search(rels)
    return found


def _gate_expression(func: ast.FunctionDef) -> ast.AST | None:
    returns = [n for n in ast.walk(func) if isinstance(n, ast.Return) and n.value is not None]
    return returns[0].value if len(returns) == 1 else None


def _arch_clause(src: _Source, expr: ast.AST, reader: _GateReader) -> str:
    """Source text of the conjunct that holds the capability terms (for the reason line)."""
    parts = expr.values if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.And) else [expr]
    for part in parts:
        names = {n.id for n in ast.walk(part) if isinstance(n, ast.Name)}
        if any(name in reader.arch for name in names):
            return f"{src.rel}:{part.lineno} `{ast.get_source_segment(src.text, part)}`"
    return f"{src.rel}:{expr.lineno}"


def _flashinfer_comm(site_packages: Path, major: int) -> dict | None:
    src = _load(site_packages, FLASHINFER_COMM)
    func = src.function(FLASHINFER_COMM_FUNC) if src else None
    if func is None:
        return None
    for node in ast.walk(func):
        if isinstance(node, ast.keyword) and node.arg == "supported_major_versions":
            majors = list(ast.literal_eval(node.value))
            return {
                "file": src.rel,
                "line": node.value.lineno,
                "function": FLASHINFER_COMM_FUNC,
                "supported_major_versions": majors,
                "admits": major in majors,
                "evidence": src.at(node.value),
            }
    return None


_ARCH_LOWER = re.compile(r"__CUDA_ARCH__\s*(>=?)\s*(\d+)")
_ARCH_UPPER = re.compile(r"__CUDA_ARCH__\s*(<=?)\s*(\d+)")
_KERNEL = re.compile(r"__global__\s+void\s+(\w+)")


def _excludes(line: str, arch: int) -> bool:
    """An `#if` that compiles a block for some modern arch (a lower bound at or below `arch`) but not `arch`.

    `#if __CUDA_ARCH__ < 800` alone is a legacy-GPU branch, not an exclusion: it has no lower bound.
    """
    lower = [int(b) + (op == ">") for op, b in _ARCH_LOWER.findall(line)]
    upper = [int(b) - (op == "<") for op, b in _ARCH_UPPER.findall(line)]
    return bool(lower and upper) and max(lower) <= arch and min(upper) < arch


def _header_guards(site_packages: Path, header: str, arch: int) -> dict | None:
    """`#if` lines in a FlashInfer comm header that compile code for SM90-class GPUs but not for `arch`."""
    sp = Path(site_packages)
    path = next((sp / d / header for d in FLASHINFER_HEADER_DIRS if (sp / d / header).is_file()), None)
    if path is None:
        return None
    lines = (read_text(path) or "").splitlines()
    excluded, empty_kernels = [], []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("#if") and _excludes(line, arch):
            excluded.append(i + 1)
            # a guard right after `__global__ void name(...) {` makes the whole kernel body empty
            head = " ".join(lines[max(0, i - 3) : i])
            kernel = _KERNEL.findall(head)
            if kernel and head.rstrip().endswith("{"):
                empty_kernels.append(f"{kernel[-1]} (line {i + 1})")
    return {
        "file": path.relative_to(sp).as_posix(),
        "excluding_lines": excluded,
        "empty_kernels": empty_kernels,
        "excludes_target": bool(excluded),
    }


def _fusion(site_packages: Path, major: int, minor: int, versions: dict[str, str | None]) -> dict:
    sg, fi = versions.get("sglang"), versions.get("flashinfer-python")
    base: dict = {"state": NOT_INSTALLED, "reason": "", "evidence": [], "blocked_by": []}
    if sg is None:
        return base | {"reason": "sglang is not installed in this env"}
    found = _find_gate(site_packages)
    expr = _gate_expression(found[1]) if found else None
    if found is None or expr is None:
        return base | {
            "state": UNKNOWN,
            "reason": f"cannot find sglang {sg}'s FlashInfer all-reduce fusion gate; update bwstack.probe.features",
        }
    src, func = found
    reader = _GateReader(site_packages, src)
    admits = reader.evaluate(expr, major) is not False
    terms = sorted(reader.arch.values(), key=lambda a: a.term)
    candidates = sorted({m for a in terms for m in a.majors or []} | {major})
    admitted = [m for m in candidates if reader.evaluate(expr, m) is not False]
    gate = {
        "file": src.rel,
        "line": func.lineno,
        "function": func.name,
        "arch_terms": [a.as_dict() for a in terms],
        "admitted_majors": admitted,
        "admits": admits,
    }
    evidence = [f"{src.rel}:{func.lineno}: def {func.name}", _arch_clause(src, expr, reader)]
    evidence += [a.where for a in terms]
    gate_text = (
        f"sglang {sg} gates fusion to {'/'.join(f'SM{m}0' for m in admitted) or 'no GPU'} "
        f"({_arch_clause(src, expr, reader)})"
    )

    comm = _flashinfer_comm(site_packages, major) if fi else None
    arch = major * 100 + minor * 10
    headers = (ALLREDUCE_HEADER, FUSION_HEADER) if fi else ()
    guards = {h: _header_guards(site_packages, h, arch) for h in headers}
    out = base | {"sglang_gate": gate, "flashinfer_comm": comm, "kernel_guards": guards}
    if comm is not None:
        evidence.append(comm["evidence"])
    for g in guards.values():
        if g and g["excluding_lines"]:
            lines = ",".join(map(str, g["excluding_lines"]))
            evidence.append(f"{g['file']}:{lines}: `#if` guards that compile SM{major}{minor} out")

    if fi is None:
        comm_text, comm_admits = "flashinfer-python is not installed", False
    elif comm is None:
        comm_text = f"cannot find {FLASHINFER_COMM}::{FLASHINFER_COMM_FUNC} in FlashInfer {fi}"
        comm_admits = None
    else:
        comm_admits = comm["admits"]
        comm_text = (
            f"FlashInfer {fi}'s comm module supports {comm['supported_major_versions']} "
            f"({comm['file']}:{comm['line']} {FLASHINFER_COMM_FUNC})"
        )
    blocked = (["sglang-gate"] if not admits else []) + (["flashinfer-comm"] if comm_admits is False else [])
    lamport = guards.get(ALLREDUCE_HEADER)
    caveat = ""
    if lamport and lamport["empty_kernels"]:
        caveat = (
            f" FlashInfer {fi}'s {ALLREDUCE_HEADER} compiles {', '.join(lamport['empty_kernels'])} with an "
            f"empty body for SM{major}{minor} (`__CUDA_ARCH__ < {arch}`): a wider list alone is not enough."
        )
    flag = "--enable-flashinfer-allreduce-fusion"
    if not admits:
        joint = ", which blocks it although" if comm_admits else " and"
        state = UNAVAILABLE
        reason = f"{gate_text}{joint} {comm_text}; {flag} is a silent no-op on SM{major}{minor}.{caveat}"
    elif fi is None:
        state, reason = UNAVAILABLE, f"{gate_text.replace('gates', 'admits')}, but {comm_text}."
    elif comm_admits is None:
        state, reason = UNKNOWN, f"sglang {sg} admits SM{major}{minor}, but {comm_text}."
    elif not comm_admits:
        majors = comm["supported_major_versions"]
        state = CRASHES
        reason = (
            f"sglang {sg} admits SM{major}{minor} but {comm_text}: building the trtllm_comm module raises "
            f"RuntimeError: No supported CUDA architectures found for major versions {majors}."
        )
    else:
        # Whatever gate or list was widened: kernels compiled empty (or with their synchronisation compiled
        # out) for this architecture run, do nothing and return garbage. Never AVAILABLE.
        compiled_out = [g for g in guards.values() if g and g["excludes_target"]]
        if compiled_out:
            state = BROKEN
            where = "; ".join(f"{g['file']} lines {g['excluding_lines']}" for g in compiled_out)
            reason = (
                f"sglang {sg} and {comm_text} admit SM{major}{minor}, but FlashInfer {fi} compiles kernel code "
                f"out for it ({where}):{caveat or ' '} wrong results, no error."
            ).replace(":  ", ": ")
        else:
            state = AVAILABLE
            reason = f"sglang {sg} and {comm_text} both admit SM{major}{minor}."
    return out | {"state": state, "reason": reason, "evidence": evidence, "blocked_by": blocked}


# ------------------------------------------------------------------------------------------------ report


def report(site_packages: Path, target_capability: str = "12.0") -> dict:
    """The SM feature truth of the env whose purelib is `site_packages`, for GPUs of `target_capability`."""
    site_packages = Path(site_packages)
    major, minor = _parse_capability(target_capability)
    versions = dist_versions(site_packages)
    return {
        "target_capability": target_capability,
        "site_packages": str(site_packages),
        "packages": versions,
        "torch_symm_mem_allreduce": _unvalidated(_guarded(_symm_mem, site_packages, major, versions["sglang"]), major),
        "flashinfer_allreduce_fusion": _unvalidated(_guarded(_fusion, site_packages, major, minor, versions), major),
    }


def _unvalidated(result: dict, major: int) -> dict:
    """Every state here is read from code, not measured. An AVAILABLE one on a capability that no bwstack
    check has run on says so: the code path exists; nobody has shown here that it gives right results."""
    validated = major in VALIDATED_MAJORS
    result["validated_on_hardware"] = validated
    if result.get("state") == AVAILABLE and not validated:
        result["reason"] += (
            f" Read from the installed code; not validated on SM{major}x hardware (no bwstack run has compared "
            "its results with NCCL on such a GPU)."
        )
    return result


def _guarded(check: Callable[..., dict], *args: object) -> dict:
    """One unreadable file (syntax newer than this Python, bad encoding) makes that feature unknown, not the
    whole probe fail."""
    try:
        return check(*args)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError) as exc:
        return {"state": UNKNOWN, "reason": f"cannot read the installed sources: {exc}", "evidence": []}


def states(result: dict) -> dict[str, str]:
    """{feature: state} of a report, the shape the lock's `expect.features` uses."""
    return {k: v["state"] for k, v in result.items() if isinstance(v, dict) and "state" in v}
