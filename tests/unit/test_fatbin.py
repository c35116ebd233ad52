"""bwstack.probe.fatbin: the .nv_fatbin parser and the SM coverage rule.

Binaries come from nvcc (skipped without it; compiled once and cached under $BWSTACK_TEST_CACHE/nvcc-fatbin),
from gcc (a hand-built fatbin section, so the parser is tested without nvcc too) and from the real torch and
sgl-kernel wheels (slow; $BWSTACK_REAL_ENV or the files test_elfscan.py's network tests unpack).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bwstack.probe import envinspect, fatbin
from bwstack.probe.elfscan import NotElfError
from bwstack.probe.fatbin import FatbinEntry, covers, entries, runs_on, summary

CUOBJDUMP_VERSION = "13.5.37"
KERNEL = """
__global__ void scale(float *x, float f) { x[threadIdx.x] *= f; }
extern "C" void launch(float *x) { scale<<<1, 32>>>(x, 2.0f); }
"""
GENCODE = {
    "sm90a": ["-gencode", "arch=compute_90a,code=sm_90a"],
    "sm120": ["-gencode", "arch=compute_120,code=sm_120"],
    "sm120a": ["-gencode", "arch=compute_120a,code=sm_120a"],
    "sm120f": ["-gencode", "arch=compute_120f,code=sm_120f"],
    "ptx120": ["-gencode", "arch=compute_120,code=compute_120"],
    "ptx90": ["-gencode", "arch=compute_90,code=compute_90"],
    "ptx120a": ["-gencode", "arch=compute_120a,code=compute_120a"],
    "zstd": ["-gencode", "arch=compute_120a,code=[sm_120a,compute_120a]", "-Xfatbin=-compress-all"],
    "lz4": ["-gencode", "arch=compute_120a,code=[sm_120a,compute_120a]", "--compress-mode=speed"],
    "plain": ["-gencode", "arch=compute_120a,code=[sm_120a,compute_120a]", "--no-compress"],
    "multi": [
        *("-gencode", "arch=compute_80,code=sm_80"),
        *("-gencode", "arch=compute_90a,code=sm_90a"),
        *("-gencode", "arch=compute_120,code=[sm_120,compute_120]"),
        *("-gencode", "arch=compute_120a,code=compute_120a"),
        *("-gencode", "arch=compute_100f,code=[sm_103f,compute_100f]"),
    ],
}


def cache_root() -> Path:
    return Path(os.environ.get("BWSTACK_TEST_CACHE") or Path.home() / ".cache" / "bwstack-tests")


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="session")
def nvcc_libs() -> dict[str, Path]:
    """{variant: .so} for GENCODE, built with `nvcc -shared` (cached by nvcc version, source and flags)."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set NVCC, put it on PATH or install /usr/local/cuda): cannot build fatbins")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    out_dir = cache_root() / "nvcc-fatbin"
    out_dir.mkdir(parents=True, exist_ok=True)

    def build(variant: str) -> tuple[str, Path]:
        flags = GENCODE[variant]
        digest = hashlib.sha256(json.dumps([version, KERNEL, flags]).encode()).hexdigest()[:16]
        target = out_dir / f"{variant}-{digest}.so"
        if not target.is_file():
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / "k.cu"
                src.write_text(KERNEL)
                lib = Path(tmp) / "k.so"
                cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", *flags, "-o", str(lib), str(src)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
                os.replace(lib, target)
        return variant, target

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(pool.map(build, GENCODE))


def names(found: list[FatbinEntry]) -> list[str]:
    return [e.name for e in found]


# -------------------------------------------------------------------------------- coverage rule (no files)


def entry(name: str, container: int = 0) -> FatbinEntry:
    kind, _, arch = name.partition("_")
    suffix = arch[-1] if arch[-1] in "af" else ""
    return FatbinEntry(
        kind="cubin" if kind == "sm" else "ptx",
        sm=int(arch.rstrip("af")),
        suffix=suffix,
        version=(1, 8) if kind == "sm" else (9, 0),
        compression=None,
        size=0,
        container=container,
        offset=0,
    )


