"""Static "ldd -r" for shared libraries: DT_NEEDED, RPATH, dynamic symbols and the torch ABI check.

Reads the files with probe.elfread (headers and the few sections asked for; the symbol tables in bulk with
struct); nothing is loaded or executed, so it works on a box without GPU or driver.
Standard library only: this module also runs on target hosts inside the verify probe.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import shutil
import struct
import subprocess
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from bwstack.probe import elfread

ELF_MAGIC = elfread.ELF_MAGIC
_TORCH_NS = re.compile(r"(?<![0-9])(?:3c10|2at|5torch|6caffe2)")  # mangled c10::, at::, torch::, caffe2::
# torch's own libraries (libtorchaudio, libtorchcodec_* are other packages' and live beside them)
_TORCH_LIB = re.compile(r"^lib(?:c10(?:_cuda)?|torch(?:_cpu|_cuda|_cuda_linalg|_python|_global_deps|_nvshmem)?)\.so$")
_BINDINGS = {0: "LOCAL", 1: "GLOBAL", 2: "WEAK", 10: "UNIQUE"}
_TYPES = {0: "NOTYPE", 1: "OBJECT", 2: "FUNC", 3: "SECTION", 4: "FILE", 5: "COMMON", 6: "TLS", 10: "IFUNC"}
_DEFAULT_DIRS = ("/lib64", "/usr/lib64", "/lib", "/usr/lib")
_LDCONFIG_ARCH = {"x86_64": "x86-64", "aarch64": "AArch64", "ppc64le": "64bit", "s390x": "64bit"}
_DT_NEEDED, _DT_SONAME, _DT_RPATH, _DT_RUNPATH = 1, 14, 15, 29


class NotElfError(ValueError):
    """The file exists but is not an ELF object."""


def check_elf(path: str | os.PathLike[str]) -> None:
    """Raise NotElfError unless ``path`` is a regular file that starts with the ELF magic (FileNotFoundError if
    it is absent; a FIFO or a device named like a library is not read)."""
    try:
        fh = elfread.open_regular(path)
    except elfread.CorruptElf as exc:
        raise NotElfError(str(exc)) from exc
    with fh:
        head = fh.read(4)
    if head != ELF_MAGIC:
        raise NotElfError(f"{path}: not an ELF file (starts with {head!r})")


@contextmanager
def open_elf(path: str | os.PathLike[str]) -> Iterator[elfread.ElfFile]:
    """The file's headers (probe.elfread); a non-ELF or corrupt file raises NotElfError (also from the body)."""
    check_elf(path)
    try:
        with elfread.open_elf(path) as elf:
            yield elf
    except elfread.CorruptElf as exc:
        raise NotElfError(f"{path}: unreadable ELF file ({exc})") from exc


# ------------------------------------------------------------------------------------- dynamic section


@dataclass(frozen=True)
class DynamicInfo:
    path: str
    soname: str | None
    needed: tuple[str, ...]
    rpath: tuple[str, ...]  # DT_RPATH entries, $ORIGIN expanded
    runpath: tuple[str, ...]  # DT_RUNPATH entries, $ORIGIN expanded
    ident: bytes  # EI_CLASS, EI_DATA and e_machine: what the loader checks before accepting a candidate


def expand_origin(entry: str, origin: str) -> str:
    """Replace $ORIGIN / ${ORIGIN} with the object's directory and normalise the result."""
    expanded = entry.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
    return os.path.normpath(expanded) if expanded else origin


def _key(path: str | os.PathLike[str]) -> tuple[str, int, int]:
    """Cache key: the absolute path plus mtime and size, so a rebuilt file is read again."""
    path = os.path.abspath(path)
    st = os.stat(path)
    return path, st.st_mtime_ns, st.st_size


@lru_cache(maxsize=512)
def _dynamic_info(key: tuple[str, int, int]) -> DynamicInfo:
    path = key[0]
    origin = os.path.dirname(path)
    soname: str | None = None
    needed: list[str] = []
    rpath: list[str] = []
    runpath: list[str] = []
    with open_elf(path) as elf:
        ident = _ident(elf)
        entries, strings = elf.dynamic_entries()
        for tag, value in entries:
            if tag == _DT_NEEDED:
                needed.append(strings.at(value))
            elif tag == _DT_SONAME:  # one value per tag to ld.so: the last entry of a tag counts
                soname = strings.at(value)
            elif tag == _DT_RPATH:
                rpath = [expand_origin(p, origin) for p in strings.at(value).split(":") if p]
            elif tag == _DT_RUNPATH:
                runpath = [expand_origin(p, origin) for p in strings.at(value).split(":") if p]
    return DynamicInfo(path, soname, tuple(needed), tuple(rpath), tuple(runpath), ident)


