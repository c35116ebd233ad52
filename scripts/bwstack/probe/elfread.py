"""The parts of an ELF file the probe reads: its header, section and program headers, and the bytes of a section.

Standard library only, and bounded by the file: every table and every string lies inside the file or the file is
refused (CorruptElf). The probe runs as root over files anyone who could write to the env may have made, so
nothing here trusts a count or an offset it read. Only headers and the few sections asked for are read, with
seeks; a 400 MB libtorch_cpu.so costs a few small reads, not a parse of every section (pyelftools, which this
replaces, built an object per section header on open: most of the probe's ELF scan went there).
"""

from __future__ import annotations

import errno
import os
import stat
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
PAGE = 4096  # the loader maps whole pages (x86-64, and the smallest page of the others)
MAX_DYNAMIC = 1 << 20  # bytes of dynamic array read at most: tens of thousands of entries

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
    memsz: int


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
            self.segments = tuple(Segment(r[0], r[2], r[3], r[5], r[6]) for r in raw_segments)
        else:  # type, offset, vaddr, paddr, filesz, memsz, flags, align
            self.segments = tuple(Segment(r[0], r[1], r[2], r[4], r[5]) for r in raw_segments)
        names = Strings(b"")
        if 0 < shstrndx < len(raw_sections):
            names = Strings(self._section_bytes(raw_sections[shstrndx]))
        self.sections = tuple(
            Section(i, names.at(r[0], lenient=True), r[1], r[3], r[4], r[5], r[6], r[7], r[9])
            for i, r in enumerate(raw_sections)
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

    def only(self, sh_type: int) -> Section | None:
        """The section of a type a file has at most one of (the symbol versions); several are corrupt: read each,
        a file could make the reader go over the same bytes thousands of times."""
        found = [s for s in self.sections if s.type == sh_type]
        if len(found) > 1:
            raise CorruptElf(f"{len(found)} sections of type {sh_type:#x}, where a file has one")
        return found[0] if found else None

    def data(self, section: Section) -> bytes:
        return b"" if section.type == SHT_NOBITS else self._read(section.offset, section.size)

    def dynamic_entries(self) -> tuple[list[tuple[int, int]], Strings]:
        """The dynamic table's (tag, value) entries up to DT_NULL and the strings they index, as ld.so reads them:
        the last PT_DYNAMIC header, its array walked in the loaded image until DT_NULL (not cut at its own size),
        and the last DT_STRTAB, through the loaded segments. Only a file without program headers (an object file)
        is read through its SHT_DYNAMIC section. Section headers are not what the loader reads, so a header that
        says less cannot hide an entry from the checks."""
        dynamic = [s for s in self.segments if s.type == PT_DYNAMIC]
        if not dynamic:
            section = self.first(SHT_DYNAMIC)
            if section is None:
                return [], Strings(b"")
            raw, strtab = self.data(section), self.data(self.section(section.link))
            return _until_null(struct.iter_unpack(self._dyn, whole_entries(raw, self._dyn))), Strings(strtab)
        segment = dynamic[-1]  # ld.so keeps the last one it sees
        if segment.filesz == 0:
            raise CorruptElf("its PT_DYNAMIC is empty (the loader refuses it)")
        raw = self.image(segment.vaddr, MAX_DYNAMIC, "PT_DYNAMIC")
        entries = _until_null(struct.iter_unpack(self._dyn, whole_entries(raw, self._dyn)))
        address = next((v for t, v in reversed(entries) if t == 5), None)  # DT_STRTAB: the last one counts
        size = next((v for t, v in reversed(entries) if t == 10), 0)  # DT_STRSZ
        if address is None:
            return entries, Strings(b"")
        return entries, Strings(self.image(address, size, "DT_STRTAB"))

    def image(self, address: int, size: int, what: str) -> bytes:
        """Up to `size` bytes at virtual `address` of the image ld.so maps: the last PT_LOAD covering the address
        (a later mapping replaces an earlier one), whose file bytes run to the end of their last page unless the
        segment has more memory than file there (then the loader zeroes the rest: read as zeros)."""
        for load in reversed(self.segments):
            if load.type != PT_LOAD:
                continue
            start = load.vaddr - load.vaddr % PAGE
            end = load.vaddr + max(load.memsz, load.filesz)
            end += -end % PAGE
            if not start <= address < end:
                continue
            file_end = load.vaddr + load.filesz
            if load.memsz <= load.filesz:
                file_end += -file_end % PAGE  # the mapping's last page holds the file's next bytes
            if address >= file_end:
                return bytes(min(size, end - address, PAGE))  # zero-filled memory
            offset = load.offset + address - load.vaddr
            available = min(size, file_end - address, self.size - offset)
            return self._read(offset, max(available, 0))
        raise CorruptElf(f"{what} address {address:#x} is in no loaded segment")


class Strings:
    """A string table. Each offset is decoded once, and the bytes scanned in all stay within a budget a few
    times the table's size: names that overlap (thousands of references into one long string, each at another
    offset) cannot make the reader scan or hold more than that."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._seen: dict[int, str] = {}
        self._left = 8 * len(data) + (1 << 20)

    def at(self, offset: int, lenient: bool = False) -> str:
        """The NUL-terminated string at `offset`; one outside the table or unterminated is corrupt (`lenient`:
        no name, or the rest of the table, as readelf shows section names)."""
        hit = self._seen.get(offset)
        if hit is not None:
            return hit
        if not 0 <= offset < len(self.data):
            if lenient:
                return ""
            raise CorruptElf(f"string offset {offset} outside its table ({len(self.data)} bytes)")
        end = self.data.find(b"\0", offset, offset + self._left + 1)
        if end < 0:
            if len(self.data) - offset > self._left:
                raise CorruptElf("its strings are read far more often than a real file's")
            if not lenient:
                raise CorruptElf(f"string at offset {offset} is not terminated")
            end = len(self.data)
        self._left -= end - offset + 1
        if self._left < 0:
            raise CorruptElf("its strings are read far more often than a real file's")
        text = self.data[offset:end].decode("utf-8", "replace")
        self._seen[offset] = text
        return text


def whole_entries(raw: bytes, fmt: str) -> bytes:
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


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """`path` opened for reading if it is a regular file; CorruptElf for a FIFO, a device or a folder (opened
    without blocking: a FIFO named like a library must not hang a root probe)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # checked before opening: opening a device can act on it
            raise CorruptElf(f"{path}: not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise
        raise CorruptElf(f"{path}: cannot be opened ({exc.strerror})") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptElf(f"{path}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def open_elf(path: str | os.PathLike[str]) -> Iterator[ElfFile]:
    """The ElfFile of `path`; CorruptElf for a file that is not a regular ELF file or whose headers lie outside
    it (raised from the body too, for what is read later)."""
    with open_regular(path) as stream:
        try:
            yield ElfFile(stream)
        except struct.error as exc:
            raise CorruptElf(str(exc)) from exc
