"""The real cu128 stack from PyPI (slow tier: ~5 GB of wheels, ~10 GB installed, about a minute cold).

Everything here runs on real artifacts: the lock's closure installed with hashes required, the real
libraries read by the checks, sglang's real files patched and reverted. The env is conftest's `real` fixture
(shared with the serve-plan truth tests); BWSTACK_TEST_REAL_ROOT reuses a store between runs (and BWSTACK_CACHE
shares its downloads with other tiers).
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from helpers import needs_py312

pytestmark = [pytest.mark.slow, pytest.mark.network, needs_py312]

NVCC_WAIVER = "nvcc=the CUDA 12.8 toolkit from NVIDIA's PyPI wheels has no nvcc (only ptxas and NVVM)"


_VERIFIED: dict[tuple, tuple] = {}


def _verify(real, *args):
    """One verify run per distinct question (each takes ~30 s on the real env); twin envs are never cached."""
    key = args
    if key in _VERIFIED and "--env" not in args:
        return _VERIFIED[key]
    result = real.run("verify", "--no-runtime", "--json", *args, timeout=900)
    payload = json.loads(result.stdout)
    checks = next(iter(payload["hosts"].values()))["checks"]
    _VERIFIED[key] = (result.returncode, {c["check"]: c for c in checks})
    return _VERIFIED[key]


def _failed(checks):
    return sorted(name for name, c in checks.items() if c["outcome"] in ("failed", "error"))


# ------------------------------------------------------------------------------------------------ issue 2


def test_the_cu128_closure_installs_from_the_lock_with_every_hash_verified(real):
    record = real.store.active().record
    assert record.profile == "cu128" and record.passed
    assert len(record.packages) == 169
    assert all(p["hash_verified"] for p in record.packages.values())
    assert record.torch == {"version": "2.9.1+cu128", "cuda": "12.8"}


# ------------------------------------------------------------------------------------------------ issue 5


def test_the_real_cu128_env_passes_the_cu128_checks(real):
    code, checks = _verify(real, "--profile", "cu128", "--skip", NVCC_WAIVER)
    assert _failed(checks) == [] and code == 0
    for name in ("every_torch_symbol_extensions_need_is_exported_by_the_installed_torch",
                 "every_extension_needs_the_libcudart_major_of_torch",
                 "torch_carries_kernels_for_the_target_capability",
                 "sgl_kernel_common_ops_carries_kernels_for_the_target_capability",
                 "every_closure_package_is_installed_at_its_locked_version"):  # fmt: skip
        assert checks[name]["outcome"] == "passed", name


def test_without_the_waiver_exactly_the_nvcc_checks_fail_and_say_why(real):
    code, checks = _verify(real, "--profile", "cu128")
    assert code == 1
    assert _failed(checks) == [
        "flashinfer_sm120_kernels_come_from_its_jit_cache_or_nvcc",
        "nvcc_compiles_for_the_target_architecture",
        "toolkit_nvcc_is_the_profiles_cuda_version",
    ]
    assert "ship no nvcc" in checks["toolkit_nvcc_is_the_profiles_cuda_version"]["message"]


def test_the_same_env_checked_against_cu130_fails_with_specific_messages(real):
    code, checks = _verify(real, "--profile", "cu130", "--skip", NVCC_WAIVER)
    assert code == 1
    assert (
        "built for CUDA 12.8, profile cu130 expects 13.0" in checks["torch_cuda_version_matches_the_profile"]["message"]
    )
    assert "libcudart.so.12" in checks["every_extension_needs_the_libcudart_major_of_torch"]["message"]
    assert "torch 2.9.1 (locked 2.9.1+cu130)" in checks["every_pinned_package_is_at_the_locked_version"]["message"]


@pytest.fixture
def twin_env(real, tmp_path):
    """A hard-link copy of the active generation (cp -al): changes to it replace files, never the original.
    Only the copy's directories are made writable (they are its own; its files share their inodes, and so
    their modes, with the sealed generation, whose manifest records them)."""
    src = real.store.active().env
    dest = tmp_path / "twin"
    subprocess.run(["cp", "-al", str(src), str(dest)], check=True)
    subprocess.run(["find", str(dest), "-type", "d", "-exec", "chmod", "u+w", "{}", "+"], check=True)
    yield dest
    shutil.rmtree(dest, ignore_errors=True)
    assert real.store.active().verify("quick") == [], "the generation the twin was copied from is untouched"


def test_sgl_kernel_against_torch_2_8_fails_the_abi_check_naming_the_symbol(real, twin_env):
    from bwstack.lock.uvtool import run_uv, uv_env

    result = run_uv(
        ["pip", "install", "--python", str(twin_env / "bin" / "python"), "--no-deps", "torch==2.8.0"],
        env=uv_env({"UV_CACHE_DIR": str(real.store.layout.uv_cache)}), capture=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-1000:]
    _code, checks = _verify(real, "--profile", "cu128", "--env", str(twin_env), "--skip", NVCC_WAIVER)
    message = checks["every_torch_symbol_extensions_need_is_exported_by_the_installed_torch"]["message"]
    assert "sgl_kernel/sm100/common_ops.abi3.so" in message
    assert "c10::SymInt::maybe_as_int_slow_path() const" in message
    assert checks["module_imports[sgl_kernel]"]["outcome"] == "failed"
    assert "maybe_as_int_slow_path" in checks["module_imports[sgl_kernel]"]["message"]


def test_unpatched_sglang_fails_the_symm_mem_check_naming_the_keyerror_and_the_patch_fixes_it(real, twin_env):
    assert real.run("patch", "revert", "--env", str(twin_env), "--profile", "cu128").returncode == 0
    _, checks = _verify(real, "--profile", "cu128", "--env", str(twin_env), "--skip", NVCC_WAIVER)
    check = checks["feature_state_is_what_the_lock_expects[torch_symm_mem_allreduce]"]
    assert check["outcome"] == "failed" and "KeyError: 12" in check["message"]
    assert real.run("patch", "apply", "--env", str(twin_env), "--profile", "cu128").returncode == 0
    _, checks = _verify(real, "--profile", "cu128", "--env", str(twin_env), "--skip", NVCC_WAIVER)
    assert checks["feature_state_is_what_the_lock_expects[torch_symm_mem_allreduce]"]["outcome"] == "passed"


def test_the_pinned_stack_reports_allreduce_fusion_unavailable_and_why(real):
    _, checks = _verify(real, "--profile", "cu128", "--skip", NVCC_WAIVER)
    check = checks["feature_state_is_what_the_lock_expects[flashinfer_allreduce_fusion]"]
    assert check["outcome"] == "passed"
    assert "silent no-op on SM120" in " ".join(check["notes"])


# ------------------------------------------------------------------------------------------------ issue 3


def test_backup_second_generation_rollback_then_the_env_reports_the_recorded_versions(real):
    first = real.store.active()
    assert json.loads(real.run("backup", "--json", check=True).stdout)["action"] == "verified"
    second = json.loads(real.run("build", "--profile", "cu128-unpatched", "--json", check=True, timeout=1800).stdout)
    assert second["generation"] != first.name and real.store.active().name == second["generation"]
    rolled = json.loads(real.run("rollback", "--json", check=True, timeout=900).stdout)
    assert rolled["generation"] == first.name
    facts = rolled["switch"]["post_check"]
    assert (facts["torch"], facts["torch_cuda"]) == (first.record.torch["version"], first.record.torch["cuda"])
    out = subprocess.run(
        [str(real.base / "ml-env" / "bin" / "python"), "-c",
         "import torch, sglang, flashinfer; print(torch.__version__, torch.version.cuda, flashinfer.__version__)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["2.9.1+cu128", "12.8", "0.6.3"]


def test_restore_from_an_archive_on_a_clean_root_imports(real, tmp_path):
    archive = tmp_path / "cu128.tar.zst"
    result = json.loads(real.run("backup", "--archive", str(archive), "--json", check=True, timeout=1800).stdout)
    print(f"\narchive: {result['archive']['bytes'] / 2**30:.2f} GiB in {result['archive']['seconds']:.1f} s")
    clean = {"BWSTACK_ROOT": str(tmp_path / "new-root"), "BWSTACK_ML_ENV": str(tmp_path / "new-ml-env")}
    restored = real.run(
        "restore", str(archive), "--sha256", result["archive"]["sha256"], "--json", check=True, timeout=1800,
        extra_env=clean,
    )  # fmt: skip
    facts = json.loads(restored.stdout)["switch"]["post_check"]
    assert (facts["torch"], facts["torch_cuda"]) == ("2.9.1+cu128", "12.8")
    shutil.rmtree(tmp_path / "new-root", ignore_errors=True)


# ------------------------------------------------------------------------------------------------ issue 16


def test_every_shared_library_of_the_real_env_reads_as_pyelftools_reads_it(real):
    """The probe's own ELF reader against an independent one on the stack's real files: every shared object's
    dynamic entries, and the symbols of the files the ABI check reads (sgl-kernel's extensions against torch's)."""
    pytest.importorskip("elftools", reason="pyelftools (the dev extra) is the second reader")
    from elftools.elf.elffile import ELFFile

    from bwstack.probe import elfscan

    site = next(real.ml_env.resolve().glob("lib/python3.*/site-packages"))
    checked = 0
    for path in sorted(site.rglob("*.so*")):
        if path.is_symlink() or not path.is_file():
            continue
        with open(path, "rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        with open(path, "rb") as fh:
            dynamic = next((s for s in ELFFile(fh).iter_sections() if s["sh_type"] == "SHT_DYNAMIC"), None)
            theirs = [(t.entry.d_tag, getattr(t, "needed", None)) for t in dynamic.iter_tags()] if dynamic else []
        needed = [n for tag, n in theirs if tag == "DT_NEEDED"]
        assert elfscan.needed(path) == needed, path
        checked += 1
    assert checked > 300
    for path in [*site.glob("sgl_kernel/*/common_ops*.so"), site / "torch/lib/libc10.so"]:
        with open(path, "rb") as fh:
            dynsym = ELFFile(fh).get_section_by_name(".dynsym")
            theirs = sorted((s.name, s["st_shndx"] != "SHN_UNDEF") for s in dynsym.iter_symbols() if s["st_name"])
        ours = sorted((s.name, s.defined) for s in elfscan._dynamic_symbols(elfscan._key(path)))
        assert ours == theirs, path
