"""bwstack.probe.elfread, the probe's own ELF reader, and elfscan and fatbin on top of it.

Two kinds of test. Each file this machine has (its C and C++ libraries, a program, libraries built here with
sonames, RPATH, RUNPATH and symbol versions, hand-made 32-bit and big-endian objects) is read by elfread and
by pyelftools, an independent reader: they must agree on every section, dynamic entry and symbol. And hostile
files (a good library with one header, count or offset made to lie) must give NotElfError, never another
exception, a hang or a read outside the file: the probe reads them as root.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bwstack.probe import elfread, elfscan, fatbin
from bwstack.probe.elfscan import NotElfError

elftools = pytest.importorskip("elftools", reason="pyelftools (the dev extra) is the second reader")
from elftools.elf.elffile import ELFFile  # noqa: E402

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found")

SYSTEM_FILES = [
    p
    for p in (
        Path("/lib/x86_64-linux-gnu/libc.so.6"),
        Path("/lib/x86_64-linux-gnu/libm.so.6"),
        Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6"),
        Path("/lib/x86_64-linux-gnu/libz.so.1"),
        Path("/usr/lib/x86_64-linux-gnu/libcrypto.so.3"),
        Path("/bin/ls"),
    )
    if p.exists()
]


def _cc(out: Path, source: str, *flags: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    proc = subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src), *flags], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Libraries with a soname and a version script (verdef), one that needs it by version (verneed), RPATH and
    RUNPATH, and one with a weak undefined symbol."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    root = tmp_path_factory.mktemp("elfread")
    (root / "v.map").write_text("V_1 { global: f; local: *; };\nV_2 { global: g; } V_1;\n")
    lib = _cc(
        root / "libv.so.1",
        "int f(void){return 1;}\nint g(void){return 2;}\n",
        "-Wl,-soname,libv.so.1",
        f"-Wl,--version-script={root / 'v.map'}",
    )
    user = "extern int f(void); extern int w(void) __attribute__((weak));\nint u(void){return f() + (w ? w() : 0);}\n"
    link = [f"-L{root}", "-l:libv.so.1"]
    return {
        "versions": lib,
        "rpath": _cc(root / "librpath.so", user, *link, "-Wl,--disable-new-dtags,-rpath,$ORIGIN/a:/opt/b"),
        "runpath": _cc(root / "librunpath.so", user, *link, "-Wl,--enable-new-dtags,-rpath,$ORIGIN/c"),
    }


# ------------------------------------------------------------------------------------- the second reader


def _reference_dynamic(path: Path) -> dict:
    with open(path, "rb") as fh:
        elf = ELFFile(fh)
        dynamic = next((s for s in elf.iter_sections() if s["sh_type"] == "SHT_DYNAMIC"), None)
        out: dict = {"needed": [], "soname": None, "rpath": [], "runpath": []}
        for tag in dynamic.iter_tags() if dynamic is not None else ():
            kind = tag.entry.d_tag
            if kind == "DT_NEEDED":
                out["needed"].append(tag.needed)
            elif kind == "DT_SONAME":
                out["soname"] = tag.soname
            elif kind == "DT_RPATH":
                out["rpath"] += [p for p in tag.rpath.split(":") if p]
            elif kind == "DT_RUNPATH":
                out["runpath"] += [p for p in tag.runpath.split(":") if p]
        return out


def _reference_symbols(path: Path) -> list[tuple]:
    with open(path, "rb") as fh:
        elf = ELFFile(fh)
        dynsym = elf.get_section_by_name(".dynsym")
        if dynsym is None:
            return []
        versions: dict[int, str] = {}
        versym = None
        for sec in elf.iter_sections():
            if sec["sh_type"] == "SHT_GNU_verdef":
                for verdef, aux in sec.iter_versions():
                    if not verdef["vd_flags"] & 1:
                        versions[verdef["vd_ndx"]] = next(iter(aux)).name
            elif sec["sh_type"] == "SHT_GNU_verneed":
                for _verneed, aux in sec.iter_versions():
                    for vernaux in aux:
                        versions[vernaux["vna_other"]] = vernaux.name
            elif sec["sh_type"] == "SHT_GNU_versym":
                versym = sec
        out = []
        for index, sym in enumerate(dynsym.iter_symbols()):
            if not sym["st_name"]:
                continue
            ndx = versym.get_symbol(index)["ndx"] if versym is not None else None
            ndx = ndx if isinstance(ndx, int) else {"VER_NDX_LOCAL": 0, "VER_NDX_GLOBAL": 1}.get(ndx, 0)
            out.append(
                (
                    sym.name,
                    versions.get(ndx & 0x7FFF) if versym is not None else None,
                    sym["st_info"]["bind"].removeprefix("STB_").replace("LOOS", "UNIQUE"),  # 10: STB_GNU_UNIQUE
                    sym["st_shndx"] != "SHN_UNDEF",
                    sym["st_other"]["visibility"].removeprefix("STV_"),
                )
            )
        return out


def _ours_symbols(path: Path) -> list[tuple]:
    return [
        (s.name, s.version, s.binding, s.defined, s.visibility) for s in elfscan._dynamic_symbols(elfscan._key(path))
    ]


def _files(built: dict[str, Path]) -> list[Path]:
    return [*SYSTEM_FILES, *built.values()]


@needs_gcc
def test_the_sections_are_those_pyelftools_reads(built):
    for path in _files(built):
        with open(path, "rb") as fh:
            theirs = [
                (s.name, s["sh_offset"], s["sh_size"], s["sh_link"], s["sh_info"]) for s in ELFFile(fh).iter_sections()
            ]
        with elfread.open_elf(path) as elf:
            ours = [(s.name, s.offset, s.size, s.link, s.info) for s in elf.sections]
        assert ours == theirs, path


@needs_gcc
def test_the_dynamic_entries_are_those_pyelftools_reads(built):
    for path in _files(built):
        info = elfscan.dynamic_info(path)
        ref = _reference_dynamic(path)
        origin = str(path.parent)
        assert list(info.needed) == ref["needed"], path
        assert info.soname == ref["soname"], path
        assert list(info.rpath) == [elfscan.expand_origin(p, origin) for p in ref["rpath"]], path
        assert list(info.runpath) == [elfscan.expand_origin(p, origin) for p in ref["runpath"]], path
    assert elfscan.soname(built["versions"]) == "libv.so.1"
    assert elfscan.rpaths(built["rpath"]) == [str(built["rpath"].parent / "a"), "/opt/b"]


@needs_gcc
def test_the_dynamic_symbols_and_their_versions_are_those_pyelftools_reads(built):
    for path in _files(built):
        assert _ours_symbols(path) == _reference_symbols(path), path
    exported = {s.name: s.version for s in elfscan.exported_symbols(built["versions"])}
    assert exported["f"] == "V_1" and exported["g"] == "V_2"
    wanted = {s.name: s for s in elfscan.undefined_symbols(built["rpath"])}
    assert wanted["f"].version == "V_1" and wanted["w"].weak


@pytest.mark.parametrize("elfclass,little", [(32, True), (32, False), (64, False)], ids=["32-le", "32-be", "64-be"])
def test_other_classes_and_byte_orders_read_as_pyelftools_reads_them(tmp_path, elfclass, little):
    # What gcc here cannot make: .shstrtab, .dynstr and .dynamic with DT_NEEDED, DT_SONAME and DT_RUNPATH.
    e, dyn_fmt = ("<" if little else ">"), ("qQ" if elfclass == 64 else "iI")
    names, strings = b"\0.shstrtab\0.dynstr\0.dynamic\0", b"\0liba.so\0libme.so.2\0$ORIGIN/x\0"
    dynamic = b"".join(struct.pack(e + dyn_fmt, t, v) for t, v in ((1, 1), (14, 9), (29, 20), (0, 0)))
    path = _synthetic(tmp_path / "libme.so.2", [
        {"name": 1, "type": 3, "offset": 0, "size": len(names)},
        {"name": 11, "type": 3, "offset": len(names), "size": len(strings)},
        {"name": 19, "type": 6, "offset": len(names + strings), "size": len(dynamic), "link": 2},
    ], names + strings + dynamic, names=1, elfclass=elfclass, little=little)  # fmt: skip
    info = elfscan.dynamic_info(path)
    assert (list(info.needed), info.soname, list(info.runpath)) == (["liba.so"], "libme.so.2", [str(tmp_path / "x")])
    ref = _reference_dynamic(path)
    assert (ref["needed"], ref["soname"], ref["runpath"]) == (["liba.so"], "libme.so.2", ["$ORIGIN/x"])


@needs_gcc
def test_without_section_headers_the_dynamic_segment_is_read(built, tmp_path):
    data = bytearray(built["runpath"].read_bytes())
    struct.pack_into("<Q", data, 0x28, 0)  # e_shoff
    struct.pack_into("<HHH", data, 0x3A, 0, 0, 0)  # e_shentsize, e_shnum, e_shstrndx
    stripped = tmp_path / "librunpath.so"
    stripped.write_bytes(bytes(data))
    assert elfscan.needed(stripped) == elfscan.needed(built["runpath"])
    assert elfscan.rpaths(stripped) == [str(tmp_path / "c")]


# ------------------------------------------------------------------------------------- hostile files


def _section_header(data: bytes, name: str) -> int:
    """Offset of the section header of `name` in a 64-bit little-endian file."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    names_at = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)[0]
    for index in range(shnum):
        at = shoff + index * shentsize
        start = names_at + struct.unpack_from("<I", data, at)[0]
        if data[start : data.index(b"\0", start)].decode() == name:
            return at
    raise AssertionError(name)


