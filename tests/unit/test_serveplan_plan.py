"""serve-plan's plans, table, JSON and node check, replayed from RECORDED FIXTURES: observations the node side made
of the real cu128 env (sglang 0.5.9, flashinfer 0.6.3, sgl-kernel 0.3.21, torch 2.9.1) with the RTX PRO 6000 x8
target simulated, on a machine whose toolkit has no nvcc (tests/fixtures/serveplan/record.py re-records them).
The slow tier (test_serveplan_truth.py) checks the same choices against the real env itself."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bwstack.serveplan import assemble, catalogue, check, render
from bwstack.serveplan.records import COMPONENTS, Verdict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "serveplan"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def plan_of(name: str, mutate=None):
    observation = fixture(name)["base"]
    if mutate:
        mutate(observation)
    return assemble.plan_for(observation, 0, catalogue.load())


def path(plan, component: str):
    return next(p for p in plan.paths if p.component == component)


def with_nvcc(observation: dict) -> None:
    """The same observation on a host whose env has an nvcc that compiles sm_120a (a test-made variant)."""
    observation["kernels"]["nvcc"] = {
        "nvcc": "/usr/local/cuda-12.8/bin/nvcc",
        "nvcc_version": "12.8.93",
        "cuda_home": "/usr/local/cuda-12.8",
        "compile": {"arch": "sm_120a", "ok": True, "error": ""},
    }


class Replay:
    """Answers the fix search's re-plans with the recorded ones, checking it asks for the same requests."""

    def __init__(self, name: str) -> None:
        self.runs = list(fixture(name)["runs"])
        self.asked: list[list[dict]] = []

    def __call__(self, requests: list[dict]) -> dict:
        self.asked.append(requests)
        recorded = self.runs.pop(0)
        strip = [{k: v for k, v in r.items() if k != "id"} for r in requests]
        assert strip == [{k: v for k, v in r.items() if k != "id"} for r in recorded["requests"]]
        return recorded


# ------------------------------------------------------------------------------------------------ paths


def test_the_seeds_plan_says_all_reduce_runs_on_nccl_because_custom_all_reduce_disables_itself_on_pcie():
    plan = plan_of("llama-eagle3-tp8-sm120")
    row = path(plan, "all-reduce")
    assert (row.backend, row.verdict) == ("nccl", Verdict.RUNS)
    assert "Custom allreduce is disabled because it's not supported on more than two PCIe-only GPUs" in row.why
    assert "sglang/srt/distributed/device_communicators/custom_all_reduce.py:147" in row.decided_at
    # consistent with `bwstack features`: the symm-mem state the plan quotes is the feature report's
    assert "torch symm-mem is off (--enable-torch-symm-mem not given; bwstack features: available)" in row.why
    assert "libnccl.so.2: sm_120 cubin ×12" in row.why  # loadable cubins only: the 127 relocatable ones not counted


def test_the_seeds_plan_shows_the_eagle3_draft_and_its_own_attention_backends():
    plan = plan_of("llama-eagle3-tp8-sm120")
    spec = path(plan, "speculative decoding")
    assert spec.backend == "EAGLE3 steps=5 topk=4 draft_tokens=8" and spec.verdict is Verdict.RUNS
    assert "LlamaForCausalLMEagle3" in spec.why
    assert path(plan, "attention (draft decode)").backend == "flashinfer"
    assert plan.server_args["speculative_eagle_topk"] == 4


def test_gpt_oss_moe_lands_on_sm100_only_trtllm_kernels_on_sm120():
    plan = plan_of("gpt-oss-20b-tp8-sm120")
    moe = path(plan, "MoE")
    assert (moe.backend, moe.verdict) == ("flashinfer_mxfp4", Verdict.MISSING)
    assert "sm_100 x838 only: none for 12.0" in moe.why
    assert any(s.startswith("sglang/srt/server_args.py:1372") for s in moe.decided_at)
    assert path(plan, "attention").backend == "triton"


def test_deepseek_fp8_block_gemm_goes_to_deepgemm_which_has_no_sm120_kernels():
    plan = plan_of("deepseek-v3-tp8-sm120")
    gemm = path(plan, "dense GEMM")
    assert (gemm.backend, gemm.verdict) == ("deep_gemm", Verdict.MISSING)
    assert "sm_90, sm_100 implementations only" in gemm.why
    assert gemm.catalogue == ("deepgemm-no-sm120",)
    assert "sglang/srt/layers/quantization/fp8_utils.py:264" in gemm.decided_at


