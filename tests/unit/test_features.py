"""bwstack.probe.features reads the real sglang / flashinfer-python wheels' code and says what SM120 really gets."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from realwheels import site_packages

import bwstack.probe.features
from bwstack.probe import features
from bwstack.provision import patches

SYMM = "sglang/srt/distributed/device_communicators/torch_symm_mem.py"
GATE_059 = "sglang/srt/layers/communicator.py"
FLAG = "--enable-flashinfer-allreduce-fusion"


def env(tmp_path: Path, sglang: str | None = None, flashinfer: str | None = None) -> Path:
    dists = [("sglang", sglang)] if sglang else []
    dists += [("flashinfer-python", flashinfer)] if flashinfer else []
    return site_packages(tmp_path, *dists)


def symm(sp: Path, capability: str = "12.0") -> dict:
    return features.report(sp, capability)["torch_symm_mem_allreduce"]


def fusion(sp: Path, capability: str = "12.0") -> dict:
    return features.report(sp, capability)["flashinfer_allreduce_fusion"]


def widen_sglang_gate_to_sm120(sp: Path) -> None:
    """What-if: the edit a toolkit would make to let SM120 through sglang 0.5.9's fusion gate."""
    path = sp / GATE_059
    text = path.read_text()
    text = text.replace(
        "_is_sm100_supported = _is_cuda and is_sm100_supported()\n",
        "_is_sm100_supported = _is_cuda and is_sm100_supported()\n"
        "_is_sm120_supported = _is_cuda and is_sm120_supported()\n",
    )
    text = text.replace(
        "        (_is_sm90_supported or _is_sm100_supported)\n        and _is_flashinfer_available",
        "        (_is_sm90_supported or _is_sm100_supported or _is_sm120_supported)\n"
        "        and _is_flashinfer_available",
    )
    assert text.count("_is_sm120_supported") == 2
    path.write_text(text)


# ---------------------------------------------------------------------------------------- torch symm-mem


@pytest.mark.network
def test_unpatched_sglang_0_5_9_symm_mem_crashes_with_keyerror_12_at_its_lookup_sites(tmp_path: Path) -> None:
    result = symm(env(tmp_path, sglang="0.5.9"))
    assert result["state"] == "crashes"
    assert result["reason"].startswith("KeyError: 12")
    assert f"{SYMM}:83" in result["reason"]  # __init__: TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES[capability]
    assert f"{SYMM}:154" in result["reason"]  # all_reduce(): _WORLD_SIZES_MULTIMEM[capability]
    assert result["tables"] == {
        "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES": [9, 10],
        "TorchSymmMemCommunicator._WORLD_SIZES_MULTIMEM": [9, 10],
    }


@pytest.mark.network
def test_symm_mem_reason_says_pcie_cards_without_multicast_disable_it_at_run_time(tmp_path: Path) -> None:
    result = symm(env(tmp_path, sglang="0.5.9"))
    assert "without NVLink multicast" in result["reason"]
    assert f"{SYMM}:100 `if handle.multicast_ptr == 0:`" in result["reason"]
    assert f"{SYMM}:100: if handle.multicast_ptr == 0:" in result["evidence"]


@pytest.mark.network
def test_patched_sglang_0_5_9_symm_mem_is_available(tmp_path: Path) -> None:
    sp = env(tmp_path, sglang="0.5.9")
    patches.apply(sp, ["sglang-sm120-symm-mem"])
    result = symm(sp)
    assert result["state"] == "available"
    assert "KeyError" not in result["reason"]
    assert all(12 in keys for keys in result["tables"].values())


@pytest.mark.network
def test_unpatched_sglang_0_5_14_disables_symm_mem_instead_of_crashing(tmp_path: Path) -> None:
    result = symm(env(tmp_path, sglang="0.5.14"))
    assert result["state"] == "unavailable"
    assert "disables itself (no crash)" in result["reason"]
    assert any(".get(" in line for line in result["evidence"])


@pytest.mark.network
def test_patched_sglang_0_5_14_symm_mem_is_available(tmp_path: Path) -> None:
    sp = env(tmp_path, sglang="0.5.14")
    patches.apply(sp, ["sglang-sm120-symm-mem"])
    assert symm(sp)["state"] == "available"