def _lie(field: str):
    def patch(data: bytearray) -> None:
        if field == "truncated":
            del data[40:]
        elif field == "class":
            data[4] = 3
        elif field == "section table past the end":
            struct.pack_into("<Q", data, 0x28, len(data) + 4096)
        elif field == "section entries too small":
            struct.pack_into("<H", data, 0x3A, 8)
        elif field == "section count past the end":
            struct.pack_into("<H", data, 0x3C, 0xFFFE)
        elif field == "extended section count past the end":
            data += b"\0" * 64  # a new section 0 at the end, whose size field holds the count
            struct.pack_into("<Q", data, len(data) - 64 + 0x20, 3_000_000_000)
            struct.pack_into("<Q", data, 0x28, len(data) - 64)
            struct.pack_into("<H", data, 0x3C, 0)
        elif field == "dynamic strings index out of range":
            struct.pack_into("<I", data, _section_header(data, ".dynamic") + 0x28, 999)
        elif field == "needed name outside its strings":
            at = struct.unpack_from("<Q", data, _section_header(data, ".dynamic") + 0x18)[0]
            while struct.unpack_from("<q", data, at)[0] != 1:  # the first DT_NEEDED
                at += 16
            struct.pack_into("<Q", data, at + 8, 1 << 40)
        elif field == "dynamic section past the end":
            struct.pack_into("<Q", data, _section_header(data, ".dynamic") + 0x20, 1 << 40)
        elif field == "symbol table past the end":
            struct.pack_into("<Q", data, _section_header(data, ".dynsym") + 0x18, len(data))
        elif field == "version needs counted in billions":
            struct.pack_into("<I", data, _section_header(data, ".gnu.version_r") + 0x2C, 0xFFFFFFFF)
        elif field == "version need's entries outside it":
            at = struct.unpack_from("<Q", data, _section_header(data, ".gnu.version_r") + 0x18)[0]
            struct.pack_into("<I", data, at + 8, 1 << 30)  # vn_aux
        elif field == "version definitions leave their section":
            at = struct.unpack_from("<Q", data, _section_header(data, ".gnu.version_d") + 0x18)[0]
            struct.pack_into("<I", data, at + 16, 1 << 30)  # vd_next
        else:
            raise AssertionError(field)

    return patch


