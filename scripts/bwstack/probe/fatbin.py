"""Which GPU architectures a shared library carries kernels for, read from its CUDA fatbinary.

Parses the ``.nv_fatbin`` ELF section (the headers only, read where they lie) without cuobjdump. Standard library
only: this module also runs on target hosts inside the verify probe.

Layout (checked against nvcc 13.0 output and cuobjdump 13.5): the section holds 8-byte aligned containers,
each ``u32 magic 0xBA55ED50, u16 version, u16 header_size, u64 payload_size`` followed by entries. An entry
header is ``u16 kind (1 PTX, 2 ELF cubin), u16 version, u32 header_size, u64 size`` and further ``u16 minor,
u16 major`` at 0x18 (PTX ISA for PTX, cubin ABI for cubins), ``u32 arch`` (SM number) at 0x1c, ``u64 flags``
at 0x28 (0x2000 LZ4, 0x8000 zstd, 0x100000 arch-specific ``a``, 0x200000 family ``f``) and ``u64
decompressed_size`` at 0x38. The payload (``size`` bytes) follows the entry header.

Two ELF sections hold fatbins. ``.nv_fatbin`` holds the images the CUDA driver loads when the library registers
its modules. ``__nv_relfatbin`` (present in libraries built with ``-rdc``, e.g. libnccl and libnvshmem) holds
relocatable device code kept for device linking by users of the library: the driver never loads those cubins,
so they are read and reported (``relocatable=True``) but never count as a kernel that runs on a GPU.
"""

from __future__ import annotations

import itertools
import os
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bwstack.probe import elfread
from bwstack.probe.elfscan import NotElfError, open_elf

CONTAINER_MAGIC = 0xBA55ED50
FLAG_LZ4 = 0x2000
FLAG_ZSTD = 0x8000
FLAG_ARCH_SPECIFIC = 0x100000  # sm_XYa / compute_XYa
FLAG_FAMILY = 0x200000  # sm_XYf / compute_XYf
KIND_PTX = 1
KIND_CUBIN = 2

_CONTAINER = struct.Struct("<IHHQ")
_ENTRY = struct.Struct("<HHIQ")  # kind, version, header_size, size
_ENTRY_VER_ARCH = struct.Struct("<HHI")  # at 0x18: minor, major, arch
_U64 = struct.Struct("<Q")
LOADABLE_SECTION = ".nv_fatbin"
RELOCATABLE_SECTION = "__nv_relfatbin"
_SECTIONS = (LOADABLE_SECTION, RELOCATABLE_SECTION)


class FatbinError(ValueError):
    """The fatbin data is not what the layout above says (truncated or corrupt)."""


@dataclass(frozen=True)
class FatbinEntry:
    kind: str  # "cubin" or "ptx"
    sm: int  # 120 for sm_120 / compute_120
    suffix: str  # "", "a" (arch-specific) or "f" (family)
    version: tuple[int, int]  # PTX ISA for PTX (9.0 = CUDA 13.0), cubin ABI ("code version") for cubins
    compression: str | None  # None, "lz4" or "zstd"
    size: int  # bytes stored in the file
    container: int  # index of the fatbin container (one per CUDA module) the entry belongs to
    offset: int  # file offset of the entry header
    relocatable: bool = False  # from __nv_relfatbin: device-link input, never loaded by the driver

    @property
    def name(self) -> str:
        """``sm_120a`` for a cubin, ``compute_120`` for PTX."""
        return f"{'sm' if self.kind == 'cubin' else 'compute'}_{self.sm}{self.suffix}"

    @property
    def compressed(self) -> bool:
        return self.compression is not None

    @property
    def ptx_isa(self) -> str | None:
        return f"{self.version[0]}.{self.version[1]}" if self.kind == "ptx" else None


def entries(path: str | os.PathLike[str]) -> list[FatbinEntry]:
    """Every cubin and PTX entry in the file's fatbinaries, in file order; [] when it has no device code.

    Raises NotElfError for a file that is not (readable) ELF and FatbinError for a corrupt fatbin.
    """
    with open_elf(path) as elf:
        regions = sorted(  # .nv_fatbin (and __nv_relfatbin in -rdc objects); .nvFatBinSegment is not needed
            (sec.offset, sec.size, sec.name == RELOCATABLE_SECTION)
            for sec in elf.sections
            if sec.name in _SECTIONS and sec.type != elfread.SHT_NOBITS and sec.size
        )
        for (start, size, _), (after, _s, _r) in itertools.pairwise(regions):
            if after < start + size:  # a real file's fatbin sections are apart; shared bytes would be read again
                raise FatbinError(f"fatbin sections overlap at file offset {after:#x}")
        view = _Positioned(elf.stream.fileno())
        found: list[FatbinEntry] = []
        container = 0
        for start, size, relocatable in regions:
            container = _parse_region(view, start, size, container, found, relocatable)
        return found