def _ident(elf: elfread.ElfFile) -> bytes:
    return bytes([elf.elfclass, 1 if elf.little_endian else 2]) + elf.machine.to_bytes(2, "little")


def dynamic_info(path: str | os.PathLike[str]) -> DynamicInfo:
    return _dynamic_info(_key(path))


def needed(path: str | os.PathLike[str]) -> list[str]:
    """DT_NEEDED entries, in order."""
    return list(dynamic_info(path).needed)


def soname(path: str | os.PathLike[str]) -> str | None:
    return dynamic_info(path).soname


def rpaths(path: str | os.PathLike[str]) -> list[str]:
    """DT_RPATH then DT_RUNPATH directories, with $ORIGIN expanded to the file's directory."""
    info = dynamic_info(path)
    return [*info.rpath, *info.runpath]


# ------------------------------------------------------------------------------------- dynamic symbols


@dataclass(frozen=True)
class Symbol:
    name: str
    version: str | None  # GLIBC_2.27, or None when unversioned (or the base version)
    binding: str  # GLOBAL, WEAK, UNIQUE, LOCAL
    type: str  # FUNC, OBJECT, ...
    defined: bool
    visibility: str  # DEFAULT, PROTECTED, HIDDEN, INTERNAL

    @property
    def weak(self) -> bool:
        return self.binding == "WEAK"

    def __str__(self) -> str:
        return f"{self.name}@{self.version}" if self.version else self.name


_VISIBILITY = ("DEFAULT", "INTERNAL", "HIDDEN", "PROTECTED")


@lru_cache(maxsize=32)
def _dynamic_symbols(key: tuple[str, int, int]) -> tuple[Symbol, ...]:
    path = key[0]
    with open_elf(path) as elf:  # everything read inside: a corrupt table is NotElfError, whichever part lies
        dynsym = elf.first(elfread.SHT_DYNSYM)
        if dynsym is None:
            return ()
        strings = elfread.Strings(elf.data(elf.section(dynsym.link)))
        endian = elf.endian
        if elf.elfclass == 64:  # name, info, other, shndx, value, size
            fmt = endian + "IBBHQQ"
            table = struct.iter_unpack(fmt, elfread.whole_entries(elf.data(dynsym), fmt))
            rows = [(n, i, o, s) for n, i, o, s, _v, _z in table]
        else:  # name, value, size, info, other, shndx
            fmt = endian + "IIIBBH"
            table = struct.iter_unpack(fmt, elfread.whole_entries(elf.data(dynsym), fmt))
            rows = [(n, i, o, s) for n, _v, _z, i, o, s in table]
        versym, names = _versions(elf, len(rows))
        out: list[Symbol] = []
        for index, (name_off, info, other, shndx) in enumerate(rows):
            if not name_off:
                continue
            version = names.get(versym[index] & 0x7FFF) if index < len(versym) else None
            out.append(
                Symbol(
                    name=strings.at(name_off),
                    version=version,
                    binding=_BINDINGS.get(info >> 4, str(info >> 4)),
                    type=_TYPES.get(info & 0xF, str(info & 0xF)),
                    defined=shndx != 0,
                    visibility=_VISIBILITY[other & 3],
                )
            )
    return tuple(out)