HOSTILE = [
    ("truncated", "rpath"),
    ("class", "rpath"),
    ("section table past the end", "rpath"),
    ("section entries too small", "rpath"),
    ("section count past the end", "rpath"),
    ("extended section count past the end", "rpath"),
    ("needed name outside its strings", "rpath"),
    ("symbol table past the end", "rpath"),
    ("version need's entries outside it", "rpath"),
    ("version definitions leave their section", "versions"),
]


# Lies in what ld.so does not read (the .dynamic section header: it reads PT_DYNAMIC) or does not count by (a
# version-need count: it follows the links to the last one): the file is read as the loader reads it.
IGNORED = ["dynamic strings index out of range", "dynamic section past the end", "version needs counted in billions"]


@needs_gcc
@pytest.mark.parametrize("lie", IGNORED)
def test_a_lie_the_loader_does_not_read_changes_nothing_read(built, tmp_path, lie):
    data = bytearray(built["rpath"].read_bytes())
    _lie(lie)(data)
    path = tmp_path / f"lib{lie.replace(' ', '-')}.so"
    path.write_bytes(bytes(data))
    beside = shutil.copy(built["rpath"], tmp_path / "librpath.so")  # the same $ORIGIN
    ours, original = elfscan.dynamic_info(path), elfscan.dynamic_info(beside)
    assert (ours.needed, ours.soname, ours.rpath) == (original.needed, original.soname, original.rpath)
    assert elfscan.undefined_symbols(path) == elfscan.undefined_symbols(beside)