def test_nvfp4_on_flashinfer_063_is_known_wrong_from_the_catalogue():
    plan = plan_of("llama-nvfp4-tp8-sm120", with_nvcc)
    gemm = path(plan, "dense GEMM")
    assert (gemm.backend, gemm.verdict) == ("flashinfer mm_fp4 (cutlass)", Verdict.KNOWN_WRONG)
    assert gemm.catalogue == ("flashinfer-mm-fp4-cutlass-zeros-sm120",)
    assert "https://github.com/flashinfer-ai/flashinfer/issues/2577" in gemm.why


def test_the_same_path_on_flashinfer_064_gets_no_catalogue_verdict_and_says_so():
    def on_064(observation: dict) -> None:
        with_nvcc(observation)
        observation["inenv"]["versions"]["flashinfer-python"] = "0.6.4"

    plan = plan_of("llama-nvfp4-tp8-sm120", on_064)
    gemm = path(plan, "dense GEMM")
    assert gemm.verdict is Verdict.JIT and gemm.jit_found and gemm.catalogue == ()
    assert any("not catalogued for flashinfer-python 0.6.4" in note for note in plan.notes)


def test_a_flashinfer_jit_path_without_nvcc_fails_and_with_one_is_a_found_jit():
    without = path(plan_of("llama-eagle3-tp8-sm120"), "attention")
    assert without.verdict is Verdict.JIT and without.jit_found is False and without.fails
    assert "needs nvcc >= 12.8 for sm_120a" in without.why
    with_ = path(plan_of("llama-eagle3-tp8-sm120", with_nvcc), "attention")
    assert with_.jit_found is True and not with_.fails


def test_a_path_that_could_not_be_observed_is_said_so_and_does_not_fail():
    dense = path(plan_of("gpt-oss-20b-tp8-sm120"), "dense GEMM")
    assert dense.verdict is Verdict.NOT_OBSERVED and not dense.fails
    assert "not observed" in dense.why


def test_on_hopper_the_dense_model_gets_fa3_from_sgl_kernel_flash_ops():
    plan = plan_of("llama-tp8-sm90")
    attention = path(plan, "attention")
    assert (attention.backend, attention.verdict) == ("fa3", Verdict.RUNS)
    assert "flash_ops" in attention.kernels[0] and "sm_90a cubin" in attention.why


def test_an_unusable_observation_is_a_plan_error_not_a_crash():
    observation = copy.deepcopy(fixture("llama-tp8-sm90")["base"])
    observation["inenv"] = {"error": "the env's interpreter exited 1 without a result: ImportError: sglang"}
    plan = assemble.plan_for(observation, 0, catalogue.load())
    assert not plan.ok and plan.error.startswith("the env's interpreter exited 1")
    assert render.render(plan).splitlines()[-1].startswith("no plan: ")


# ------------------------------------------------------------------------------------------------ output


def test_the_json_has_what_the_issue_names():
    payload = plan_of("llama-eagle3-tp8-sm120").as_json()
    assert {"sglang", "capability", "model", "server_args", "paths", "flags"} <= set(payload)
    assert payload["sglang"] == "0.5.9" and payload["capability"] == "12.0"
    assert {"attention_backend", "sampling_backend", "moe_runner_backend", "speculative_algorithm"} <= set(
        payload["server_args"]
    )
    for row in payload["paths"]:
        assert {"component", "backend", "kernels", "verdict", "why"} <= set(row)
        assert row["verdict"] in {v.value for v in Verdict}
    json.dumps(payload)


def test_the_table_lists_every_path_with_its_verdict_and_why():
    plan = plan_of("gpt-oss-20b-tp8-sm120")
    text = render.render(plan)
    assert text.startswith("serve-plan: gpt-oss-20b on simulated NVIDIA RTX PRO 6000 Blackwell x8")
    assert "COMPONENT" in text and "VERDICT" in text
    for row in plan.paths:
        assert row.component in text and render.verdict_text(row) in text
    assert "FAILS: " in text and "MoE (flashinfer_mxfp4: MISSING)" in text


# ------------------------------------------------------------------------------------------------ fixes and check