def _versions(elf: elfread.ElfFile, symbols: int) -> tuple[tuple[int, ...], dict[int, str]]:
    """The .gnu.version array (one entry per dynamic symbol; more would index nothing) and the index ->
    version-name map (defined and needed versions)."""
    versym: tuple[int, ...] = ()
    names: dict[int, str] = {}
    endian = elf.endian
    section = elf.only(elfread.SHT_GNU_VERSYM)
    if section is not None:
        data = elfread.whole_entries(elf.data(section)[: 2 * symbols], "H")
        versym = struct.unpack(f"{endian}{len(data) // 2}H", data)
    section = elf.only(elfread.SHT_GNU_VERDEF)
    if section is not None:
        walk = _VersionWalk(elf.data(section))
        strings = elfread.Strings(elf.data(elf.section(section.link)))
        for at in walk.chain(section.info, endian + "HHHHIII", 6):
            _version, flags, index, _count, _hash, aux, _next = struct.unpack_from(endian + "HHHHIII", walk.data, at)
            if not flags & 1:  # VER_FLG_BASE names the file itself, not a version
                (name, _) = struct.unpack_from(endian + "II", walk.data, walk.inside(at + aux, 8))
                names[index] = strings.at(name)
    section = elf.only(elfread.SHT_GNU_VERNEED)
    if section is not None:
        walk = _VersionWalk(elf.data(section))
        strings = elfread.Strings(elf.data(elf.section(section.link)))
        for at in walk.chain(section.info, endian + "HHIII", 4):
            _version, count, _file, aux, _next = struct.unpack_from(endian + "HHIII", walk.data, at)
            for entry in walk.chain(count, endian + "IHHII", 4, start=at + aux):
                _hash, _flags, other, name, _n = struct.unpack_from(endian + "IHHII", walk.data, entry)
                names[other] = strings.at(name)
    return versym, names