READERS = (
    elfscan.needed,
    elfscan.undefined_symbols,
    elfscan.exported_symbols,
    elfscan.cxx11_abi,
    fatbin.entries,
)


def _outcomes(path: Path) -> dict[str, str]:
    """What each reader the probe uses makes of `path`: "read" or "refused"; any other exception fails the test."""
    out = {}
    for reader in READERS:
        try:
            reader(path)
            out[reader.__name__] = "read"
        except (NotElfError, fatbin.FatbinError):
            out[reader.__name__] = "refused"
    return out


@needs_gcc
@pytest.mark.parametrize("lie,source", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_file_whose_headers_lie_is_refused_as_not_elf(built, tmp_path, lie, source):
    data = bytearray(built[source].read_bytes())
    _lie(lie)(data)
    path = tmp_path / f"lib{lie.replace(' ', '-')}.so"
    path.write_bytes(bytes(data))
    outcomes = _outcomes(path)
    assert "refused" in outcomes.values(), outcomes


def _synthetic(
    path: Path, sections: list[dict], blobs: bytes, names: int = 0, elfclass: int = 64, little: bool = True
) -> Path:
    """An ELF file (64-bit little-endian unless asked): a header, `blobs`, then the section headers (section 0
    null, then `sections`: type, offset into blobs, size, link, info, name). No program headers: read through
    sections."""
    e, wide = ("<" if little else ">"), elfclass == 64
    ehsize, shentsize = (64, 64) if wide else (52, 40)
    shoff = ehsize + len(blobs) + (-(ehsize + len(blobs)) % 8)
    ident = b"\x7fELF" + bytes([2 if wide else 1, 1 if little else 2, 1, 0]) + b"\0" * 8
    layout = e + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH")
    count = len(sections) + 1
    header = ident + struct.pack(layout, 3, 62 if wide else 3, 1, 0, 0, shoff, 0, ehsize, 0, 0, shentsize, count, names)
    sh_fmt = e + ("IIQQQQIIQQ" if wide else "IIIIIIIIII")
    table = [struct.pack(sh_fmt, *([0] * 10))]
    for sec in sections:
        fields = (sec.get("name", 0), sec["type"], 0, 0, ehsize + sec["offset"], sec["size"], sec.get("link", 0))
        table.append(struct.pack(sh_fmt, *fields, sec.get("info", 0), 8, 0))
    path.write_bytes((header + blobs).ljust(shoff, b"\0") + b"".join(table))
    return path


def _symbols(*name_offsets: int) -> bytes:
    return struct.pack("<IBBHQQ", 0, 0, 0, 0, 0, 0) + b"".join(
        struct.pack("<IBBHQQ", n, 0x12, 0, 1, 0, 0) for n in name_offsets
    )


def test_a_symbol_named_outside_its_strings_is_refused_by_every_symbol_reader(tmp_path):
    strings = b"\0f\0".ljust(8, b"\0")
    path = _synthetic(tmp_path / "libname.so", [
        {"type": 3, "offset": 0, "size": 3},
        {"type": elfread.SHT_DYNSYM, "offset": 8, "size": 48, "link": 1},
    ], strings + _symbols(100))  # fmt: skip
    assert _outcomes(path) | {"needed": "-", "entries": "-"} == {
        "needed": "-", "undefined_symbols": "refused", "exported_symbols": "refused", "cxx11_abi": "refused",
        "entries": "-",
    }  # fmt: skip


def test_names_read_at_thousands_of_offsets_of_one_long_string_are_refused_not_decoded(tmp_path):
    """4,000 symbols, each named at another offset into one 1 MiB string: 4 GB to decode, from a 1 MB file."""
    strings = b"\0" + b"A" * (1 << 20) + b"\0"
    strings += b"\0" * (-len(strings) % 8)
    table = _symbols(*range(1, 4001))
    path = _synthetic(tmp_path / "libmany-names.so", [
        {"type": 3, "offset": 0, "size": len(strings)},
        {"type": elfread.SHT_DYNSYM, "offset": len(strings), "size": len(table), "link": 1},
    ], strings + table)  # fmt: skip
    with pytest.raises(NotElfError, match="strings are read far more often"):
        elfscan.exported_symbols(path)


def _version_needs(entries: int, per_entry: int) -> bytes:
    """`entries` version-need records whose `per_entry` auxiliary records are all the same chain (each record
    16 bytes, none overlapping): entries x per_entry visits of a section that holds entries + per_entry."""
    shared = 16 * entries
    outer = b"".join(
        struct.pack("<HHIII", 1, per_entry, 0, shared - 16 * i, 16 if i < entries - 1 else 0) for i in range(entries)
    )
    aux = b"".join(struct.pack("<IHHII", 0, 0, 2, 0, 16 if j < per_entry - 1 else 0) for j in range(per_entry))
    return outer + aux


def test_version_chains_that_share_their_entries_are_refused_before_the_work_multiplies(tmp_path):
    needs = _version_needs(200, 200)
    path = _synthetic(tmp_path / "libshared-chain.so", [
        {"type": 3, "offset": 0, "size": 8},
        {"type": elfread.SHT_DYNSYM, "offset": 8, "size": 48, "link": 1},
        {"type": elfread.SHT_GNU_VERNEED, "offset": 56, "size": len(needs), "link": 1, "info": 200},
    ], b"\0f\0".ljust(8, b"\0") + _symbols(1) + needs)  # fmt: skip
    with pytest.raises(NotElfError, match="more version entries than"):
        elfscan.undefined_symbols(path)


def test_a_second_section_of_symbol_versions_is_refused(tmp_path):
    path = _synthetic(tmp_path / "libtwo-versyms.so", [
        {"type": 3, "offset": 0, "size": 8},
        {"type": elfread.SHT_DYNSYM, "offset": 8, "size": 48, "link": 1},
        {"type": elfread.SHT_GNU_VERSYM, "offset": 56, "size": 4},
        {"type": elfread.SHT_GNU_VERSYM, "offset": 56, "size": 4},
    ], b"\0f\0".ljust(8, b"\0") + _symbols(1) + b"\1\0\1\0")  # fmt: skip
    with pytest.raises(NotElfError, match="where a file has one"):
        elfscan.exported_symbols(path)


def test_fatbin_sections_that_share_bytes_are_refused_not_read_again(tmp_path):
    names = b"\0.nv_fatbin\0".ljust(16, b"\0")
    entry = bytearray(0x40)
    struct.pack_into("<HHIQ", entry, 0, 2, 0x101, 0x40, 0)
    blob = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 0x40) + bytes(entry)
    fat = {"name": 1, "type": 1, "offset": 16, "size": len(blob)}
    one = _synthetic(tmp_path / "libone.so", [{"type": 3, "offset": 0, "size": 13}, fat], names + blob, names=1)
    assert len(fatbin.entries(one)) == 1
    two = _synthetic(tmp_path / "libtwo.so", [{"type": 3, "offset": 0, "size": 13}, fat, fat], names + blob, names=1)
    with pytest.raises(fatbin.FatbinError, match="overlap"):
        fatbin.entries(two)