@pytest.mark.network
def test_symm_mem_on_sm100_is_available_unpatched(tmp_path: Path) -> None:
    assert symm(env(tmp_path, sglang="0.5.9"), capability="10.0")["state"] == "available"


# ---------------------------------------------------------------------------------------- allreduce fusion


@pytest.mark.network
@pytest.mark.parametrize("flashinfer", ["0.6.3", "0.6.4"])
def test_pinned_stack_fusion_is_unavailable_and_the_flag_a_silent_no_op(tmp_path: Path, flashinfer: str) -> None:
    result = fusion(env(tmp_path, sglang="0.5.9", flashinfer=flashinfer))
    assert result["state"] == "unavailable"
    assert result["blocked_by"] == ["sglang-gate", "flashinfer-comm"]
    reason = result["reason"]
    assert reason.startswith("sglang 0.5.9 gates fusion to SM90/SM100")
    assert f"FlashInfer {flashinfer}'s comm module supports [9, 10]" in reason
    assert f"{FLAG} is a silent no-op on SM120" in reason


@pytest.mark.network
def test_sglang_0_5_9_gate_requires_sm90_or_sm100_resolved_to_their_definitions(tmp_path: Path) -> None:
    gate = fusion(env(tmp_path, sglang="0.5.9", flashinfer="0.6.4"))["sglang_gate"]
    assert (gate["file"], gate["function"], gate["admits"]) == (
        GATE_059,
        "apply_flashinfer_allreduce_fusion",
        False,
    )
    assert gate["admitted_majors"] == [9, 10]
    terms = {t["term"]: (t["resolves_to"], t["majors"]) for t in gate["arch_terms"]}
    assert terms == {
        "_is_sm90_supported": ("is_sm90_supported", [9]),
        "_is_sm100_supported": ("is_sm100_supported", [10]),
    }
    assert all("sglang/srt/utils/common.py:" in t["where"] for t in gate["arch_terms"])


@pytest.mark.network
def test_flashinfer_0_6_4_comm_module_lists_9_and_10_with_file_and_line(tmp_path: Path) -> None:
    result = fusion(env(tmp_path, sglang="0.5.9", flashinfer="0.6.4"))
    comm = result["flashinfer_comm"]
    assert (comm["file"], comm["line"], comm["supported_major_versions"]) == (
        "flashinfer/jit/comm.py",
        61,
        [9, 10],
    )
    assert "flashinfer/jit/comm.py:61: supported_major_versions=[9, 10]" in result["evidence"]


@pytest.mark.network
def test_flashinfer_0_6_4_headers_compile_the_lamport_kernel_out_for_sm12x(tmp_path: Path) -> None:
    guards = fusion(env(tmp_path, sglang="0.5.9", flashinfer="0.6.4"))["kernel_guards"]
    lamport = guards["trtllm_allreduce.cuh"]
    assert lamport["file"] == "flashinfer/data/include/flashinfer/comm/trtllm_allreduce.cuh"
    assert 711 in lamport["excluding_lines"] and len(lamport["excluding_lines"]) == 13
    assert lamport["empty_kernels"] == ["lamport_style_one_shot_all_reduce_norm_kernel (line 711)"]
    assert guards["trtllm_allreduce_fusion.cuh"]["excludes_target"] is False


@pytest.mark.network
def test_flashinfer_0_6_17_admits_sm120_but_sglang_0_5_9_gate_still_blocks_fusion(tmp_path: Path) -> None:
    result = fusion(env(tmp_path, sglang="0.5.9", flashinfer="0.6.17"))
    assert result["state"] == "unavailable"
    assert result["blocked_by"] == ["sglang-gate"]
    assert result["flashinfer_comm"]["supported_major_versions"] == [9, 10, 12]
    assert result["kernel_guards"]["trtllm_allreduce.cuh"]["excluding_lines"] == []
    assert "which blocks it although FlashInfer 0.6.17's comm module supports [9, 10, 12]" in result["reason"]


@pytest.mark.network
def test_a_widened_sglang_gate_with_flashinfer_0_6_4_would_crash_like_the_seed(tmp_path: Path) -> None:
    sp = env(tmp_path, sglang="0.5.9", flashinfer="0.6.4")
    widen_sglang_gate_to_sm120(sp)
    result = fusion(sp)
    assert (result["state"], result["blocked_by"]) == ("crashes", ["flashinfer-comm"])
    assert "RuntimeError: No supported CUDA architectures found for major versions [9, 10]" in result["reason"]