class _VersionWalk:
    """The entries of one version section, visited through their `next` links. Entries never overlap in a real
    file, so a link shorter than an entry, one that leaves the section, or more entries in all (every chain
    together) than the section could hold side by side is corrupt: no count or link read from the file is
    trusted, and chains that share entries cannot multiply the work."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._left = len(data) // 8 + 1  # the smallest entry (a definition's name) is 8 bytes

    def inside(self, at: int, size: int) -> int:
        if not 0 <= at <= len(self.data) - size:
            raise elfread.CorruptElf(f"a version entry at offset {at} lies outside its {len(self.data)} bytes")
        return at

    def chain(self, count: int, fmt: str, next_field: int, start: int = 0) -> Iterator[int]:
        size = struct.calcsize(fmt)
        at = start
        for _ in range(count):
            self._left -= 1
            if self._left < 0:
                raise elfread.CorruptElf(f"more version entries than {len(self.data)} bytes hold")
            yield self.inside(at, size)
            step = struct.unpack_from(fmt, self.data, at)[next_field]
            if step == 0:
                return
            if step < size:
                raise elfread.CorruptElf(f"version entries overlap at offset {at}")
            at += step


def undefined_symbols(path: str | os.PathLike[str]) -> list[Symbol]:
    """Symbols the file imports (SHN_UNDEF); weak ones (``.weak``) may stay unresolved at load time."""
    return [s for s in _dynamic_symbols(_key(path)) if not s.defined and s.binding != "LOCAL"]


def exported_symbols(path: str | os.PathLike[str]) -> list[Symbol]:
    """Defined GLOBAL/WEAK/UNIQUE symbols of default or protected visibility: what others can bind to."""
    return [
        s
        for s in _dynamic_symbols(_key(path))
        if s.defined
        and s.binding != "LOCAL"
        and s.visibility in ("DEFAULT", "PROTECTED")
        and s.type not in ("SECTION", "FILE")
    ]


def is_torch_symbol(mangled: str) -> bool:
    """A mangled C++ name in the c10::, at::, torch:: or caffe2:: namespace (anywhere in the signature)."""
    return mangled.startswith("_Z") and _TORCH_NS.search(mangled) is not None


def demangle(names: Sequence[str]) -> list[str]:
    """Demangle with c++filt in one batch; the names unchanged if c++filt is missing or fails."""
    tool = shutil.which("c++filt")
    if not names or tool is None:
        return list(names)
    try:
        proc = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return list(names)
    lines = proc.stdout.splitlines()
    return lines if proc.returncode == 0 and len(lines) == len(names) else list(names)


def cxx11_abi(path: str | os.PathLike[str]) -> bool | None:
    """True if the file's dynamic symbols use ``std::__cxx11`` types (built with _GLIBCXX_USE_CXX11_ABI=1),
    False if they use the old COW ``std::string`` (``Ss``) instead, None if neither shows (no C++ strings)."""
    old = False
    for sym in _dynamic_symbols(_key(path)):
        if not sym.name.startswith("_Z"):
            continue
        if "St7__cxx11" in sym.name:
            return True
        old = old or re.search(r"(?:^_ZNK?|[RKPIN])Ss", sym.name) is not None
    return False if old else None


# ------------------------------------------------------------------------------------ loader emulation


def system_library_dirs() -> list[str]:
    """The directories the dynamic loader searches last: those in the ld.so cache (``ldconfig -p``, entries of
    this machine's architecture), else those listed in /etc/ld.so.conf (with includes); then the built-in
    defaults (/lib64, /usr/lib64, /lib, /usr/lib) that exist."""
    dirs = _ldconfig_dirs() or _ld_so_conf_dirs("/etc/ld.so.conf", set())
    dirs += [d for d in _DEFAULT_DIRS if os.path.isdir(d)]
    return list(dict.fromkeys(os.path.normpath(d) for d in dirs))


def _ldconfig_dirs() -> list[str]:
    tool = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None
    )
    if tool is None:
        return []
    try:
        text = subprocess.run([tool, "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    arch = _LDCONFIG_ARCH.get(platform.machine())
    dirs: list[str] = []
    for line in text.splitlines():
        tags, sep, target = line.partition(" => ")
        if sep and (arch is None or arch in tags):
            dirs.append(os.path.dirname(target.strip()))
    return list(dict.fromkeys(dirs))


def _ld_so_conf_dirs(conf: str, seen: set[str]) -> list[str]:
    if conf in seen or not os.path.isfile(conf):
        return []
    seen.add(conf)
    dirs: list[str] = []
    with open(conf, encoding="utf-8", errors="replace") as fh:
        for raw in fh:
            line = raw.split("#", 1)[0].strip()
            if line.startswith("include"):
                for pattern in line.split()[1:]:
                    pattern = os.path.join(os.path.dirname(conf), pattern)
                    for inc in sorted(glob.glob(pattern)):
                        dirs += _ld_so_conf_dirs(inc, seen)
            elif line:
                dirs.append(line)
    return dirs


def _compatible(candidate: str, ident: bytes) -> bool:
    try:
        return os.path.isfile(candidate) and dynamic_info(candidate).ident == ident
    except (OSError, ValueError):
        return False


def _locate(name: str, requester: DynamicInfo, chain: Sequence[DynamicInfo], search_dirs: Sequence[str]) -> str | None:
    """Where the loader finds DT_NEEDED ``name`` of ``requester`` (loaded by ``chain``, nearest first)."""
    if "/" in name:
        return os.path.abspath(name) if os.path.isfile(name) else None
    dirs: list[str] = []
    if not requester.runpath:  # DT_RPATH of the object and of its loaders, unless it has a DT_RUNPATH
        for obj in (requester, *chain):
            dirs += obj.rpath
    dirs += requester.runpath
    dirs += search_dirs
    for directory in dict.fromkeys(dirs):
        candidate = os.path.join(directory, name)
        if _compatible(candidate, requester.ident):
            return os.path.abspath(candidate)
    return None


def resolve_needed(
    path: str | os.PathLike[str],
    search_dirs: Sequence[str] = (),
    preloaded: Mapping[str, str | None] | None = None,
) -> dict[str, str | None]:
    """How the loader would find each DT_NEEDED of ``path``: ``{name: file or None}``.

    Order: an object already loaded under that name or soname (``preloaded``, e.g. ``load_closure()`` of what
    torch loads before an extension: sgl-kernel has no RPATH and finds libcudart.so.12 only that way), then
    DT_RPATH (when there is no DT_RUNPATH), DT_RUNPATH, then ``search_dirs`` in order (pass the env's own lib
    dirs first, then ``system_library_dirs()``). Candidates of another ELF class or machine are skipped.
    """
    info = dynamic_info(path)
    found: dict[str, str | None] = {}
    for name in info.needed:
        hit = (preloaded or {}).get(name)
        found[name] = hit if hit else _locate(name, info, (), search_dirs)
    return found


def load_closure(paths: Iterable[str | os.PathLike[str]], search_dirs: Sequence[str] = ()) -> dict[str, str | None]:
    """Everything loading ``paths`` (in order) pulls in, breadth-first like ld.so: ``{name: file or None}``.

    Keys are the DT_NEEDED names and the sonames of the loaded objects (the loader matches both); a name
    that cannot be found maps to None. Each object's RPATH/RUNPATH (and its loaders' RPATH) is honoured.
    """
    loaded: dict[str, str | None] = {}
    queue: list[tuple[DynamicInfo, tuple[DynamicInfo, ...]]] = []
    for path in paths:
        info = dynamic_info(path)
        loaded[os.path.basename(info.path)] = info.path
        if info.soname:
            loaded.setdefault(info.soname, info.path)
        queue.append((info, ()))
    while queue:
        info, chain = queue.pop(0)
        for name in info.needed:
            if name in loaded:
                continue
            hit = _locate(name, info, chain, search_dirs)
            loaded[name] = hit
            if hit is None:
                continue
            dep = dynamic_info(hit)
            if dep.soname:
                loaded.setdefault(dep.soname, hit)
            queue.append((dep, (info, *chain)))
    return loaded


def torch_loaded(torch_lib_dir: str | os.PathLike[str], search_dirs: Sequence[str] = ()) -> dict[str, str | None]:
    """What ``import torch`` has loaded before an extension: the closure of libtorch_global_deps.so and
    libtorch_python.so (which pulls in libtorch, libc10, the CUDA libs through torch's RPATH)."""
    lib = Path(torch_lib_dir)
    roots = [lib / n for n in ("libtorch_global_deps.so", "libtorch_python.so") if (lib / n).is_file()]
    return load_closure(roots, search_dirs)


# ------------------------------------------------------------------------------------------- ABI check


@dataclass
class AbiReport:
    ext: str
    checked: int  # torch-namespace symbols the extension imports (non-weak)
    missing: list[str]  # of those, the ones no provider exports: demangled, sorted
    missing_mangled: list[str]
    providers: list[str] = field(default_factory=list)  # torch libraries searched (the DT_NEEDED closure)
    missing_libraries: list[str] = field(default_factory=list)  # lib(c10|torch)* DT_NEEDED not in torch/lib

    @property
    def ok(self) -> bool:
        return not self.missing and not self.missing_libraries


@lru_cache(maxsize=64)
def _torch_exports(key: tuple[str, int, int]) -> dict[str, frozenset[str | None]]:
    """A provider's exported torch-namespace symbols with their versions, read once per file (every extension
    of an env is checked against the same few torch libraries)."""
    table: dict[str, set[str | None]] = {}
    for sym in exported_symbols(key[0]):
        if is_torch_symbol(sym.name):
            table.setdefault(sym.name, set()).add(sym.version)
    return {name: frozenset(versions) for name, versions in table.items()}


def abi_report(
    ext_path: str | os.PathLike[str],
    torch_lib_dir: str | os.PathLike[str],
    extra_providers: Iterable[str | os.PathLike[str]] = (),
) -> AbiReport:
    """Check the extension's torch-namespace imports against what torch_lib_dir's libraries export.

    Providers are the extension's DT_NEEDED libraries found in torch_lib_dir and, transitively, their
    dependencies found there (the loader searches the whole dependency scope), plus `extra_providers`:
    the other libraries in its load scope (e.g. libtorchcodec_core*.so beside a torchcodec extension,
    which exports torchcodec functions that take at::Tensor).
    """
    lib_dir = os.path.abspath(torch_lib_dir)
    wanted = [s for s in undefined_symbols(ext_path) if not s.weak and is_torch_symbol(s.name)]
    direct = needed(ext_path)
    missing_libs = [n for n in direct if _TORCH_LIB.match(n) and not os.path.isfile(os.path.join(lib_dir, n))]
    providers: list[str] = []
    queue = [n for n in direct if os.path.isfile(os.path.join(lib_dir, n))]
    while queue:
        candidate = os.path.join(lib_dir, queue.pop(0))
        if candidate in providers:
            continue
        providers.append(candidate)
        queue += [n for n in needed(candidate) if os.path.isfile(os.path.join(lib_dir, n))]
    tables = [_torch_exports(_key(p)) for p in [*providers, *map(str, extra_providers)]]

    def provided(sym: Symbol) -> bool:
        for table in tables:
            versions = table.get(sym.name)
            if versions is not None and (sym.version is None or {sym.version, None} & versions):
                return True
        return False

    missing = sorted({s.name for s in wanted if not provided(s)})
    pretty = demangle(missing)
    order = sorted(range(len(missing)), key=lambda i: pretty[i])
    return AbiReport(
        ext=os.path.abspath(ext_path),
        checked=len({s.name for s in wanted}),
        missing=[pretty[i] for i in order],
        missing_mangled=[missing[i] for i in order],
        providers=providers,
        missing_libraries=missing_libs,
    )


def abi_check(ext_path: str | os.PathLike[str], torch_lib_dir: str | os.PathLike[str]) -> list[str]:
    """Torch-namespace symbols the extension needs and torch_lib_dir does not export, demangled ([] = OK)."""
    return abi_report(ext_path, torch_lib_dir).missing