@needs_gcc
def test_a_dynamic_section_that_says_less_than_the_loader_reads_hides_nothing(built, tmp_path):
    """ld.so reads PT_DYNAMIC, not the section header: a .dynamic section of size 0 must not hide DT_NEEDED."""
    data = bytearray(built["rpath"].read_bytes())
    struct.pack_into("<Q", data, _section_header(data, ".dynamic") + 0x20, 0)
    path = tmp_path / "librpath.so"
    path.write_bytes(bytes(data))
    assert elfscan.needed(path) == elfscan.needed(built["rpath"]) and "libv.so.1" in elfscan.needed(path)


def test_a_fifo_named_like_a_library_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "libfifo.so"
    os.mkfifo(fifo)
    assert _outcomes(fifo) == dict.fromkeys((r.__name__ for r in READERS), "refused")


@needs_gcc
def test_a_file_cut_short_while_its_fatbin_is_read_is_an_error_not_a_crash(built, tmp_path):
    path = tmp_path / "libshrinking.so"
    shutil.copy(built["rpath"], path)
    with open(path, "rb") as fh:
        view = fatbin._Positioned(fh.fileno())
        os.truncate(path, 100)
        with pytest.raises(fatbin.FatbinError, match="ends before"):
            view.read(view.size - 64, 64)