@pytest.mark.parametrize(
    ("name", "runs"),
    [
        ("sm_120", {"12.0": True, "12.1": True, "10.0": False, "13.0": False}),
        ("sm_121", {"12.0": False, "12.1": True}),
        ("sm_120a", {"12.0": True, "12.1": False}),
        ("sm_120f", {"12.0": True, "12.1": True, "10.0": False}),
        ("sm_100f", {"10.0": True, "10.3": True, "12.0": False}),
        ("sm_100a", {"10.0": True, "10.3": False, "12.0": False}),
        ("sm_90", {"9.0": True, "12.0": False}),
        ("compute_90", {"8.9": False, "9.0": True, "12.0": True, "12.1": True}),
        ("compute_120", {"12.0": True, "12.1": True, "11.0": False}),
        ("compute_121", {"12.0": False, "12.1": True}),
        ("compute_120a", {"12.0": True, "12.1": False}),
        ("compute_120f", {"12.0": True, "12.1": True, "13.0": False}),
    ],
)
def test_runs_on_follows_nvidia_rules(name: str, runs: dict[str, bool]) -> None:
    for capability, expected in runs.items():
        assert runs_on(entry(name), capability) is expected, (name, capability)


def test_parse_capability_forms() -> None:
    for form in ("12.0", "12.0a", "120", "sm_120", "sm_120f", (12, 0)):
        assert fatbin.parse_capability(form) == (12, 0)
    assert fatbin.parse_capability("12.1") == (12, 1)


def test_covers_reasons() -> None:
    sgl = [entry(n, c) for c in range(74) for n in ("sm_80", "sm_89", "sm_90", "sm_90a", "sm_100a", "sm_120a")]
    assert covers(sgl, "12.0") == (True, "sm_120a cubin ×74")
    assert covers(sgl, "12.1") == (False, "only sm_80…sm_120a cubins and no PTX: no kernel image for 12.1")
    fa3 = [entry("sm_80"), entry("sm_86"), entry("sm_90a")]
    assert covers(fa3) == (False, "only sm_80…sm_90a cubins and no PTX: no kernel image for 12.0")
    ok, reason = covers([entry("sm_80"), entry("compute_90")])
    assert ok and reason.startswith("no cubin for 12.0; compute_90 PTX ×1 JIT-compiled by the driver"), reason
    assert covers([entry("compute_120a")], "12.1") == (
        False,
        "no cubins and compute_120a PTX (not for 12.1): no kernel image for 12.1",
    )
    assert covers([]) == (False, "no device code (no fatbin): nothing runs on 12.0")
    # a second CUDA module with nothing for 12.0 is reported but does not fail the check
    ok, reason = covers([entry("sm_120", 0), entry("sm_90a", 1)])
    assert ok and reason == "sm_120 cubin ×1; 1 of 2 fatbin units have no image for 12.0"


# ---------------------------------------------------------------------------- a fatbin section built by hand


def _entry_bytes(kind: int, arch: int, flags: int, payload: bytes, version: tuple[int, int]) -> bytes:
    header = struct.pack("<HHIQ", kind, 0x101, 0x40, len(payload))
    header += struct.pack("<IIHHI", 0, 0x40, version[1], version[0], arch)
    header += struct.pack("<IIQQQ", 0, 0, flags, 0, len(payload) * 3 if flags & 0xA000 else 0)
    assert len(header) == 0x40
    return header + payload


def _container(*items: bytes) -> bytes:
    body = b"".join(items)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