class _Positioned:
    """The file's bytes read where asked (pread), not mapped: a file cut short while it is read gives a short
    read, which is FatbinError, where a mapping would kill the process (SIGBUS)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.size = os.fstat(fd).st_size

    def read(self, offset: int, size: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise FatbinError(f"the file ends before offset {offset + size:#x} (changed while read?)")
        return data

    def unpack(self, layout: struct.Struct, offset: int) -> tuple:
        return layout.unpack(self.read(offset, layout.size))


def _parse_region(
    view: _Positioned, start: int, size: int, container: int, out: list[FatbinEntry], relocatable: bool = False
) -> int:
    end = start + size
    if end > view.size:
        raise FatbinError(f"fatbin section at {start:#x} runs past the end of the file")
    pos = start
    while pos + _CONTAINER.size <= end:
        magic, _version, header_size, payload = view.unpack(_CONTAINER, pos)
        if magic != CONTAINER_MAGIC:
            if end - pos <= 4096 and not view.read(pos, end - pos).strip(b"\0"):  # zero padding at the section end
                break
            raise FatbinError(f"bad fatbin container magic {magic:#x} at file offset {pos:#x}")
        if header_size < _CONTAINER.size:
            raise FatbinError(f"bad fatbin container header size {header_size} at file offset {pos:#x}")
        body = pos + header_size
        body_end = body + payload
        if body_end > end:
            raise FatbinError(f"fatbin container at {pos:#x} claims {payload} bytes past the section end")
        _parse_container(view, body, body_end, container, out, relocatable)
        container += 1
        pos = (body_end + 7) & ~7
    return container


def _parse_container(
    view: _Positioned, pos: int, end: int, container: int, out: list[FatbinEntry], relocatable: bool
) -> None:
    while pos + 0x40 <= end:
        header = view.read(pos, 0x40)
        kind, _version, header_size, size = _ENTRY.unpack_from(header, 0)
        if kind not in (KIND_PTX, KIND_CUBIN) or header_size < 0x40 or pos + header_size + size > end:
            raise FatbinError(f"bad fatbin entry (kind {kind}, header {header_size}) at file offset {pos:#x}")
        minor, major, arch = _ENTRY_VER_ARCH.unpack_from(header, 0x18)
        flags = _U64.unpack_from(header, 0x28)[0]
        suffix = "a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY else ""
        compression = "zstd" if flags & FLAG_ZSTD else "lz4" if flags & FLAG_LZ4 else None
        out.append(
            FatbinEntry(
                kind="ptx" if kind == KIND_PTX else "cubin",
                sm=arch,
                suffix=suffix,
                version=(major, minor),
                compression=compression,
                size=size,
                container=container,
                offset=pos,
                relocatable=relocatable,
            )
        )
        pos += header_size + size


def summary(path: str | os.PathLike[str]) -> dict[str, Any]:
    """JSON-serialisable overview of the loadable images (cubin archs with counts, PTX archs with counts and
    their ISA versions) and, apart, the relocatable device code of ``__nv_relfatbin``."""
    found = entries(path)
    loadable = [e for e in found if not e.relocatable]
    isas = sorted({e.version for e in loadable if e.kind == "ptx"})
    return {
        "path": str(path),
        "containers": len({e.container for e in loadable}),
        "entries": len(loadable),
        "compressed": sum(e.compressed for e in loadable),
        "cubins": _counts(e for e in loadable if e.kind == "cubin"),
        "ptx": list(_counts(e for e in loadable if e.kind == "ptx")),
        "ptx_counts": _counts(e for e in loadable if e.kind == "ptx"),
        "ptx_isa": [f"{major}.{minor}" for major, minor in isas],
        "relocatable": _counts(e for e in found if e.relocatable),
    }


def _counts(found: Iterable[FatbinEntry]) -> dict[str, int]:
    """{name: count} ordered by SM number, then suffix ("" < "a" < "f")."""
    counts = Counter((e.sm, e.suffix, e.name) for e in found)
    return {name: counts[(sm, suffix, name)] for sm, suffix, name in sorted(counts)}


def parse_capability(capability: str | tuple[int, int]) -> tuple[int, int]:
    """Parse "12.0", "12.0a", "120", "sm_120" or (12, 0) into (12, 0)."""
    if isinstance(capability, tuple):
        return capability
    text = str(capability).strip().lower().removeprefix("sm_").removeprefix("compute_").rstrip("af")
    if "." in text:
        major, minor = text.split(".", 1)
        return int(major), int(minor)
    number = int(text)
    return number // 10, number % 10


def runs_on(entry: FatbinEntry, capability: str | tuple[int, int]) -> bool:
    """Whether the driver can run this entry on a GPU of that compute capability (NVIDIA's rules).

    cubin sm_XY: same major X, minor >= Y. sm_XYa: exactly X.Y. sm_XYf: the family, same major, minor >= Y
    (sm_120f runs on 12.0 and 12.1). PTX compute_XY: JIT-compiled on any X.Y or newer (major or minor).
    compute_XYa: exactly X.Y. compute_XYf: same major, minor >= Y. Relocatable device code (``__nv_relfatbin``)
    runs nowhere: the driver does not load it.
    """
    if entry.relocatable:
        return False
    major, minor = parse_capability(capability)
    e_major, e_minor = divmod(entry.sm, 10)
    if entry.suffix == "a":
        return (major, minor) == (e_major, e_minor)
    if entry.suffix == "f" or entry.kind == "cubin":
        return major == e_major and minor >= e_minor
    return (major, minor) >= (e_major, e_minor)


def covers(found: list[FatbinEntry], capability: str | tuple[int, int] = "12.0") -> tuple[bool, str]:
    """Whether some kernel image in ``found`` runs on a GPU of ``capability``, with a human reason.

    A cubin that runs there wins; otherwise PTX the driver can JIT-compile (slow first start; the driver must
    know the PTX ISA). The reason also says how many fatbin units (one per CUDA module) carry nothing for
    this GPU: their kernels fail with "no kernel image is available" if launched there (normal for
    arch-specific extras such as sm_90a-only units in torch).
    """
    cap = parse_capability(capability)
    label = f"{cap[0]}.{cap[1]}"
    relocatable = [e for e in found if e.relocatable]
    found = [e for e in found if not e.relocatable]
    if not found:
        if relocatable:
            return False, (
                f"only relocatable device code ({RELOCATABLE_SECTION}, {len(relocatable)} entries for device "
                f"linking): no kernel image the driver loads on {label}"
            )
        return False, f"no device code (no fatbin): nothing runs on {label}"
    usable = [e for e in found if runs_on(e, cap)]
    units = {e.container for e in found}
    bare = len(units - {e.container for e in usable})
    gap = f"; {bare} of {len(units)} fatbin units have no image for {label}" if bare else ""
    cubins = _counts(e for e in usable if e.kind == "cubin")
    if cubins:
        return True, ", ".join(f"{name} cubin ×{n}" for name, n in cubins.items()) + gap
    ptx = _counts(e for e in usable if e.kind == "ptx")
    if ptx:
        isa = max(e.version for e in usable)
        names = ", ".join(f"{name} PTX ×{n}" for name, n in ptx.items())
        jit = f"JIT-compiled by the driver (PTX ISA {isa[0]}.{isa[1]}; slow first launch)"
        return True, f"no cubin for {label}; {names} {jit}{gap}"
    have_cubins = list(_counts(e for e in found if e.kind == "cubin"))
    have_ptx = list(_counts(e for e in found if e.kind == "ptx"))
    text = f"only {_span(have_cubins)} cubins" if have_cubins else "no cubins"
    text += f" and {', '.join(have_ptx)} PTX (not for {label})" if have_ptx else " and no PTX"
    return False, f"{text}: no kernel image for {label}"


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}…{names[-1]}"


def coverage(path: str | os.PathLike, capability: str) -> dict:
    """What a library carries for `capability`, as the probe reports it: its summary, whether its device code
    covers the capability (and why not), or the error that kept it from being read."""
    try:
        found = entries(path)
    except (NotElfError, FatbinError, OSError) as exc:
        return {"path": str(path), "error": str(exc)}
    ok, reason = covers(found, capability)
    return {
        "path": str(path),
        "summary": summary(path),
        "covers": ok,
        "reason": reason,
        "has_device_code": any(not e.relocatable for e in found),
    }


__all__ = [
    "FatbinEntry",
    "FatbinError",
    "NotElfError",
    "coverage",
    "covers",
    "entries",
    "parse_capability",
    "runs_on",
    "summary",
]