def test_the_fix_search_replans_with_sglang_and_keeps_only_what_runs():
    """DeepSeek-V3: the field's SGLANG_ENABLE_JIT_DEEPGEMM=0 makes SGLang pick FlashInfer's TRT-LLM FP8 GEMM, SM100
    cubins only; the plan keeps looking and suggests the Triton FP8 GEMM."""
    replay = Replay("deepseek-v3-tp8-sm120")
    observation = fixture("deepseek-v3-tp8-sm120")["base"]
    plan = assemble.plan_for(observation, 0, catalogue.load())
    fix = assemble.find_fix(plan, observation["requests"][0], catalogue.load(), replay)
    assert fix.fixes and fix.flags == ("--sampling-backend", "pytorch", "--fp8-gemm-backend", "triton")
    assert fix.env == {}
    assert "SGLANG_ENABLE_JIT_DEEPGEMM=0: dense GEMM becomes flashinfer_trtllm, missing" in fix.rejected
    tried = replay.asked[0]
    deepgemm_off = next(i for i, r in enumerate(tried) if r["env"] == {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"})
    after = assemble.plan_for(fixture("deepseek-v3-tp8-sm120")["runs"][0], deepgemm_off, catalogue.load())
    assert (path(after, "dense GEMM").backend, path(after, "dense GEMM").verdict) == (
        "flashinfer_trtllm",
        Verdict.MISSING,
    )


def test_the_fix_search_plans_its_likely_answer_beside_the_candidates_not_in_another_interpreter():
    """The seed's model: attention and sampling each fail; both first candidates together are planned in the
    candidates' batch, so the final plan needs no second start of SGLang (seconds of imports on a node)."""
    replay = Replay("llama-eagle3-tp8-sm120")
    observation = fixture("llama-eagle3-tp8-sm120")["base"]
    plan = assemble.plan_for(observation, 0, catalogue.load())
    fix = assemble.find_fix(plan, observation["requests"][0], catalogue.load(), replay)
    assert fix.fixes and fix.flags == ("--attention-backend", "triton", "--sampling-backend", "pytorch")
    assert len(replay.asked) == 1, "the final plan was made again"
    assert replay.asked[0][-1]["server_args"] == {"attention_backend": "triton", "sampling_backend": "pytorch"}


def test_the_fix_search_plans_the_chosen_changes_again_when_the_likely_answer_was_not_them():
    """DeepSeek-V3: the environment candidate needs its own interpreter and the first dense GEMM change is
    rejected, so what is chosen was not planned yet: one more run plans exactly it."""
    replay = Replay("deepseek-v3-tp8-sm120")
    observation = fixture("deepseek-v3-tp8-sm120")["base"]
    plan = assemble.plan_for(observation, 0, catalogue.load())
    fix = assemble.find_fix(plan, observation["requests"][0], catalogue.load(), replay)
    assert len(replay.asked) == 2
    assert replay.asked[1][0]["server_args"] == fix.server_args


def test_the_check_passes_listing_the_flags_when_they_fix_the_model():
    outcome = check.judge(
        fixture("gpt-oss-20b-tp8-sm120")["base"], 0, catalogue.load(), Replay("gpt-oss-20b-tp8-sm120")
    )
    assert outcome.passed
    assert outcome.notes[0].startswith("serve gpt-oss-20b with: --sampling-backend pytorch --moe-runner-backend triton")
    assert "MoE flashinfer_mxfp4 MISSING" in outcome.notes[0]


def test_the_check_fails_when_no_flag_fixes_a_known_wrong_path():
    """NVFP4 on FlashInfer 0.6.3: the cuDNN FP4 GEMM is a known crash, so no remedy clears the dense GEMM."""
    replay = Replay("llama-nvfp4-tp8-sm120")
    outcome = check.judge(fixture("llama-nvfp4-tp8-sm120")["base"], 0, catalogue.load(), replay)
    assert not outcome.passed
    assert "dense GEMM flashinfer mm_fp4 (cutlass) is KNOWN-WRONG" in outcome.message
    assert outcome.message.endswith(
        "the suggested --attention-backend triton --sampling-backend pytorch leave dense GEMM failing"
    )
    cudnn = next(i for i, r in enumerate(replay.asked[0]) if r["server_args"].get("fp4_gemm_runner_backend"))
    tried = assemble.plan_for(fixture("llama-nvfp4-tp8-sm120")["runs"][0], cudnn, catalogue.load())
    gemm = path(tried, "dense GEMM")
    assert (gemm.backend, gemm.verdict, gemm.catalogue) == (
        "flashinfer mm_fp4 (cudnn)",
        Verdict.MISSING,
        ("flashinfer-mm-fp4-cudnn-no-plans-sm120",),
    )


def test_the_check_passes_without_flags_when_every_path_runs():
    observation = fixture("llama-eagle3-tp8-sm120")["base"]
    with_nvcc(observation)
    outcome = check.judge(observation, 0, catalogue.load(), lambda requests: pytest.fail("nothing to fix"))
    assert outcome.passed and outcome.plan.fix is None
    assert "all-reduce nccl: runs" in outcome.notes[0]


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_every_path_a_plan_names_is_one_of_the_components_the_catalogue_may_name(name):
    observed = fixture(name)
    plans = [assemble.plan_for(observed["base"], 0, catalogue.load())]
    plans += [p for run in observed["runs"] for p in assemble.plans(run, catalogue.load())]
    assert {p.component for plan in plans for p in plan.paths} <= set(COMPONENTS)