@pytest.mark.network
def test_widening_both_the_gate_and_flashinfer_0_6_4_list_is_broken_never_available(tmp_path: Path) -> None:
    """The seed's edit: add 12 to sglang's gate and to FlashInfer's list. The kernels still compile empty."""
    sp = env(tmp_path, sglang="0.5.9", flashinfer="0.6.4")
    widen_sglang_gate_to_sm120(sp)
    comm = sp / "flashinfer/jit/comm.py"
    text = comm.read_text()
    assert text.count("supported_major_versions=[9, 10]") >= 1
    comm.write_text(text.replace("supported_major_versions=[9, 10]", "supported_major_versions=[9, 10, 12]"))
    result = fusion(sp)
    assert result["state"] == "broken" and result["blocked_by"] == []
    assert "lamport_style_one_shot_all_reduce_norm_kernel (line 711)" in result["reason"]
    assert "wrong results, no error" in result["reason"]


@pytest.mark.network
def test_a_widened_sglang_gate_with_flashinfer_0_6_17_is_available_and_says_it_is_unvalidated(tmp_path: Path) -> None:
    sp = env(tmp_path, sglang="0.5.9", flashinfer="0.6.17")
    widen_sglang_gate_to_sm120(sp)
    result = fusion(sp)
    assert (result["state"], result["blocked_by"]) == ("available", [])
    assert result["sglang_gate"]["admitted_majors"] == [9, 10, 12]
    assert result["validated_on_hardware"] is False
    assert "not validated on SM12x hardware" in result["reason"]


@pytest.mark.network
def test_fusion_on_sm100_is_available_with_the_pinned_stack(tmp_path: Path) -> None:
    assert fusion(env(tmp_path, sglang="0.5.9", flashinfer="0.6.4"), capability="10.0")["state"] == "available"


@pytest.mark.network
def test_newest_sglang_moved_the_gate_and_the_reader_follows_it(tmp_path: Path) -> None:
    result = fusion(env(tmp_path, sglang="0.5.23", flashinfer="0.6.17"))
    gate = result["sglang_gate"]
    assert (gate["file"], gate["function"]) == (
        "sglang/srt/layers/layer_boundary/residual/add_norm.py",
        "flashinfer_ar_fusion_applies",
    )
    assert gate["admitted_majors"] == [9, 10]  # via get_platform().is_sm90 -> _PLATFORM_PROBES -> common.py
    assert any("sglang/srt/runtime_context.py:" in t["where"] for t in gate["arch_terms"])
    assert (result["state"], result["blocked_by"]) == ("unavailable", ["sglang-gate"])


# ---------------------------------------------------------------------------------------- the report


@pytest.mark.network
def test_report_names_the_installed_versions_and_the_target(tmp_path: Path) -> None:
    result = features.report(env(tmp_path, sglang="0.5.9", flashinfer="0.6.4"))
    assert result["target_capability"] == "12.0"
    assert result["packages"]["sglang"] == "0.5.9"
    assert result["packages"]["flashinfer-python"] == "0.6.4"
    assert result["packages"]["torch"] is None


@pytest.mark.network
def test_patched_pinned_stack_meets_the_lock_expectations(tmp_path: Path) -> None:
    sp = env(tmp_path, sglang="0.5.9", flashinfer="0.6.4")
    patches.apply(sp, ["sglang-sm120-symm-mem"])
    result = features.report(sp)
    assert features.states(result) == {
        "torch_symm_mem_allreduce": "available",
        "flashinfer_allreduce_fusion": "unavailable",
    }
    json.dumps(result)  # the probe ships it as JSON


def test_an_env_without_the_packages_reports_not_installed(tmp_path: Path) -> None:
    result = features.report(tmp_path)
    assert features.states(result) == {
        "torch_symm_mem_allreduce": "not-installed",
        "flashinfer_allreduce_fusion": "not-installed",
    }


def test_features_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(bwstack.probe.features.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    # and the probe's own standard-library modules
    allowed = set(sys.stdlib_module_names) | {"__future__", "bwstack.probe.envinspect", "bwstack.probe.treecheck"}
    assert {m for m in imported if m.split(".")[0] not in allowed and m not in allowed} == set()
