"""serve-plan against the real SGLang 0.5.9 (cu128 env: FlashInfer 0.6.3, sgl-kernel 0.3.21, torch 2.9.1) and a
twin with FlashInfer 0.6.4: for every reference model on capabilities 12.0, 10.0 and 9.0, the plan is what
SGLang's own code chooses (each expectation names the line of SGLang 0.5.9 that makes the choice, and the test
reads that line from the installed file), and the kernel verdicts are what the real files say.

Slow tier: conftest's `real` builds the env from the lock. Each capability is planned once (one interpreter for
the six models, about a minute)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import needs_py312

from bwstack.probe import envinspect, fatbin, interp, sealed
from bwstack.probe import main as probe
from bwstack.probe.serveplan import node
from bwstack.serveplan import assemble, catalogue
from bwstack.serveplan.records import Verdict

pytestmark = [pytest.mark.slow, pytest.mark.network, needs_py312]

TARGET = dict(count=8, memory_mib=96 * 1024, name="NVIDIA RTX PRO 6000 Blackwell", interconnect="pcie")
MODELS = {
    "dense": {"model": "llama-3.1-8b-instruct"},
    "moe": {"model": "qwen3-30b-a3b"},
    "mla-fp8": {"model": "deepseek-v3"},
    "mxfp4": {"model": "gpt-oss-20b"},
    "nvfp4": {"model": "llama-3.1-8b-instruct-nvfp4"},
    "eagle3": {
        "model": "llama-3.1-8b-instruct",
        "speculative_algorithm": "EAGLE3",
        "draft": "sglang-eagle3-llama-3.1-8b-instruct",
    },
}
SA = "sglang/srt/server_args.py"
DEFAULT = "default"

# (capability, model) -> {server arg: (value, the SGLang 0.5.9 line that set it, the code on that line)}.
# DEFAULT: SGLang left its dataclass default (the plan then cites the field's line).
CHOICES = {
    # SM120: neither is_hopper_with_cuda_12_3 nor is_sm100_supported, so MHA falls to flashinfer and MLA to
    # triton; GPT-OSS's own branch picks triton; is_blackwell_supported() counts 12, so MXFP4 goes to FlashInfer.
    ("12.0", "dense"): {"attention_backend": ("flashinfer", 1816, "self.attention_backend = (")},
    ("12.0", "moe"): {"attention_backend": ("flashinfer", 1816, "self.attention_backend = ("),
                      "moe_runner_backend": ("auto", DEFAULT, "")},
    ("12.0", "mla-fp8"): {"attention_backend": ("triton", 1833, 'self.attention_backend = "triton"')},
    ("12.0", "mxfp4"): {"attention_backend": ("triton", 1341, 'self.attention_backend = "triton"'),
                        "moe_runner_backend": ("flashinfer_mxfp4", 1372, '= "flashinfer_mxfp4"')},
    ("12.0", "nvfp4"): {"attention_backend": ("flashinfer", 1816, "self.attention_backend = (")},
    ("12.0", "eagle3"): {"attention_backend": ("flashinfer", 1816, "self.attention_backend = ("),
                         "speculative_eagle_topk": (4, 2429, "self.speculative_eagle_topk,")},
    # SM100: trtllm_mha for MHA without topk > 1, trtllm_mla and the TRT-LLM MoE for DeepSeek, fusion on.
    ("10.0", "dense"): {"attention_backend": ("trtllm_mha", 1812, 'self.attention_backend = "trtllm_mha"')},
    ("10.0", "moe"): {"attention_backend": ("trtllm_mha", 1812, 'self.attention_backend = "trtllm_mha"'),
                      "moe_runner_backend": ("flashinfer_trtllm", 1574, '= "flashinfer_trtllm"'),
                      "enable_flashinfer_allreduce_fusion": (True, 1697, "= True")},
    ("10.0", "mla-fp8"): {"attention_backend": ("trtllm_mla", 1283, 'self.attention_backend = "trtllm_mla"'),
                          "quantization": ("fp8", 1301, "self.quantization = quant_method"),
                          "moe_runner_backend": ("flashinfer_trtllm", 1307, '= "flashinfer_trtllm"')},
    ("10.0", "mxfp4"): {"attention_backend": ("trtllm_mha", 1337, 'self.attention_backend = "trtllm_mha"'),
                        "moe_runner_backend": ("flashinfer_mxfp4", 1372, '= "flashinfer_mxfp4"')},
    ("10.0", "nvfp4"): {"attention_backend": ("trtllm_mha", 1812, 'self.attention_backend = "trtllm_mha"')},
    ("10.0", "eagle3"): {"attention_backend": ("flashinfer", 1816, "self.attention_backend = (")},  # topk 4 > 1
    # SM90: FA3 everywhere; GPT-OSS takes triton_kernels.
    ("9.0", "dense"): {"attention_backend": ("fa3", 1803, 'self.attention_backend = "fa3"')},
    ("9.0", "moe"): {"attention_backend": ("fa3", 1803, 'self.attention_backend = "fa3"'),
                     "enable_flashinfer_allreduce_fusion": (True, 1697, "= True")},
    ("9.0", "mla-fp8"): {"attention_backend": ("fa3", 1822, 'self.attention_backend = "fa3"')},
    ("9.0", "mxfp4"): {"attention_backend": ("fa3", 1339, 'self.attention_backend = "fa3"'),
                       "moe_runner_backend": ("triton_kernel", 1395, '= "triton_kernel"')},
    ("9.0", "nvfp4"): {"attention_backend": ("fa3", 1803, 'self.attention_backend = "fa3"')},
    ("9.0", "eagle3"): {"attention_backend": ("fa3", 1803, 'self.attention_backend = "fa3"')},
}  # fmt: skip

# (capability, model) -> {component: (backend, verdict)} for the paths whose kernels do not depend on the host's
# nvcc (FlashInfer's JIT paths do, and are checked apart).
PATHS = {
    ("12.0", "mla-fp8"): {"attention": ("triton", Verdict.RUNS), "dense GEMM": ("deep_gemm", Verdict.MISSING),
                          "MoE": ("triton", Verdict.RUNS)},
    ("12.0", "mxfp4"): {"attention": ("triton", Verdict.RUNS), "MoE": ("flashinfer_mxfp4", Verdict.MISSING)},
    ("12.0", "moe"): {"MoE": ("triton", Verdict.RUNS), "dense GEMM": ("cublas", Verdict.RUNS)},
    ("12.0", "nvfp4"): {"dense GEMM": ("flashinfer mm_fp4 (cutlass)", Verdict.KNOWN_WRONG)},
    ("12.0", "eagle3"): {"all-reduce": ("nccl", Verdict.RUNS), "speculative decoding": (
        "EAGLE3 steps=5 topk=4 draft_tokens=8", Verdict.RUNS)},
    ("10.0", "dense"): {"attention": ("trtllm_mha", Verdict.RUNS)},
    ("10.0", "mla-fp8"): {"attention": ("trtllm_mla", Verdict.RUNS), "MoE": ("flashinfer_trtllm", Verdict.RUNS)},
    ("10.0", "mxfp4"): {"MoE": ("flashinfer_mxfp4", Verdict.RUNS)},
    ("9.0", "dense"): {"attention": ("fa3", Verdict.RUNS)},
    ("9.0", "mxfp4"): {"attention": ("fa3", Verdict.RUNS), "MoE": ("triton_kernels", Verdict.RUNS)},
    ("9.0", "nvfp4"): {"quantization": ("modelopt_fp4", Verdict.MISSING)},
}  # fmt: skip


def _requests() -> list[dict]:
    return [{"id": key, "tp": 8, **value} for key, value in MODELS.items()]


_OBSERVED: dict[tuple[str, str], node.Observation] = {}


def observation(env: Path, capability: str) -> node.Observation:
    key = (str(env), capability)
    if key not in _OBSERVED:
        device = node.Device(node.SIMULATED, capability, **TARGET)
        _OBSERVED[key] = node.observe(env, device, _requests())
    return _OBSERVED[key]


def observed(env: Path, capability: str) -> dict:
    return observation(env, capability).as_dict()


def plan(env: Path, capability: str, model: str):
    return assemble.plan_for(observed(env, capability), list(MODELS).index(model), catalogue.load())


def _line(env: Path, rel: str, number: int) -> str:
    return (envinspect.site_packages(env) / rel).read_text().splitlines()[number - 1].strip()


@pytest.mark.parametrize(("capability", "model"), sorted(CHOICES), ids=[f"{c}-{m}" for c, m in sorted(CHOICES)])
def test_the_plan_is_what_sglangs_own_code_chooses(real, capability, model):
    result = plan(real.ml_env, capability, model)
    assert result.error is None and result.sglang == "0.5.9"
    for name, (value, line, code) in CHOICES[(capability, model)].items():
        assert result.server_args[name] == value, name
        if line == DEFAULT:
            assert result.decisions[name].endswith("(default)"), name
            continue
        assert result.decisions[name].startswith(f"{SA}:{line}: "), (name, result.decisions[name])
        assert code in _line(real.ml_env, SA, line), (name, line)


@pytest.mark.parametrize(("capability", "model"), sorted(PATHS), ids=[f"{c}-{m}" for c, m in sorted(PATHS)])
def test_the_kernel_verdicts_are_what_the_real_files_say(real, capability, model):
    rows = {p.component: (p.backend, p.verdict) for p in plan(real.ml_env, capability, model).paths}
    for component, expected in PATHS[(capability, model)].items():
        assert rows[component] == expected, component


def test_fa3s_verdict_is_sgl_kernels_flash_ops_fatbin_read_directly(real):
    """SM90 plans FA3 and it runs; the same library has nothing for SM120 (SGLang's own gate refuses it first)."""
    flash_ops = next((envinspect.site_packages(real.ml_env) / "sgl_kernel").glob("flash_ops*.so"))
    found = fatbin.entries(flash_ops)
    assert fatbin.covers(found, "9.0")[0] and not fatbin.covers(found, "12.0")[0]
    row = next(p for p in plan(real.ml_env, "9.0", "dense").paths if p.component == "attention")
    assert fatbin.covers(found, "9.0")[1] in row.why


def test_sm120s_mxfp4_moe_verdict_counts_flashinfer_cubins_own_architectures(real):
    sp = envinspect.site_packages(real.ml_env)
    archs = set()
    for cubin in (sp / "flashinfer_cubin" / "cubins").rglob("*.cubin"):
        if "batched_gemm" in str(cubin):
            flags = int.from_bytes(cubin.read_bytes()[48:52], "little")
            archs.add((flags >> 8) & 0xFF)
    assert archs and all(a // 10 == 10 for a in archs)  # SM100 family only
    row = next(p for p in plan(real.ml_env, "12.0", "mxfp4").paths if p.component == "MoE")
    assert "none for 12.0" in row.why and "trtllm_fused_moe_kernel_launcher.cu" in row.why


def test_deepgemm_verdict_lists_the_kernel_sources_sgl_kernel_ships(real):
    impls = envinspect.site_packages(real.ml_env) / "deep_gemm" / "include" / "deep_gemm" / "impls"
    shipped = sorted({p.name.split("_")[0] for p in impls.glob("sm[0-9]*_*.cuh")})
    assert shipped == ["sm100", "sm90"]  # and smxx_*: architecture-independent helpers
    row = next(p for p in plan(real.ml_env, "12.0", "mla-fp8").paths if p.component == "dense GEMM")
    assert "sm_90, sm_100 implementations only" in row.why
    assert row.catalogue == ("deepgemm-no-sm120",)


def test_flashinfer_jit_paths_say_what_this_hosts_nvcc_can_do(real):
    result = plan(real.ml_env, "12.0", "dense")
    nvcc = observed(real.ml_env, "12.0")["kernels"]["nvcc"]
    row = next(p for p in result.paths if p.component == "attention")
    assert row.verdict is Verdict.JIT and "-gencode=arch=compute_120a,code=sm_120a" in row.why
    assert row.jit_found is bool(nvcc.get("nvcc") and (nvcc.get("compile") or {}).get("ok"))


def test_the_seeds_all_reduce_is_nccl_as_bwstack_features_reports(real):
    observation = observed(real.ml_env, "12.0")
    row = next(p for p in plan(real.ml_env, "12.0", "eagle3").paths if p.component == "all-reduce")
    custom = observation["inenv"]["observations"][list(MODELS).index("eagle3")]["steps"]["all_reduce"]["custom"]
    assert custom["disabled"] is True and custom["site"].startswith(
        "sglang/srt/distributed/device_communicators/custom_all_reduce.py:"
    )
    rel, line = custom["site"].rsplit(":", 1)
    # custom_all_reduce.py:146-147 in 0.5.9: `if world_size > 2 and not full_nvlink:` then the warning
    assert _line(real.ml_env, rel, int(line) - 1) == "if world_size > 2 and not full_nvlink:"
    assert "PCIe-only GPUs" in custom["why"]
    state = observation["features"]["torch_symm_mem_allreduce"]["state"]
    assert f"bwstack features: {state}" in row.why and row.backend == "nccl"


def test_flashinfer_064_changes_what_the_catalogue_may_say_about_nvfp4(real_flashinfer_064):
    result = plan(real_flashinfer_064, "12.0", "nvfp4")
    assert result.packages["flashinfer-python"] == "0.6.4"
    row = next(p for p in result.paths if p.component == "dense GEMM")
    assert row.backend == "flashinfer mm_fp4 (cutlass)" and row.verdict is Verdict.JIT
    assert any("not catalogued for flashinfer-python 0.6.4" in n for n in result.notes)


@pytest.mark.parametrize("capability", ["12.0", "10.0", "9.0"])
def test_flashinfer_064_makes_the_same_choices(real, real_flashinfer_064, capability):
    for model in MODELS:
        before = plan(real.ml_env, capability, model)
        after = plan(real_flashinfer_064, capability, model)
        assert before.server_args == after.server_args, model
        assert [(p.component, p.backend) for p in before.paths] == [(p.component, p.backend) for p in after.paths]


def test_the_planner_names_what_it_loaded_outside_the_env_and_nothing_of_its_own_run(real):
    """What a recorded plan is reused against (sealed.loaded_changed): the base interpreter's modules and the
    system libraries, stamped; not the env (its manifest covers it), nor the run's own folders, which are gone."""
    loaded = observation(real.ml_env, "12.0").loaded
    assert loaded, "the planner's interpreter named what it loaded"
    env = os.path.realpath(real.ml_env)
    paths = [entry[0] for entry in loaded]
    assert not [p for p in paths if p == env or p.startswith(env + "/")]
    assert not [p for p in paths if "/bwstack-serveplan-" in p], "the run's own folder"
    assert any(p.endswith("/json/__init__.py") for p in paths), "the base interpreter's standard library"
    assert sealed.loaded_changed(loaded, "SGLang's planner") is None


REGISTERING = """
import importlib, json, pkgutil, sys
ns = {"__name__": "planner"}
exec(compile(open(sys.argv[1]).read(), "serveplan.py", "exec"), ns)
from sglang.srt.models import registry
whole = dict(registry.ModelRegistry.models)
by = {}
package = importlib.import_module("sglang.srt.models")
for _, name, ispkg in pkgutil.iter_modules(package.__path__, "sglang.srt.models."):
    entry = getattr(sys.modules.get(name), "EntryClass", None)
    for cls in entry if isinstance(entry, list) else [entry] if entry else []:
        by[cls.__name__] = name.rsplit(".", 1)[-1]
missed = [[a, by.get(a)] for a in whole if by.get(a) not in ns["_modules_registering"]({a})[0]]
print(json.dumps({"archs": len(whole), "missed": missed}))
"""


def registry_misses(env: Path) -> dict:
    """Every architecture the env's SGLang registers, and those whose registering module the planner's narrowed
    import (probe/scripts/serveplan.py, _modules_registering) would leave out."""
    sp = envinspect.site_packages(env)
    with probe.StandInLibcuda(sp) as stand_in, tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "serveplan.py"
        script.write_text(interp.script_source("serveplan"))
        environ = node._child_env(dict(os.environ), None, stand_in.folder())
        done = subprocess.run(
            [str(Path(env) / "bin" / "python"), "-c", REGISTERING, str(script)],
            capture_output=True, text=True, env=environ, timeout=600, cwd=tmp,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_planners_narrowed_model_registry_finds_the_module_of_every_architecture_sglang_registers(real):
    """The planner imports only the model modules that may register its requests' architectures; for each of
    the 0.5.9 registry's architectures, the module that registers it is among them."""
    found = registry_misses(real.ml_env)
    assert found["archs"] > 100, "SGLang's registry imported its model modules"
    assert found["missed"] == []
