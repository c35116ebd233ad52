"""Runtime, when a GPU is present: generic checks run on any GPU; SM120-only ones skip on others."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def runtime(facts, gpu):
    if "runtime" not in facts:
        pytest.skip("runtime probes were not run (--stack-no-runtime)")
    if facts["runtime"].get("error"):
        pytest.fail(f"the runtime probe could not start: {facts['runtime']['error']}")
    return facts["runtime"]


def test_gpus_are_the_profiles_target_capability(gpu, profile):
    want = profile.expect.target_capability
    other = sorted({f"{g['capability']} ({g['name']})" for g in gpu["gpus"] if g["capability"] != want})
    assert not other, f"GPU capability {', '.join(other)}, not the profile's {want}"


def test_torch_sees_every_gpu(runtime, gpu):
    assert runtime["cuda_available"], "torch.cuda.is_available() is False although nvidia-smi lists GPUs"
    assert runtime["device_count"] == len(gpu["gpus"]), (
        f"torch sees {runtime['device_count']} GPU(s), nvidia-smi {len(gpu['gpus'])}: check CUDA_VISIBLE_DEVICES"
    )


def test_matmul_is_correct_on_every_gpu(runtime, gpu):
    ran = len(runtime["devices"])
    assert ran == len(gpu["gpus"]) and ran > 0, f"the matmul ran on {ran} GPU(s), nvidia-smi lists {len(gpu['gpus'])}"
    bad = [
        f"cuda:{d['index']}: {d.get('matmul_error') or d.get('matmul_max_rel_err')}"
        for d in runtime["devices"]
        if not d["matmul_ok"]
    ]
    assert not bad, f"a 512x512 matmul is wrong or fails: {'; '.join(bad)}"


def test_sgl_kernel_op_runs(runtime, facts):
    if not facts["env"]["installed"].get("sgl-kernel"):
        pytest.skip("sgl_kernel is not installed (see the version checks)")
    result = runtime["sgl_kernel_rmsnorm"]
    assert result["ok"], f"sgl_kernel.rmsnorm on cuda:0: {result.get('error') or result}"


def test_flashinfer_op_runs(runtime, facts):
    if not facts["env"]["installed"].get("flashinfer-python"):
        pytest.skip("flashinfer is not installed (see the version checks)")
    result = runtime["flashinfer_rmsnorm"]
    assert result["ok"], f"flashinfer.norm.rmsnorm on cuda:0: {result.get('error') or result}"


def test_nccl_allreduce_across_all_gpus_gives_the_right_sum(runtime, gpu):
    result = runtime["nccl_allreduce"]
    world = result.get("world_size")
    assert world == len(gpu["gpus"]), f"the all-reduce ran over {world} GPU(s), nvidia-smi lists {len(gpu['gpus'])}"
    assert result.get("ok"), f"NCCL all-reduce over {result.get('world_size')} GPU(s): {result.get('error') or result}"
