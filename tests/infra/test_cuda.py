"""CUDA: the toolkit the env uses is the profile's, the driver is new enough, torch's CUDA is the profile's,
and every extension needs the libcudart of torch's CUDA major (the .12 vs .13 trap, both directions)."""

from __future__ import annotations

import os
import re

import pytest


def test_env_cuda_home_is_the_profiles_toolkit(facts, env, profile):
    cuda = facts["cuda"]
    assert cuda.get("cuda_home"), (
        f"the env sees no CUDA_HOME and no nvcc on PATH: FlashInfer cannot JIT-compile. Install the toolkit "
        f"(`bwstack cuda install --profile {profile.name}`) and provision so the generation links it."
    )
    want = os.path.realpath(profile.cuda.home)
    assert cuda["cuda_home_real"] == want or cuda["cuda_home"] == profile.cuda.home, (
        f"the env's CUDA_HOME is {cuda['cuda_home']} (-> {cuda['cuda_home_real']}), the profile's toolkit is "
        f"{profile.cuda.home}: FlashInfer would JIT with the wrong nvcc. Unset a stray CUDA_HOME or re-provision."
    )


def test_toolkit_nvcc_is_the_profiles_cuda_version(facts, env, profile):
    cuda = facts["cuda"]
    marker_note = (cuda.get("toolkit_marker") or {}).get("note")
    assert cuda.get("nvcc"), (
        f"no nvcc in {cuda.get('cuda_home')}/bin"
        + (f": {marker_note}" if marker_note else "")
        + f". FlashInfer JIT-compiles its SM120 kernels with nvcc; install CUDA {profile.cuda.version} with "
        "the apt method (`cuda_method: apt`)."
    )
    assert not cuda.get("nvcc_refused"), (
        f"{cuda['nvcc']} was not run: {cuda['nvcc_refused']}, so others could have put their own program there "
        "and the checks run as root. Make the toolkit's folders and nvcc root's, not writable by others."
    )
    assert (cuda.get("nvcc_version") or "").startswith(profile.cuda.major_minor + "."), (
        f"nvcc is {cuda.get('nvcc_version')}, the profile wants CUDA {profile.cuda.version}"
    )


def test_nvcc_compiles_for_the_target_architecture(facts, env, profile, record_property):
    compile_ = facts["cuda"].get("compile")
    if compile_ is None:
        refused = facts["cuda"].get("nvcc_refused")
        pytest.fail(
            f"nvcc not run: {refused}"
            if refused
            else "no nvcc to try (see test_toolkit_nvcc_is_the_profiles_cuda_version)"
        )
    if (facts.get("facts_source") or {}).get("nvcc_compile") == "recorded":
        record_property(
            "note",
            f"nvcc compiled for {compile_['arch']} in an earlier verify of this generation; the toolkit "
            f"({facts['cuda'].get('cuda_home')}, every file), nvcc's settings in the environment, the host "
            "compilers, the host and the generation are unchanged since",
        )
    assert compile_["ok"], (
        f"nvcc cannot compile for {compile_['arch']} ({compile_['error'][:300]}): FlashInfer's SM120 kernels "
        f"are JIT-compiled with -gencode=arch=compute_120a,code=sm_120a and need CUDA >= 12.8."
    )


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def test_driver_meets_the_profiles_minimum(facts, gpu, profile):
    driver = gpu.get("driver") or "0"
    assert _version_tuple(driver) >= _version_tuple(profile.cuda.min_driver), (
        f"driver {driver} < {profile.cuda.min_driver}, the minimum for CUDA {profile.cuda.version}: upgrade the "
        "driver (one R580 driver serves both the CUDA 13 and the CUDA 12.8 env)."
    )


def test_torch_cuda_version_matches_the_profile(env, profile):
    torch = env.get("torch_version_py") or {}
    assert torch.get("version"), "torch is not installed in this env"
    assert torch.get("cuda") == profile.expect.torch_cuda, (
        f"torch {torch['version']} is built for CUDA {torch.get('cuda')}, profile {profile.name} expects "
        f"{profile.expect.torch_cuda}: wrong torch build (index) for this profile."
    )


def test_every_extension_needs_the_libcudart_major_of_torch(facts, env, profile):
    torch_cuda = (env.get("torch_version_py") or {}).get("cuda") or ""
    major = torch_cuda.split(".")[0] if torch_cuda else str(profile.expect.cudart_major)
    want = f"libcudart.so.{major}"
    wrong = [
        f"{ext['path']} needs {', '.join(ext['cudart'])}"
        for ext in facts["elf"]["extensions"]
        if ext["cudart"] and ext["cudart"] != [want]
    ]
    assert not wrong, (
        f"torch is CUDA {torch_cuda} ({want}) but {len(wrong)} extension(s) link another libcudart: "
        f"{'; '.join(wrong[:5])}. They fail with 'cannot open shared object file' once torch's CUDA changes; "
        "install their build for this CUDA (e.g. sgl-kernel +cu130 for CUDA 13)."
    )
    assert major == str(profile.expect.cudart_major), (
        f"torch links libcudart.so.{major}, profile {profile.name} expects libcudart.so.{profile.expect.cudart_major}"
    )
