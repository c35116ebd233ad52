"""ABI: read from the ELF files (no import, so it works with the GPU busy or absent), then the real imports."""

from __future__ import annotations

import pytest

from bwstack.errors import BwstackError


def _extensions(facts):
    exts = facts["elf"]["extensions"]
    if facts["elf"]["torch_lib"] is None:
        pytest.fail("torch is not installed in this env, so no extension can load")
    return exts


def _groups(facts) -> dict[str, list[dict]]:
    """Extensions grouped with the alternatives their package chooses from at run time (torchcodec's
    FFmpeg 4..8 builds): a group works when one member does."""
    groups: dict[str, list[dict]] = {}
    for ext in _extensions(facts):
        groups.setdefault(ext["alternatives"], []).append(ext)
    return groups


def _describe(members: list[dict], key: str) -> str:
    if len(members) == 1:
        return f"{members[0]['path']}: {', '.join(members[0][key][:4])}"
    return f"{members[0]['alternatives']} (none of {len(members)} variants): " + ", ".join(
        sorted({x for m in members for x in m[key]})[:6]
    )


def test_every_needed_library_of_every_extension_resolves_in_the_env(facts, env, lock):
    broken = [_describe(m, "unresolved") for m in _groups(facts).values() if all(e["unresolved"] for e in m)]
    if not broken:
        return
    host = facts.get("host", {})
    try:  # the lock's rule (the mlenv role installs by the same one)
        chosen = lock.system_packages_for(host.get("os_id"), host.get("os_version_id"))
        needs = f"the lock's system_packages for {chosen.os}: {', '.join(chosen.packages) or 'none'}"
    except BwstackError as exc:
        needs = str(exc)
    pytest.fail(
        f"{len(broken)} extension(s) need libraries the loader will not find: {'; '.join(broken[:5])}. "
        "A libcudart/libcublas of another CUDA major means the extension's CUDA build does not match torch's; "
        f"a system library needs its OS package ({needs})."
    )


def test_driver_libraries_extensions_need_are_present_when_a_gpu_is(facts, env):
    needs = sorted({lib for e in _extensions(facts) for lib in e["unresolved_driver_libs"]})
    if not facts["gpu"]["present"]:
        pytest.skip(
            f"no NVIDIA driver here ({facts['gpu']['reason']}); extensions need {', '.join(needs) or 'none'} from it"
        )
    assert not needs, f"the driver is present but {', '.join(needs)} cannot be found: reinstall the driver's libraries"


def _accepted(profile, record_property, path: str, what: str) -> bool:
    reason = profile.expect.known_breaks.get(path)
    if reason:
        record_property("note", f"{path}: {what}, accepted by the lock: {reason}")
    return reason is not None


def test_every_torch_symbol_extensions_need_is_exported_by_the_installed_torch(facts, env, profile, record_property):
    broken = []
    for members in _groups(facts).values():
        failing = [e for e in members if e["missing_torch_symbols"]]
        if len(failing) < len(members):
            continue
        for e in failing:
            if not _accepted(profile, record_property, e["path"], f"missing {e['missing_torch_symbols'][0]}"):
                broken.append(f"{e['path']}: {'; '.join(e['missing_torch_symbols'][:3])}")
    assert not broken, (
        f"undefined symbol at import: {' | '.join(broken[:4])}. These extensions were built against another "
        "torch; install the builds made for the installed torch (the lock pins matching ones)."
    )


def test_extensions_use_the_cxx11_abi_of_torch(facts, env, profile, record_property):
    torch_abi = facts["elf"].get("torch_cxx11_abi")
    if torch_abi is None:
        pytest.skip("torch's C++ ABI could not be read (no std::__cxx11 symbols in libtorch_cpu)")
    wrong = [
        e["path"]
        for e in _extensions(facts)
        if e["cxx11_abi"] is not None
        and e["cxx11_abi"] != torch_abi
        and not _accepted(profile, record_property, e["path"], f"C++11 ABI {e['cxx11_abi']}, torch {torch_abi}")
    ]
    assert not wrong, f"_GLIBCXX_USE_CXX11_ABI differs from torch ({torch_abi}) in: {', '.join(wrong[:5])}"


@pytest.mark.parametrize("module", ["torch", "sgl_kernel", "flashinfer", "sglang"])
def test_module_imports(facts, env, module):
    if "imports" not in facts:
        pytest.skip("import checks not run (static checks only)")
    result = facts["imports"][module]
    if not result["installed"]:
        pytest.skip(f"{module} is not installed in this env")
    if result["ok"]:
        return
    if result.get("blocked_by_missing_driver"):
        stub = result.get("with_stub_libcuda") or {}
        assert stub.get("ok") is not False, (
            f"import {module} needs the NVIDIA driver (libcuda.so.1), absent here; with a stand-in libcuda it "
            f"still fails: {stub.get('error')}"
        )
        if stub.get("ok") is None:
            pytest.skip(
                f"import {module} stops at libcuda.so.1 (no NVIDIA driver here) and no C compiler was available "
                f"to build a stand-in; the static ABI checks above cover its symbols"
            )
        return  # imports with a stand-in driver library: every other link is sound
    pytest.fail(f"import {module} fails: {result['error']}")
