"""The parts of an ELF file the probe reads: its header, section and program headers, and the bytes of a section.

Standard library only, and bounded by the file: every table and every string lies inside the file or the file is
refused (CorruptElf). The probe runs as root over files anyone who could write to the env may have made, so
nothing here trusts a count or an offset it read. Only headers and the few sections asked for are read, with
seeks; a 400 MB libtorch_cpu.so costs a few small reads, not a parse of every section (pyelftools, which this
replaces, built an object per section header on open: most of the probe's ELF scan went there).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

ELF_MAGIC = b"\x7fELF"
SHT_NOBITS = 8
SHT_DYNAMIC = 6
SHT_DYNSYM = 11
SHT_GNU_VERDEF = 0x6FFFFFFD
SHT_GNU_VERNEED = 0x6FFFFFFE
SHT_GNU_VERSYM = 0x6FFFFFFF
PT_LOAD = 1
PT_DYNAMIC = 2
_SHN_XINDEX = 0xFFFF
_PN_XNUM = 0xFFFF
# Linked libraries have a few dozen sections; extended numbering (counts in section 0) allows 2**32, which a file
# could claim to make the reader build millions of records. More than this is refused as corrupt.
MAX_ENTRIES = 1 << 20

# (header after e_ident, section header, program header, dynamic entry) per class
_LAYOUT = {
    32: ("HHIIIIIHHHHHH", "IIIIIIIIII", "IIIIIIII", "iI"),
    64: ("HHIQQQIHHHHHH", "IIQQQQIIQQ", "IIQQQQQQ", "qQ"),
}


class CorruptElf(ValueError):
    """The file starts like ELF but a header, table or string lies outside it or contradicts itself."""


@dataclass(frozen=True)
class Section:
    index: int
    name: str
    type: int
    addr: int
    offset: int
    size: int
    link: int
    info: int
    entsize: int


@dataclass(frozen=True)
class Segment:
    type: int
    offset: int
    vaddr: int
    filesz: int


class ElfFile:
    """One ELF file's headers, read on construction; `data()` reads a section's bytes when asked."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.size = os.fstat(stream.fileno()).st_size
        ident = self._read(0, 16)
        if ident[:4] != ELF_MAGIC:
            raise CorruptElf(f"not an ELF file (starts with {ident[:4]!r})")
        if ident[4] not in (1, 2) or ident[5] not in (1, 2):
            raise CorruptElf(f"unknown ELF class {ident[4]} or data encoding {ident[5]}")
        self.elfclass = 32 if ident[4] == 1 else 64
        self.little_endian = ident[5] == 1
        self.endian = "<" if self.little_endian else ">"
        header, shdr, phdr, dyn = (self.endian + f for f in _LAYOUT[self.elfclass])
        self._dyn = dyn
        fields = self._unpack(header, 16)
        _type, self.machine, _version, _entry, phoff, shoff, _flags, _ehsize = fields[:8]
        phentsize, phnum, shentsize, shnum, shstrndx = fields[8:]
        raw_sections = []
        if shoff:
            first = self._table_row(shdr, shoff, shentsize, 0)
            if shnum == 0:  # extended numbering: the real counts live in section 0
                shnum = first[5]
            if shstrndx == _SHN_XINDEX:
                shstrndx = first[6]
            if phnum == _PN_XNUM:
                phnum = first[7]
            self._check_table(shoff, shentsize, shnum, struct.calcsize(shdr), "section header")
            raw_sections = [self._table_row(shdr, shoff, shentsize, i) for i in range(shnum)]
        raw_segments = []
        if phoff and phnum:
            self._check_table(phoff, phentsize, phnum, struct.calcsize(phdr), "program header")
            raw_segments = [self._table_row(phdr, phoff, phentsize, i) for i in range(phnum)]
        if self.elfclass == 64:  # type, flags, offset, vaddr, paddr, filesz, memsz, align
            self.segments = tuple(Segment(r[0], r[2], r[3], r[5]) for r in raw_segments)
        else:  # type, offset, vaddr, paddr, filesz, memsz, flags, align
            self.segments = tuple(Segment(r[0], r[1], r[2], r[4]) for r in raw_segments)
        names = b""
        if 0 < shstrndx < len(raw_sections):
            names = self._section_bytes(raw_sections[shstrndx])
        self.sections = tuple(
            Section(i, _name(names, r[0]), r[1], r[3], r[4], r[5], r[6], r[7], r[9]) for i, r in enumerate(raw_sections)
        )

    # -------------------------------------------------------------------------------------------- reading

    def _read(self, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise CorruptElf(f"{size} bytes at offset {offset} lie outside the file ({self.size} bytes)")
        self.stream.seek(offset)
        data = self.stream.read(size)
        if len(data) != size:
            raise CorruptElf(f"short read at offset {offset}")
        return data

    def _unpack(self, fmt: str, offset: int) -> tuple:
        return struct.unpack(fmt, self._read(offset, struct.calcsize(fmt)))

    def _check_table(self, offset: int, entsize: int, count: int, minimum: int, what: str) -> None:
        if count > MAX_ENTRIES:
            raise CorruptElf(f"{count} {what}s: more than any real file has")
        if count and entsize < minimum:
            raise CorruptElf(f"{what} entries of {entsize} bytes, fewer than the {minimum} each needs")
        if offset + entsize * count > self.size:
            raise CorruptElf(f"{count} {what}s at offset {offset} run past the end of the file")

    def _table_row(self, fmt: str, offset: int, entsize: int, index: int) -> tuple:
        if entsize < struct.calcsize(fmt):
            raise CorruptElf(f"table entries of {entsize} bytes, fewer than the {struct.calcsize(fmt)} each needs")
        return self._unpack(fmt, offset + index * entsize)

    def _section_bytes(self, raw: tuple) -> bytes:
        sh_type, offset, size = raw[1], raw[4], raw[5]
        return b"" if sh_type == SHT_NOBITS else self._read(offset, size)

    # -------------------------------------------------------------------------------------------- sections

    def section(self, index: int) -> Section:
        if not 0 <= index < len(self.sections):
            raise CorruptElf(f"section index {index} out of range ({len(self.sections)} sections)")
        return self.sections[index]

    def first(self, sh_type: int) -> Section | None:
        return next((s for s in self.sections if s.type == sh_type), None)

    def data(self, section: Section) -> bytes:
        return b"" if section.type == SHT_NOBITS else self._read(section.offset, section.size)

    def dynamic_entries(self) -> tuple[list[tuple[int, int]], bytes]:
        """The dynamic section's (tag, value) entries up to DT_NULL and the string table its strings index;
        from the PT_DYNAMIC segment (its DT_STRTAB address mapped through PT_LOAD) when there are no sections."""
        section = self.first(SHT_DYNAMIC)
        if section is not None:
            raw, strtab = self.data(section), self.data(self.section(section.link))
            return _until_null(struct.iter_unpack(self._dyn, _whole(raw, self._dyn))), strtab
        segment = next((s for s in self.segments if s.type == PT_DYNAMIC), None)
        if segment is None:
            return [], b""
        raw = self._read(segment.offset, segment.filesz)
        entries = _until_null(struct.iter_unpack(self._dyn, _whole(raw, self._dyn)))
        address = next((v for t, v in entries if t == 5), None)  # DT_STRTAB
        size = next((v for t, v in entries if t == 10), 0)  # DT_STRSZ
        if address is None:
            return entries, b""
        for load in self.segments:
            end = load.vaddr + load.filesz
            if load.type == PT_LOAD and load.vaddr <= address < end:
                return entries, self._read(load.offset + address - load.vaddr, min(size, end - address))
        raise CorruptElf(f"DT_STRTAB address {address:#x} is in no loaded segment")


def _whole(raw: bytes, fmt: str) -> bytes:
    """`raw` cut to whole entries of `fmt` (a trailing partial entry is padding, never read as one)."""
    size = struct.calcsize(fmt)
    return raw[: len(raw) - len(raw) % size]


def _until_null(rows: Iterator[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for tag, value in rows:
        if tag == 0:  # DT_NULL
            break
        out.append((tag, value))
    return out


def _name(table: bytes, offset: int) -> str:
    """A section's name; an offset outside the names table gives no name (as readelf prints it), not an error."""
    if not 0 <= offset < len(table):
        return ""
    end = table.find(b"\0", offset)
    return table[offset : end if end >= 0 else len(table)].decode("utf-8", "replace")


def string_at(table: bytes, offset: int) -> str:
    """The NUL-terminated string at `offset` of a string table; one outside it (or unterminated) is corrupt."""
    if not 0 <= offset < len(table):
        raise CorruptElf(f"string offset {offset} outside its table ({len(table)} bytes)")
    end = table.find(b"\0", offset)
    if end < 0:
        raise CorruptElf(f"string at offset {offset} is not terminated")
    return table[offset:end].decode("utf-8", "replace")


@contextmanager
def open_elf(path: str | os.PathLike[str]) -> Iterator[ElfFile]:
    """The ElfFile of `path`; CorruptElf for a file that is not ELF or whose headers lie outside it (raised from
    the body too, for what is read later)."""
    with open(path, "rb") as stream:
        try:
            yield ElfFile(stream)
        except struct.error as exc:
            raise CorruptElf(str(exc)) from exc