@needs_gcc
def test_a_lying_file_is_refused_by_the_fatbin_reader_too(built, tmp_path):
    data = bytearray(built["rpath"].read_bytes())
    _lie("section table past the end")(data)
    path = tmp_path / "libbad.so"
    path.write_bytes(bytes(data))
    with pytest.raises(NotElfError):
        fatbin.entries(path)


@needs_gcc
def test_a_section_count_no_real_file_has_is_refused_before_any_is_read(built, tmp_path):
    """Two million section headers that do fit in the file (a sparse one, 256 MiB of holes): refused at once
    instead of read into two million records."""
    data = bytearray(built["rpath"].read_bytes())
    count = (1 << 21) + 1
    table = (len(data) + 63) // 64 * 64
    struct.pack_into("<Q", data, 0x28, table)
    struct.pack_into("<H", data, 0x3C, 0)  # extended numbering: the count is section 0's size
    path = tmp_path / "libmany.so"
    with open(path, "wb") as fh:
        fh.write(bytes(data))
        fh.truncate(table + 64 * count)
        fh.seek(table + 0x20)
        fh.write(struct.pack("<Q", count))
    with pytest.raises(NotElfError, match="more than any real file has"):
        elfscan.needed(path)


def test_the_probes_fatbin_facts_pass_over_fifos_named_like_its_files(tmp_path):
    """A FIFO named like a cubin, a torch library and a JIT-cache library: the facts are read, nothing waits for a
    writer (in a child with a time limit, so a regression fails instead of hanging the suite)."""
    site = tmp_path / "site-packages"
    for name in ("flashinfer_cubin/a.cubin", "torch/lib/libtorch_cuda.so", "flashinfer_jit_cache/libx.so"):
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(site / name)
    code = (
        "import json, sys; from pathlib import Path; from bwstack.probe import main; "
        "print(json.dumps(main.fatbin_facts(Path(sys.argv[1]), '12.0')))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert facts["flashinfer_cubin"] == {"cubins": 1, "archs": {"unknown": 1}}
    assert facts["flashinfer_jit_cache"]["files"] == 0  # not a regular file: not a library
    assert facts["torch"][0]["error"].endswith("not a regular file")


def _program_header(data: bytes, p_type: int) -> int:
    """Offset of the first program header of `p_type` in a 64-bit little-endian file."""
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return next(
        phoff + i * phentsize
        for i in range(phnum)
        if struct.unpack_from("<I", data, phoff + i * phentsize)[0] == p_type
    )


@needs_gcc
def test_a_dynamic_segment_that_says_it_is_shorter_hides_nothing(built, tmp_path):
    """ld.so walks the dynamic array to DT_NULL whatever PT_DYNAMIC's size says: one entry's worth of it must not
    hide the others (DT_NEEDED libc.so.6, the RPATH)."""
    data = bytearray(built["rpath"].read_bytes())
    struct.pack_into("<Q", data, _program_header(data, elfread.PT_DYNAMIC) + 0x20, 16)  # p_filesz
    path = tmp_path / "librpath.so"
    path.write_bytes(bytes(data))
    assert elfscan.needed(path) == elfscan.needed(built["rpath"])
    assert elfscan.rpaths(path) == [str(tmp_path / "a"), "/opt/b"]


@needs_gcc
def test_the_last_rpath_entry_is_the_one_the_loader_uses(built, tmp_path):
    """ld.so keeps one value per tag, the last: a second DT_RPATH (written into a spare DT_NULL slot) replaces
    the first instead of adding to it."""
    data = bytearray(built["rpath"].read_bytes())
    at = struct.unpack_from("<Q", data, _section_header(data, ".dynamic") + 0x18)[0]
    entries = []
    while True:
        tag, value = struct.unpack_from("<qQ", data, at + 16 * len(entries))
        entries.append((tag, value))
        if tag == 0:
            break
    rpath = next(value for tag, value in entries if tag == 15)
    spare = at + 16 * (len(entries) - 1)
    assert struct.unpack_from("<q", data, spare + 16)[0] == 0, "no spare DT_NULL slot after the array"
    struct.pack_into("<qQ", data, spare, 15, rpath + len("$ORIGIN/a:"))
    path = tmp_path / "librpath.so"
    path.write_bytes(bytes(data))
    assert elfscan.rpaths(path) == ["/opt/b"]