@pytest.fixture(scope="module")
def handmade_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ELF .so (built by gcc) whose .nv_fatbin section holds containers written here byte by byte."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    blob = _container(
        _entry_bytes(2, 120, 0x11 | 0x100000, b"\x7fELF" + b"\0" * 12, (1, 8)),  # sm_120a
        _entry_bytes(2, 100, 0x11 | 0x200000 | 0x2000, b"L" * 8, (1, 7)),  # sm_100f, LZ4
        _entry_bytes(1, 120, 0x11 | 0x200000 | 0x8000, b"Z" * 8, (8, 8)),  # compute_120f, zstd
    )
    blob += b"\0" * (-len(blob) % 8) + _container()  # an empty container (as nvcc -shared emits)
    blob += _container(_entry_bytes(1, 90, 0x11, b".version 8.7\0\0\0\0", (8, 7)))  # compute_90
    c_bytes = ",".join(str(b) for b in blob)
    src = tmp_path_factory.mktemp("handmade") / "fb.c"
    src.write_text(
        '__attribute__((section(".nv_fatbin"), aligned(8), used))\n'
        f"static const unsigned char fatbin[{len(blob)}] = {{{c_bytes}}};\n"
    )
    lib = src.with_suffix(".so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def test_handmade_layout(handmade_so: Path) -> None:
    found = entries(handmade_so)
    assert names(found) == ["sm_120a", "sm_100f", "compute_120f", "compute_90"]
    assert [e.compression for e in found] == [None, "lz4", "zstd", None]
    assert [e.container for e in found] == [0, 0, 0, 2]
    assert found[2].ptx_isa == "8.8" and found[0].ptx_isa is None and found[0].version == (1, 8)
    info = summary(handmade_so)
    assert info["cubins"] == {"sm_100f": 1, "sm_120a": 1}
    assert info["ptx"] == ["compute_90", "compute_120f"]
    assert info["ptx_isa"] == ["8.7", "8.8"]
    assert (info["containers"], info["entries"], info["compressed"]) == (2, 4, 2)
    json.dumps(info)


def _so_with_sections(directory: Path, sections: dict[str, bytes]) -> Path:
    """A gcc-built .so whose named sections hold the given fatbin bytes (written here byte by byte)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    lines = []
    for i, (section, blob) in enumerate(sections.items()):
        c_bytes = ",".join(str(b) for b in blob)
        lines.append(
            f'__attribute__((section("{section}"), aligned(8), used))\n'
            f"static const unsigned char blob{i}[{len(blob)}] = {{{c_bytes}}};\n"
        )
    src = directory / "sections.c"
    src.write_text("".join(lines))
    lib = src.with_suffix(".so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def _cubin(arch: int) -> bytes:
    return _entry_bytes(2, arch, 0x11, b"\x7fELF" + b"\0" * 12, (1, 8))


def test_relocatable_device_code_is_read_but_never_counts_as_a_loadable_kernel(tmp_path: Path) -> None:
    """libnccl and libnvshmem carry __nv_relfatbin (for device linking) beside .nv_fatbin: a library whose only
    sm_120 code is relocatable has no kernel the driver can load on 12.0."""
    lib = _so_with_sections(
        tmp_path,
        {
            ".nv_fatbin": _container(_cubin(90)),
            "__nv_relfatbin": _container(_cubin(120), _entry_bytes(1, 120, 0x11, b"P" * 8, (8, 7))),
        },
    )
    found = entries(lib)
    assert [(e.name, e.relocatable) for e in found] == [
        ("sm_90", False),
        ("sm_120", True),
        ("compute_120", True),
    ]
    assert not any(runs_on(e, "12.0") for e in found if e.relocatable)
    assert covers(found, "12.0") == (False, "only sm_90 cubins and no PTX: no kernel image for 12.0")
    info = summary(lib)
    assert info["cubins"] == {"sm_90": 1} and info["ptx"] == []
    assert info["relocatable"] == {"sm_120": 1, "compute_120": 1}
    assert info["entries"] == 1 and info["containers"] == 1


def test_a_library_with_only_relocatable_device_code_says_so(tmp_path: Path) -> None:
    lib = _so_with_sections(tmp_path, {"__nv_relfatbin": _container(_cubin(120))})
    ok, reason = covers(entries(lib), "12.0")
    assert not ok
    assert reason == (
        "only relocatable device code (__nv_relfatbin, 1 entries for device linking): "
        "no kernel image the driver loads on 12.0"
    )


def test_loadable_cubins_beside_relocatable_ones_still_cover(tmp_path: Path) -> None:
    lib = _so_with_sections(
        tmp_path,
        {".nv_fatbin": _container(_cubin(120)), "__nv_relfatbin": _container(_cubin(120), _cubin(90))},
    )
    assert covers(entries(lib), "12.0") == (True, "sm_120 cubin ×1")


def test_corrupt_fatbin_raises(handmade_so: Path, tmp_path: Path) -> None:
    data = bytearray(handmade_so.read_bytes())
    first = data.index(struct.pack("<I", 0xBA55ED50))
    struct.pack_into("<H", data, first + 16, 7)  # first entry kind 7
    bad = tmp_path / "bad.so"
    bad.write_bytes(bytes(data))
    with pytest.raises(fatbin.FatbinError, match="bad fatbin entry"):
        entries(bad)


def test_no_fatbin_and_not_elf(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    src = tmp_path / "plain.c"
    src.write_text("int answer(void) { return 42; }\n")
    lib = tmp_path / "libplain.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    assert entries(lib) == []
    assert summary(lib)["cubins"] == {} and covers([])[0] is False
    with pytest.raises(NotElfError, match="not an ELF file"):
        entries(src)
    with pytest.raises(FileNotFoundError):
        entries(tmp_path / "missing.so")


# ---------------------------------------------------------------------------------------------- nvcc builds


def test_nvcc_sm90a_only_fails_on_sm120(nvcc_libs: dict[str, Path]) -> None:
    found = entries(nvcc_libs["sm90a"])
    assert set(names(found)) == {"sm_90a"}
    assert covers(found, "12.0") == (False, "only sm_90a cubins and no PTX: no kernel image for 12.0")


@pytest.mark.parametrize(
    ("variant", "cap120", "cap121"),
    [
        ("sm120", True, True),
        ("sm120a", True, False),
        ("sm120f", True, True),
        ("ptx120", True, True),
        ("ptx90", True, True),
        ("ptx120a", True, False),
    ],
)
def test_nvcc_sm120_variants(nvcc_libs: dict[str, Path], variant: str, cap120: bool, cap121: bool) -> None:
    found = entries(nvcc_libs[variant])
    expected = {
        "sm120": {"sm_120"},
        "sm120a": {"sm_120a"},
        "sm120f": {"sm_120f"},
        "ptx120": {"compute_120"},
        "ptx90": {"compute_90"},
        "ptx120a": {"compute_120a"},
    }[variant]
    assert set(names(found)) == expected
    assert covers(found, "12.0")[0] is cap120
    assert covers(found, "12.1")[0] is cap121
    if variant.startswith("ptx"):
        reason = covers(found, "12.0")[1]
        assert "JIT-compiled by the driver" in reason and "PTX ISA 9.0" in reason, reason
        assert all(e.ptx_isa == "9.0" for e in found)  # nvcc 13.0 writes PTX ISA 9.0


def test_nvcc_compression_flags(nvcc_libs: dict[str, Path]) -> None:
    zstd, lz4, plain = (entries(nvcc_libs[v]) for v in ("zstd", "lz4", "plain"))
    for found in (zstd, lz4, plain):
        assert set(names(found)) == {"sm_120a", "compute_120a"}
    assert {e.compression for e in zstd} == {"zstd"}  # -Xfatbin=-compress-all: cubins too
    assert {e.compression for e in lz4 if e.kind == "ptx"} == {"lz4"}  # --compress-mode=speed
    assert {e.compression for e in plain} == {None}
    assert summary(nvcc_libs["zstd"])["compressed"] == len(zstd)


def test_nvcc_multiple_gencodes(nvcc_libs: dict[str, Path]) -> None:
    found = entries(nvcc_libs["multi"])
    info = summary(nvcc_libs["multi"])
    # nvcc -shared emits two containers: the module and a device-link stub (cuobjdump lists both)
    assert set(info["cubins"]) == {"sm_80", "sm_90a", "sm_103f", "sm_120"}
    assert info["ptx"] == ["compute_100f", "compute_120", "compute_120a"]
    assert covers(found, "12.0")[1].startswith("sm_120 cubin ×")
    assert covers(found, "10.3")[1].startswith("sm_103f cubin ×")
    assert covers(found, "10.0")[1].startswith("no cubin for 10.0; compute_100f PTX ×1")


def test_nvcc_without_fatbin_segment(nvcc_libs: dict[str, Path], tmp_path: Path) -> None:
    if shutil.which("objcopy") is None:
        pytest.skip("objcopy not found")
    stripped = tmp_path / "noseg.so"
    cmd = ["objcopy", "--remove-section", ".nvFatBinSegment", str(nvcc_libs["multi"]), str(stripped)]
    subprocess.run(cmd, check=True)
    assert shape(entries(stripped)) == shape(entries(nvcc_libs["multi"]))


def shape(found: list[FatbinEntry]) -> list[tuple[object, ...]]:
    return [(e.name, e.version, e.compression, e.size, e.container) for e in found]


# ------------------------------------------------------------------------------------------- cuobjdump agrees


def find_cuobjdump() -> str | None:
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    for entry_dir in [*sys.path, str(cache_root() / "cuobjdump")]:
        candidates += sorted(glob.glob(os.path.join(entry_dir, "nvidia", "*", "bin", "cuobjdump")))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.fixture(scope="session")
def cuobjdump() -> str:
    """cuobjdump from CUDA or the nvidia-cuda-cuobjdump wheel (pip-installs it into the test cache)."""
    found = find_cuobjdump()
    if found:
        return found
    target = cache_root() / "cuobjdump"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--target", str(target), f"nvidia-cuda-cuobjdump=={CUOBJDUMP_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    found = find_cuobjdump()
    if proc.returncode != 0 or found is None:
        pytest.skip(f"no cuobjdump and could not install nvidia-cuda-cuobjdump: {proc.stderr.strip()[-500:]}")
    return found


def cuobjdump_lists(tool: str, path: Path) -> tuple[list[str], list[str]]:
    """The arch names cuobjdump gives for the cubins and the PTX of ``path``, in its order."""
    out = []
    for flag in ("--list-elf", "--list-ptx"):
        proc = subprocess.run([tool, flag, str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        # "ELF file    1: k.1.sm_120a.cubin" / "PTX file    1: k.1.sm_120f.ptx"
        out.append([line.rsplit(".", 2)[-2] for line in proc.stdout.splitlines() if " file " in line])
    return out[0], out[1]


def as_cuobjdump(found: list[FatbinEntry]) -> tuple[list[str], list[str]]:
    """Our entries named as cuobjdump names them: sm_120f cubins print as sm_120, PTX keep the suffix."""
    cubins = [f"sm_{e.sm}{'' if e.suffix == 'f' else e.suffix}" for e in found if e.kind == "cubin"]
    return cubins, [f"sm_{e.sm}{e.suffix}" for e in found if e.kind == "ptx"]


@pytest.mark.network
def test_cuobjdump_agrees_on_nvcc_builds(nvcc_libs: dict[str, Path], cuobjdump: str) -> None:
    for variant, lib in nvcc_libs.items():
        assert as_cuobjdump(entries(lib)) == cuobjdump_lists(cuobjdump, lib), variant


# ------------------------------------------------------------------------------------------- real libraries

REAL_FILES = {
    "common_ops": "sgl_kernel/sm100/common_ops.abi3.so",
    "libtorch_cuda": "torch/lib/libtorch_cuda.so",
}


def real_file(key: str) -> Path:
    """From $BWSTACK_REAL_ENV (a venv with torch 2.9.1 and sgl-kernel 0.3.21 from PyPI), else from the
    wheels test_elfscan.py's network tests unpack into the cache; skip when neither has it."""
    rel = REAL_FILES[key]
    env = os.environ.get("BWSTACK_REAL_ENV")
    if env:
        candidate = envinspect.site_packages(Path(env)) / rel
    else:
        wheel = "sgl_kernel-0.3.21-cp310-abi3-manylinux2014_x86_64" if key == "common_ops" else "torch-2.9.1-"
        hits = sorted((cache_root() / "unpacked").glob(f"{wheel}*/{rel}"))
        candidate = hits[0] if hits else Path("/nonexistent") / rel
    if not candidate.is_file():
        pytest.skip(f"{rel} not found: set BWSTACK_REAL_ENV or run the network tests of test_elfscan.py")
    return candidate


@pytest.mark.slow
@pytest.mark.network
def test_real_sgl_kernel_common_ops(cuobjdump: str) -> None:
    path = real_file("common_ops")
    start = time.perf_counter()
    found = entries(path)
    elapsed = time.perf_counter() - start
    info = summary(path)
    assert info["cubins"] == {n: 74 for n in ("sm_80", "sm_89", "sm_90", "sm_90a", "sm_100a", "sm_120a")}
    assert info["ptx"] == []
    assert covers(found, "12.0") == (True, "sm_120a cubin ×74")
    assert covers(found, "12.1")[0] is False
    assert as_cuobjdump(found) == cuobjdump_lists(cuobjdump, path)
    assert elapsed < 5


@pytest.mark.slow
@pytest.mark.network
def test_real_libtorch_cuda(cuobjdump: str) -> None:
    path = real_file("libtorch_cuda")
    start = time.perf_counter()
    found = entries(path)
    elapsed = time.perf_counter() - start
    info = summary(path)
    assert info["cubins"]["sm_120"] == 397 and info["cubins"]["sm_120a"] == 1
    assert info["ptx"] == [] and info["compressed"] == info["entries"]
    ok, reason = covers(found, "12.0")
    assert ok and reason.startswith("sm_120 cubin ×397, sm_120a cubin ×1"), reason
    assert as_cuobjdump(found) == cuobjdump_lists(cuobjdump, path)
    assert elapsed < 10  # ~0.05 s warm; cuobjdump needs ~25 s for the same lists
