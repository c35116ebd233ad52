"""SM120 kernel availability, read statically from the fatbins (works without a GPU)."""

from __future__ import annotations

import pytest


def _covered(summaries: list[dict], what: str, capability: str) -> None:
    if not summaries:
        pytest.fail(f"{what}: no library found to read")
    bad = [s for s in summaries if s.get("error") or (s.get("has_device_code") and not s.get("covers"))]
    assert not bad, (
        f"{what} has no kernel image for capability {capability}: "
        + "; ".join(f"{s['path'].rsplit('/', 1)[-1]}: {s.get('error') or s.get('reason')}" for s in bad)
        + ". Expect 'no kernel image is available for execution on the device'; install a build with "
        f"sm_{capability.replace('.', '')} cubins or PTX."
    )


def test_torch_carries_kernels_for_the_target_capability(facts, env, profile):
    if "torch" not in profile.expect.sm120_kernels:
        pytest.skip(f"profile {profile.name} does not require SM120 kernels in torch")
    _covered(facts["fatbin"].get("torch", []), "torch (libtorch_cuda)", facts["capability"])


def test_sgl_kernel_common_ops_carries_kernels_for_the_target_capability(facts, env, profile):
    if "sgl-kernel" not in profile.expect.sm120_kernels:
        pytest.skip(f"profile {profile.name} does not require SM120 kernels in sgl-kernel")
    if "sgl_kernel" not in facts["fatbin"]:
        pytest.fail("sgl-kernel is not installed in this env")
    _covered(
        facts["fatbin"]["sgl_kernel"],
        f"sgl-kernel {facts['fatbin']['sgl_kernel_variant']}/common_ops",
        facts["capability"],
    )


def test_flashinfer_sm120_kernels_come_from_its_jit_cache_or_nvcc(facts, env):
    """flashinfer-cubin ships no SM120 cubins (trtllm-gen/deep-gemm are SM100); SM120 kernels come from the
    jit-cache's prebuilt .so files or are JIT-compiled with nvcc at first use."""
    fb = facts["fatbin"]
    if "flashinfer-python" not in facts["env"]["installed"]:
        pytest.skip("flashinfer is not installed in this env")
    jit = fb.get("flashinfer_jit_cache")
    compile_ = facts["cuda"].get("compile") or {}
    if jit and jit["covering"]:
        return
    assert compile_.get("ok"), (
        "FlashInfer has no prebuilt SM120 kernels here "
        f"(flashinfer-cubin archs: {', '.join((fb.get('flashinfer_cubin') or {}).get('archs', {})) or 'none'}; "
        f"jit-cache: {'absent' if not jit else str(jit['covering']) + ' covering files'}) and nvcc cannot "
        f"compile for {compile_.get('arch', 'sm_120a')}: {compile_.get('error') or 'no nvcc'}"
    )
