"""serve-plan's node side on files made here: the stand-in nvidia-smi the simulated target answers with, and the
readers of kernel facts (cubin architectures, DeepGEMM's kernel sources, triton_kernels' TMA gather threshold,
FlashInfer's architecture guards). The real files are read in the slow tier (test_serveplan_truth.py)."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bwstack.probe.serveplan import node

DEVICE = node.Device(node.SIMULATED, "12.0", 8, 98304, "NVIDIA RTX PRO 6000 Blackwell", "pcie")


def test_the_stand_in_nvidia_smi_answers_sglangs_memory_query_for_every_simulated_gpu(tmp_path: Path):
    node._stand_in_smi(tmp_path, DEVICE, sys.executable)
    smi = tmp_path / "nvidia-smi"
    out = subprocess.run(
        [str(smi), "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.split() == ["98304"] * 8
    named = subprocess.run([str(smi), "--query-gpu=index,name,compute_cap"], capture_output=True, text=True).stdout
    assert named.splitlines()[0] == "0, NVIDIA RTX PRO 6000 Blackwell, 12.0"
    assert "SIMULATED" in smi.read_text()


def _cubin(path: Path, sm: int) -> None:
    """An ELF header whose e_flags carry the SM number where CUDA cubins keep it (bits 8-15)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    struct.pack_into("<I", header, 48, sm << 8)
    path.write_bytes(bytes(header))


def test_flashinfer_cubins_are_grouped_by_family_with_their_architectures(tmp_path: Path):
    root = tmp_path / "flashinfer_cubin" / "cubins"
    _cubin(root / "75d4" / "fmha" / "trtllm-gen" / "a.cubin", 100)
    _cubin(root / "75d4" / "fmha" / "trtllm-gen" / "b.cubin", 103)
    _cubin(root / "e1e1" / "batched_gemm-2a674db-79e4d37" / "c.cubin", 100)
    families = node._cubin_categories(tmp_path)
    assert families == {
        "fmha": {"cubins": 2, "archs": {"sm_100": 1, "sm_103": 1}},
        "batched_gemm": {"cubins": 1, "archs": {"sm_100": 1}},
    }


def test_deepgemms_architectures_come_from_its_kernel_sources(tmp_path: Path):
    impls = tmp_path / "deep_gemm" / "include" / "deep_gemm" / "impls"
    impls.mkdir(parents=True)
    for name in ("sm90_fp8_gemm_1d1d.cuh", "sm100_bf16_gemm.cuh", "smxx_layout.cuh"):
        (impls / name).write_text("")
    assert node._deep_gemm(tmp_path) == {"impls": "deep_gemm/include/deep_gemm/impls", "archs": ["sm_90", "sm_100"]}
    assert node._deep_gemm(tmp_path / "nothing") is None


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("@triton.constexpr_function\ndef has_tma_gather():\n    return cuda_capability_geq(10, 0)\n", "10.0"),
        ("def has_tma_gather():\n    return False\n", None),
    ],
)
def test_triton_kernels_tma_gather_threshold_is_read_from_its_source(tmp_path: Path, source, expected):
    target = tmp_path / "triton_kernels" / "target_info.py"
    target.parent.mkdir()
    target.write_text("import triton\n\n" + source)
    facts = node._triton_kernels(tmp_path)
    assert facts["tma_gather_from"] == expected
    if expected:
        assert facts["site"] == "triton_kernels/target_info.py:4"


def test_flashinfers_architecture_guard_is_quoted_with_its_line(tmp_path: Path):
    header = tmp_path / "flashinfer" / "data" / "include" / "flashinfer" / "trtllm" / "fmha" / "fmhaRunner.cuh"
    header.parent.mkdir(parents=True)
    header.write_text('// x\n  FLASHINFER_CHECK(mSM == kSM_100 || mSM == kSM_103, "Unsupported architecture");\n')
    guards = node._flashinfer_guards(tmp_path)
    assert guards["fmha"]["site"] == "flashinfer/data/include/flashinfer/trtllm/fmha/fmhaRunner.cuh:2"
    assert "Unsupported architecture" in guards["fmha"]["code"]


def test_a_simulated_job_device_is_the_target_described(tmp_path: Path):
    spec = {"mode": "simulated", "capability": "12.0", "count": 8, "memory_mib": 98304,
            "name": "NVIDIA RTX PRO 6000 Blackwell", "interconnect": "pcie"}  # fmt: skip
    assert node.resolve_device(spec, tmp_path) == DEVICE


def test_a_missing_env_is_an_observation_error_not_a_crash(tmp_path: Path):
    observed = node.observe(tmp_path / "no-env", DEVICE, [{"id": "m", "model": "gpt-oss-20b", "tp": 8}])
    assert observed.error == f"no env at {tmp_path / 'no-env'}: no bin/python"
