"""bwstack.probe.elfscan: DT_NEEDED/RPATH, dynamic symbols, loader emulation and the torch ABI check.

Fast tests build small libraries with gcc/g++ (a fake torch included); the network+slow tests read the real
sgl-kernel 0.3.21 and torch 2.9.1 / 2.8.0 wheels from PyPI (~2.3 GB, cached in $BWSTACK_TEST_CACHE/wheels,
default ~/.cache/bwstack-tests, and unpacked once into .../unpacked).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from bwstack.probe import elfscan
from bwstack.probe.elfscan import (
    NotElfError,
    abi_check,
    abi_report,
    cxx11_abi,
    demangle,
    exported_symbols,
    is_torch_symbol,
    load_closure,
    needed,
    resolve_needed,
    rpaths,
    soname,
    system_library_dirs,
    undefined_symbols,
)

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("g++") is None, reason="gcc/g++ not found")


def cc(out: Path, source: str, *flags: str, cxx: bool = False) -> Path:
    """Build a shared library from ``source`` (C, or C++ with cxx=True)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.parent / f".{out.name}.{'cc' if cxx else 'c'}"
    src.write_text(source)
    cmd = ["g++" if cxx else "gcc", "-shared", "-fPIC", "-o", str(out), str(src), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    return out


FOO_C = """
int foo(void) { return 1; }
__attribute__((weak)) int foo_weak(void) { return 2; }
__attribute__((visibility("hidden"))) int hidden_fn(void) { return 3; }
__attribute__((visibility("protected"))) int prot_fn(void) { return 4; }
int foo_data = 5;
"""
USER_C = """
#include <unistd.h>
extern int foo(void);
extern int maybe_missing(void) __attribute__((weak));
int use(void) { return foo() + (maybe_missing ? maybe_missing() : 0) + (int)getpid(); }
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """sub/libfoo.so.1 (versioned FOO_1.0) and, in app/, libraries that need it found different ways."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    root = tmp_path_factory.mktemp("libs")
    script = root / "foo.map"
    script.write_text("FOO_1.0 { global: foo; foo_weak; prot_fn; foo_data; local: *; };\n")
    sub, app = root / "sub", root / "app"
    foo = cc(sub / "libfoo.so.1", FOO_C, "-Wl,-soname,libfoo.so.1", f"-Wl,--version-script={script}")
    link = [f"-L{sub}", "-l:libfoo.so.1"]
    out = {"foo": foo}
    out["rpath"] = cc(app / "librpath.so", USER_C, *link, "-Wl,--disable-new-dtags,-rpath,$ORIGIN/../sub")
    out["runpath"] = cc(app / "librunpath.so", USER_C, *link, "-Wl,--enable-new-dtags,-rpath,$ORIGIN/../sub")
    out["nopath"] = cc(app / "libnopath.so", USER_C, *link, "-Wl,-soname,libnopath.so")
    # top has an RPATH to sub/ and needs libnopath.so (found beside it through $ORIGIN): nopath's libfoo.so.1
    # is then found through top's RPATH, as ld.so searches the loaders' DT_RPATH too.
    out["top"] = cc(
        app / "libtop.so",
        "int top(void) { return 0; }",
        f"-L{app}",
        "-Wl,--no-as-needed",
        "-lnopath",
        "-Wl,--disable-new-dtags,-rpath,$ORIGIN:$ORIGIN/../sub",
    )
    out["plain"] = cc(root / "libplain.so", "#include <unistd.h>\nint plain(void) { return (int)getpid(); }")
    return out


@needs_gcc
def test_dynamic_section(libs: dict[str, Path]) -> None:
    assert soname(libs["foo"]) == "libfoo.so.1"
    assert soname(libs["rpath"]) is None
    assert "libfoo.so.1" in needed(libs["rpath"]) and "libc.so.6" in needed(libs["rpath"])
    sub = str(libs["foo"].parent)
    assert rpaths(libs["rpath"]) == [sub]
    assert elfscan.dynamic_info(libs["rpath"]).rpath == (sub,)
    assert rpaths(libs["runpath"]) == [sub]
    assert elfscan.dynamic_info(libs["runpath"]).runpath == (sub,)
    assert rpaths(libs["nopath"]) == []
    assert rpaths(libs["top"]) == [str(libs["top"].parent), sub]


def test_expand_origin() -> None:
    assert elfscan.expand_origin("$ORIGIN/../lib", "/a/b") == "/a/lib"
    assert elfscan.expand_origin("${ORIGIN}", "/a/b") == "/a/b"
    assert elfscan.expand_origin("/opt/x/", "/a/b") == "/opt/x"


@needs_gcc
def test_symbols(libs: dict[str, Path]) -> None:
    exported = {s.name: s for s in exported_symbols(libs["foo"])}
    assert {"foo", "foo_weak", "prot_fn", "foo_data"} <= set(exported)
    assert "hidden_fn" not in exported
    assert exported["foo"].version == "FOO_1.0" and exported["foo"].type == "FUNC"
    assert exported["foo_weak"].weak and exported["foo_data"].type == "OBJECT"
    assert exported["prot_fn"].visibility == "PROTECTED"
    assert str(exported["foo"]) == "foo@FOO_1.0"
    undefined = {s.name: s for s in undefined_symbols(libs["rpath"])}
    assert undefined["foo"].version == "FOO_1.0" and not undefined["foo"].weak and not undefined["foo"].defined
    assert undefined["maybe_missing"].weak and undefined["maybe_missing"].version is None
    assert "use" not in undefined and "use" in {s.name for s in exported_symbols(libs["rpath"])}


@needs_gcc
def test_resolve_needed(libs: dict[str, Path], tmp_path: Path) -> None:
    system = system_library_dirs()
    foo = str(libs["foo"])
    for key in ("rpath", "runpath"):
        found = resolve_needed(libs[key], system)
        assert found["libfoo.so.1"] == foo
        assert found["libc.so.6"] and Path(found["libc.so.6"]).is_file()
    # no RPATH: not found, unless given a search dir or already loaded by someone else (the sgl-kernel case)
    assert resolve_needed(libs["nopath"], system)["libfoo.so.1"] is None
    assert resolve_needed(libs["nopath"], [str(libs["foo"].parent)])["libfoo.so.1"] == foo
    preloaded = load_closure([libs["rpath"]], system)
    assert preloaded["libfoo.so.1"] == foo
    assert resolve_needed(libs["nopath"], system, preloaded=preloaded)["libfoo.so.1"] == foo
    # a DT_NEEDED that is nowhere
    moved = tmp_path / "app"
    shutil.copytree(libs["rpath"].parent, moved)
    assert resolve_needed(moved / "librpath.so", system)["libfoo.so.1"] is None


@needs_gcc
def test_load_closure_uses_loader_rpath(libs: dict[str, Path]) -> None:
    closure = load_closure([libs["top"]], system_library_dirs())
    assert closure["libnopath.so"] == str(libs["nopath"])
    assert closure["libfoo.so.1"] == str(libs["foo"])  # through libtop's RPATH
    assert list(closure)[:2] == ["libtop.so", "libnopath.so"]  # breadth-first, like ld.so
    alone = load_closure([libs["nopath"]], system_library_dirs())
    assert alone["libfoo.so.1"] is None


@needs_gcc
def test_resolve_skips_other_elf_class(libs: dict[str, Path], tmp_path: Path) -> None:
    # a non-ELF file (or one of another class/machine) of the right name is skipped, as ld.so does
    bogus = tmp_path / "libfoo.so.1"
    bogus.write_text("not a library")
    dirs = [str(tmp_path), str(libs["foo"].parent)]
    assert resolve_needed(libs["nopath"], dirs)["libfoo.so.1"] == str(libs["foo"])


@needs_gcc
def test_system_library_dirs(monkeypatch: pytest.MonkeyPatch, libs: dict[str, Path]) -> None:
    dirs = system_library_dirs()
    assert dirs and all(os.path.isabs(d) for d in dirs)
    libc = resolve_needed(libs["plain"], dirs)["libc.so.6"]
    assert libc is not None and os.path.dirname(libc) in dirs
    # without ldconfig: /etc/ld.so.conf (+ includes) and the built-in defaults still find libc
    monkeypatch.setattr(elfscan, "_ldconfig_dirs", list)
    fallback = system_library_dirs()
    assert resolve_needed(libs["plain"], fallback)["libc.so.6"] is not None


def test_not_elf(tmp_path: Path) -> None:
    text = tmp_path / "libfake.so"
    text.write_text("INPUT(-lc)\n")  # a linker script named like a library
    broken = tmp_path / "libbroken.so"
    broken.write_bytes(b"\x7fELF" + b"\xff" * 60)  # the magic, then garbage
    for func in (needed, rpaths, undefined_symbols, exported_symbols, cxx11_abi):
        with pytest.raises(NotElfError, match="not an ELF file"):
            func(text)
        with pytest.raises(NotElfError, match="unreadable ELF file"):
            func(broken)


@pytest.mark.parametrize(
    ("mangled", "torch"),
    [
        ("_ZNK3c106SymInt22maybe_as_int_slow_pathEv", True),
        ("_ZN2at6TensorC1Ev", True),
        ("_ZN5torch3jit6tracer9ArgumentsEv", True),
        ("_ZN6caffe28TypeMeta3NewEv", True),
        ("_Z3fooRKN2at6TensorE", True),  # torch type in the signature of a non-torch function
        ("_ZN2atplERKNS_6TensorES2_", True),  # at::operator+
        ("_ZN12atomic_thing3getEv", False),  # "12atomic_thing", not at::
        ("_ZNSt6vectorIiSaIiEE9push_backEOi", False),
        ("c10_looking_c_function", False),
        ("PyModule_Create2", False),
    ],
)
def test_is_torch_symbol(mangled: str, torch: bool) -> None:
    assert is_torch_symbol(mangled) is torch


def test_demangle(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["_ZNK3c106SymInt22maybe_as_int_slow_pathEv", "plain_c"]
    if shutil.which("c++filt"):
        assert demangle(names) == ["c10::SymInt::maybe_as_int_slow_path() const", "plain_c"]
    monkeypatch.setattr(elfscan.shutil, "which", lambda _name: None)
    assert demangle(names) == names
    assert demangle([]) == []


# ------------------------------------------------------------------------------------------ a fake torch

C10_H = """
#include <string>
namespace c10 {
struct SymInt {
  long data_;
  long maybe_as_int_slow_path() const;
  bool sym_ne_slow_path(const SymInt&) const;
};
}
namespace at { int foo(const std::string&); }
"""
C10_NEW = (
    C10_H
    + """
namespace c10 {
long SymInt::maybe_as_int_slow_path() const { return data_; }
bool SymInt::sym_ne_slow_path(const SymInt& o) const { return data_ != o.data_; }
}
"""
)
C10_OLD = (
    C10_H
    + """
namespace c10 { long SymInt::maybe_as_int_slow_path() const { return data_; } }
"""
)
TORCH_CPU = C10_H + "namespace at { int foo(const std::string& s) { return (int)s.size(); } }\n"
EXT = (
    C10_H
    + """
namespace c10 { void never_defined() __attribute__((weak)); }
extern "C" int unrelated_c_function(void);
int ext_entry(const c10::SymInt& a, const c10::SymInt& b) {
  if (c10::never_defined) c10::never_defined();
  return (int)a.maybe_as_int_slow_path() + a.sym_ne_slow_path(b) + at::foo("x") + unrelated_c_function();
}
"""
)


def fake_torch(lib: Path, c10_source: str, with_cuda: bool) -> Path:
    """torch/lib with libc10.so, libtorch_cpu.so (defines at::foo), libtorch.so (needs libtorch_cpu)."""
    cc(lib / "libc10.so", c10_source, "-Wl,-soname,libc10.so", cxx=True)
    cc(lib / "libtorch_cpu.so", TORCH_CPU, f"-L{lib}", "-lc10", "-Wl,-soname,libtorch_cpu.so", cxx=True)
    cc(lib / "libtorch.so", "", f"-L{lib}", "-Wl,--no-as-needed", "-ltorch_cpu", "-Wl,-soname,libtorch.so")
    if with_cuda:
        cc(lib / "libc10_cuda.so", "int c10_cuda_x(void) { return 0; }", "-Wl,-soname,libc10_cuda.so")
    return lib


@pytest.fixture(scope="module")
def torch_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    root = tmp_path_factory.mktemp("faketorch")
    new = fake_torch(root / "new" / "torch" / "lib", C10_NEW, with_cuda=True)
    old = fake_torch(root / "old" / "torch" / "lib", C10_OLD, with_cuda=False)
    link = [f"-L{new}", "-Wl,--no-as-needed", "-ltorch", "-lc10", "-lc10_cuda"]
    ext = cc(root / "ext" / "ext.abi3.so", EXT, *link, cxx=True)
    ext_old_abi = cc(root / "ext" / "ext_old_abi.so", EXT, *link, "-D_GLIBCXX_USE_CXX11_ABI=0", cxx=True)
    return {"new": new, "old": old, "ext": ext, "ext_old_abi": ext_old_abi}


@needs_gcc
def test_abi_check_fake_torch(torch_pair: dict[str, Path]) -> None:
    ext = torch_pair["ext"]
    report = abi_report(ext, torch_pair["new"])
    # maybe_as_int_slow_path, sym_ne_slow_path, at::foo (the weak c10::never_defined does not count)
    assert report.checked == 3
    assert report.missing == [] and report.ok
    assert [Path(p).name for p in report.providers] == [
        "libtorch.so",
        "libc10.so",
        "libc10_cuda.so",
        "libtorch_cpu.so",
    ]
    old = abi_report(ext, torch_pair["old"])
    assert old.missing == ["c10::SymInt::sym_ne_slow_path(c10::SymInt const&) const"]
    assert old.missing_mangled == ["_ZNK3c106SymInt16sym_ne_slow_pathERKS0_"]
    assert old.missing_libraries == ["libc10_cuda.so"] and not old.ok
    assert abi_check(ext, torch_pair["old"]) == old.missing


@needs_gcc
def test_cxx11_abi(torch_pair: dict[str, Path], libs: dict[str, Path]) -> None:
    assert cxx11_abi(torch_pair["ext"]) is True
    assert cxx11_abi(torch_pair["new"] / "libtorch_cpu.so") is True
    assert cxx11_abi(torch_pair["ext_old_abi"]) is False
    assert cxx11_abi(libs["foo"]) is None


# ------------------------------------------------------------------------------------------- real wheels

WHEELS = {
    "sgl": ("sgl-kernel", "0.3.21", r"sgl_kernel/sm100/common_ops\.abi3\.so"),
    "torch291": ("torch", "2.9.1", r"torch/lib/lib(?:c10|torch)[^/]*\.so"),
    "torch280": ("torch", "2.8.0", r"torch/lib/lib(?:c10|torch)[^/]*\.so"),
}


def cache_root() -> Path:
    return Path(os.environ.get("BWSTACK_TEST_CACHE") or Path.home() / ".cache" / "bwstack-tests")


def real_wheel(name: str, version: str) -> Path:
    """The cp312 / abi3 x86_64 wheel from the cache, else from PyPI with pip (skip if that fails)."""
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"

    def cached() -> Path | None:
        hits = [
            p
            for p in sorted(wheels.glob(f"{stem}*.whl"))
            if ("cp312-cp312" in p.name or "abi3" in p.name) and p.name.endswith("x86_64.whl")
        ]
        return hits[0] if hits else None

    if (hit := cached()) is not None:
        return hit
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet"]
        cmd += ["--only-binary", ":all:", "--python-version", "3.12", "-d", tmp, f"{name}=={version}"]
        # pip does not widen manylinux_2_28 to older tags: sgl-kernel is manylinux2014 (cp310-abi3)
        cmd += ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        got = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(got) != 1:
            pytest.skip(f"cannot download {name}=={version} (no network?): {proc.stderr.strip()[-400:]}")
        os.replace(got[0], wheels / got[0].name)  # atomic: a concurrent run sees all of it or nothing
    hit = cached()
    assert hit is not None
    return hit


def unpack(wheel: Path, pattern: str) -> Path:
    """Members of ``wheel`` matching ``pattern`` under <cache>/unpacked/<wheel name>/ (kept for next time)."""
    dest = cache_root() / "unpacked" / wheel.name.removesuffix(".whl")
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            target = dest / info.filename
            if not re.fullmatch(pattern, info.filename) or ".." in info.filename.split("/"):
                continue
            if target.is_file() and target.stat().st_size == info.file_size:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
                shutil.copyfileobj(src, out, 1 << 20)
            os.replace(out.name, target)
    return dest


@pytest.fixture(scope="session")
def real() -> dict[str, Path]:
    """{"sgl": common_ops.abi3.so, "torch291": torch/lib, "torch280": torch/lib} from the real wheels."""
    out = {}
    for key, (name, version, pattern) in WHEELS.items():
        root = unpack(real_wheel(name, version), pattern)
        out[key] = root / "sgl_kernel/sm100/common_ops.abi3.so" if key == "sgl" else root / "torch/lib"
    return out


@pytest.mark.network
@pytest.mark.slow
def test_real_sgl_kernel_dynamic(real: dict[str, Path]) -> None:
    ext = real["sgl"]
    deps = needed(ext)
    assert "libcudart.so.12" in deps and "libcudart.so.13" not in deps  # a CUDA 12.9 build
    assert {"libcuda.so.1", "libnvrtc.so.12", "libc10.so", "libtorch_cuda.so", "libnuma.so.1"} <= set(deps)
    assert rpaths(ext) == [] and soname(ext) is None
    assert cxx11_abi(ext) is True and cxx11_abi(real["torch291"] / "libc10.so") is True
    found = resolve_needed(ext, [str(real["torch291"])])
    assert found["libc10.so"] == str(real["torch291"] / "libc10.so")
    assert found["libcudart.so.12"] is None  # no RPATH: only torch's preloading makes it load
    loaded = elfscan.torch_loaded(real["torch291"])
    assert loaded["libtorch_cpu.so"] == str(real["torch291"] / "libtorch_cpu.so")
    assert resolve_needed(ext, [], preloaded=loaded)["libtorch_cuda.so"] == loaded["libtorch_cuda.so"]


@pytest.mark.network
@pytest.mark.slow
def test_real_abi_check(real: dict[str, Path]) -> None:
    start = time.perf_counter()
    ok = abi_report(real["sgl"], real["torch291"])
    elapsed = time.perf_counter() - start
    assert ok.checked == 122 and ok.missing == [] and ok.missing_libraries == []
    old = abi_check(real["sgl"], real["torch280"])
    assert old == [
        "c10::SymInt::maybe_as_int_slow_path() const",
        "c10::SymInt::sym_ne_slow_path(c10::SymInt const&) const",
    ]
    assert elapsed < 30  # ~0.6 s here


@pytest.mark.parametrize(
    ("first", "second", "alternatives"),
    [
        ("torchcodec/libtorchcodec_core4.so", "torchcodec/libtorchcodec_core7.so", True),
        ("torchcodec/libtorchcodec_pybind_ops6.so", "torchcodec/libtorchcodec_pybind_ops8.so", True),
        ("bitsandbytes/libbitsandbytes_cuda118.so", "bitsandbytes/libbitsandbytes_cuda128.so", True),
        ("torch_c_dlpack_ext/addon_torch24.so", "torch_c_dlpack_ext/addon_torch29.so", True),
        ("flash_attn/flash_attn_2_cuda.so", "flash_attn/flash_attn_3_cuda.so", False),
        ("flash_attn/flash_attn2.so", "flash_attn/flash_attn3.so", False),
        ("pkg/fa2.abi3.so", "pkg/fa3.abi3.so", False),
        ("sgl_kernel/common_ops_sm90.so", "sgl_kernel/common_ops_sm120.so", False),
        ("pkg/ops_SM90.so", "pkg/ops_SM100.so", False),
        ("pkg/ops_sm_90.so", "pkg/ops_sm_120.so", False),
        ("pkg/kernels_cu12.so", "pkg/kernels_cu13.so", False),
        ("pkg/ops_cuda_12.so", "pkg/ops_cuda_13.so", False),
        ("pkg/ops_gfx90.so", "pkg/ops_gfx942.so", False),
        ("pkg/_C.cpython-311-x86_64-linux-gnu.so", "pkg/_C.cpython-312-x86_64-linux-gnu.so", False),
        ("one/libtorchcodec_core5.so", "two/libtorchcodec_core6.so", False),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_only_files_a_package_chooses_between_at_run_time_are_alternatives(first, second, alternatives):
    """The ABI checks pass a group when one member loads: grouping two extensions that must each load would let
    a working one hide a broken one."""
    from bwstack.probe.main import _alternative_key

    assert (_alternative_key(Path(first)) == _alternative_key(Path(second))) is alternatives
